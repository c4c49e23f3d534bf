"""Fetching the rows of parameters that a rank's share of the monitor work needs.

``fetch_rows(params, needs, world, device)``: ``params`` is a list of ``(name, parameter)``;
``needs[i][r]`` is what rank ``r`` needs of ``params[i]`` (``assignment.Need``: None for every
row, a sorted list of rows of dim 0, or an empty list). Returns this rank's ``Rows`` per name
(fp32 copies on ``device``; None: next to the weight). Every rank calls it with the same
arguments (the plan is deterministic): for sharded weights it is a collective.

- a plain tensor (DDP: every rank holds the whole weight) or a replicated DTensor: the rows
  are copied locally, no communication;
- a DTensor sharded along one dimension on one mesh dimension (FSDP2's ``Shard(0)``, HSDP, a
  column-parallel projection's ``Shard(0)``, a row-parallel one's ``Shard(1)``): each owner
  sends each rank what it holds of the rows that rank needs, with point-to-point sends
  batched into one ``batch_isend_irecv`` per process group (fp32); nothing else of the weight
  moves, never a full unshard;
- any other placement (a 2-D FSDP + TP strided shard): ``full_tensor()`` of that parameter on
  every rank, with a warning naming it once.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from agent.distributed.assignment import Need
from agent.distributed.world import World

try:
    from torch.distributed.tensor import DTensor, Replicate, Shard
except ImportError:  # torch without DTensor: every parameter is a plain tensor
    DTensor = Replicate = Shard = None  # type: ignore[assignment,misc]

_warned: set[str] = set()


@dataclass
class Rows:
    """Some rows (dim 0) of a parameter, as a sharded snapshot holds them."""

    index: torch.Tensor | None  # (n,) int64 rows held; None: every row
    values: torch.Tensor  # (n, ...) fp32, or the whole parameter when index is None
    shape: tuple[int, ...]  # the parameter's full shape

    def full(self) -> torch.Tensor:
        """The parameter's full shape with the held rows filled in (zeros elsewhere)."""
        if self.index is None:
            return self.values
        out = self.values.new_zeros(self.shape)
        out[self.index.to(out.device)] = self.values
        return out


def is_sharded(p: torch.Tensor) -> bool:
    """Whether ``p`` is a DTensor that is not replicated everywhere (no rank holds it whole)."""
    return (
        DTensor is not None
        and isinstance(p, DTensor)
        and not all(isinstance(pl, Replicate) for pl in p.placements)
    )


def fetch_rows(
    params: list[tuple[str, torch.Tensor]],
    needs: list[list[Need]],
    world: World,
    device: str | None = None,
) -> dict[str, Rows]:
    """See the module docstring."""
    out: dict[str, Rows] = {}
    groups: dict[Any, list[tuple[str, torch.Tensor, list[Need], int]]] = {}
    for (name, p), need in zip(params, needs, strict=True):
        p = p.detach()
        sharding = _sharding(p)
        if sharding is None:  # plain, replicated, or a layout fetched whole
            whole = _whole(name, p)
            if need[world.rank] != []:
                out[name] = _local_rows(whole, need[world.rank], tuple(p.shape), device)
            continue
        mesh_dim, dim = sharding
        groups.setdefault(p.device_mesh.get_group(mesh_dim), []).append((name, p, need, dim))
    for group, members in groups.items():
        out.update(_exchange(group, members, world, device))
    return out


def head_owners(
    q: torch.Tensor, q_starts: list[int], k: torch.Tensor, k_starts: list[int],
    kv_of: list[int], head_dim: int, world: World,
) -> list[int] | None:  # fmt: skip
    """The rank holding each query head's rows when the Q and K weights ([out, d]) are
    sharded by rows over the agent's whole group and each query head lies on one rank with
    its KV head (``kv_of[h]``); None otherwise (then heads go round robin)."""
    owners = []
    for p, starts in ((q, q_starts), (k, k_starts)):
        sharding = _sharding(p) if world.collective else None
        if sharding is None or sharding[1] != 0:
            return None
        group = p.device_mesh.get_group(sharding[0])
        ranks = [_world_rank(world, g) for g in dist.get_process_group_ranks(group)]
        if len(ranks) != world.size or None in ranks:
            return None
        bounds = [_bounds(p.shape[0], len(ranks), g) for g in range(len(ranks))]
        where = []
        for start in starts:
            g = next((g for g, (lo, hi) in enumerate(bounds) if lo <= start < hi), None)
            if g is None or start + head_dim > bounds[g][1]:
                return None
            where.append(ranks[g])
        owners.append(where)
    q_owner, k_owner = owners
    if any(q_owner[h] != k_owner[g] for h, g in enumerate(kv_of)):
        return None
    return q_owner


def _sharding(p: torch.Tensor) -> tuple[int, int] | None:
    """(mesh dimension, tensor dimension) of ``p``'s one shard, the other mesh dimensions
    replicated; None for a plain or replicated tensor or any other layout."""
    if not is_sharded(p):
        return None
    dims = [i for i, pl in enumerate(p.placements) if not isinstance(pl, Replicate)]
    if len(dims) == 1 and type(p.placements[dims[0]]) is Shard:
        return dims[0], p.placements[dims[0]].dim % p.dim()
    return None


def _whole(name: str, p: torch.Tensor) -> torch.Tensor:
    if DTensor is None or not isinstance(p, DTensor):
        return p
    if not is_sharded(p):
        return p.to_local()
    if name not in _warned:
        _warned.add(name)
        warnings.warn(
            f"mechwatch: {name} is sharded as {p.placements}, which the row fetch does not "
            "cover: each snapshot gathers it whole (full_tensor) on every rank",
            stacklevel=4,
        )
    return p.full_tensor()


def _local_rows(p: torch.Tensor, need: Need, shape: tuple[int, ...], device: str | None) -> Rows:
    target = p.device if device is None else torch.device(device)
    if need is None:
        return Rows(None, _fp32(p, target), shape)
    index = torch.tensor(need, dtype=torch.long)
    return Rows(index, _fp32(p[index.to(p.device)], target), shape)


def _fp32(t: torch.Tensor, target: torch.device) -> torch.Tensor:
    non_blocking = t.is_cuda and target.type == "cpu"
    return t.to(dtype=torch.float32).to(target, non_blocking=non_blocking, copy=True)


def _bounds(n: int, parts: int, index: int) -> tuple[int, int]:
    """[lo, hi) of shard ``index`` of ``n`` along a dimension in ``parts`` (torch.chunk, as
    DTensor's Shard)."""
    size = math.ceil(n / parts) if n else 0
    return min(index * size, n), min((index + 1) * size, n)


def _exchange(
    group: Any,
    members: list[tuple[str, torch.Tensor, list[Need], int]],
    world: World,
    device: str | None,
) -> dict[str, Rows]:
    """One batched point-to-point exchange on ``group`` of the needed rows (dim 0) of
    parameters sharded along ``dim``: along dim 0 an owner sends the needed rows it holds;
    along another dimension every owner sends its block of the needed rows."""
    ranks = dist.get_process_group_ranks(group)  # group rank -> job-wide rank
    me = dist.get_rank(group)
    peers = [_world_rank(world, g) for g in ranks]
    send: dict[int, list[torch.Tensor]] = {g: [] for g in range(len(ranks))}
    recv_numel = dict.fromkeys(range(len(ranks)), 0)
    plan = []  # per parameter: name, shape, dim, rows needed here, [(owner, rows, piece shape)]
    for name, p, need, dim in members:
        shape, local = tuple(p.shape), p.to_local()
        lo, hi = _bounds(shape[dim], len(ranks), me)
        assert local.shape[dim] == hi - lo, (name, tuple(local.shape), dim, lo, hi)
        for g, peer in enumerate(peers):
            rows = _held(_wanted(need[peer], shape[0]) if peer is not None else [], dim, lo, hi)
            if rows and g != me and local.numel():
                send[g].append(local[_local_index(rows, dim, lo, local)].reshape(-1).float())
        mine = _wanted(need[world.rank], shape[0])
        pieces = []
        for g in range(len(ranks)):
            g_lo, g_hi = _bounds(shape[dim], len(ranks), g)
            rows = _held(mine, dim, g_lo, g_hi)
            piece = [len(rows), *shape[1:]]
            if dim:
                piece[dim] = g_hi - g_lo
            if rows and math.prod(piece):
                pieces.append((g, rows, piece, g_lo))
                recv_numel[g] += math.prod(piece) if g != me else 0
        plan.append((name, shape, dim, mine, pieces, lo, local))
    buffers = _send_and_receive(group, ranks, me, send, recv_numel, members[0][1].to_local())
    offsets = dict.fromkeys(range(len(ranks)), 0)
    out: dict[str, Rows] = {}
    for name, shape, dim, mine, pieces, lo, local in plan:
        if not mine:
            continue
        parts = []
        for g, rows, piece, _ in pieces:
            if g == me:
                parts.append(local[_local_index(rows, dim, lo, local)].float())
                continue
            count = math.prod(piece)
            parts.append(buffers[g][offsets[g] : offsets[g] + count].view(*piece))
            offsets[g] += count
        values = torch.cat(parts, dim=dim)
        target = values.device if device is None else torch.device(device)
        index = None if len(mine) == shape[0] else torch.tensor(mine, dtype=torch.long)
        out[name] = Rows(index, _fp32(values, target), shape)
    return out


def _wanted(need: Need, n: int) -> list[int]:
    return list(range(n)) if need is None else need


def _held(rows: list[int], dim: int, lo: int, hi: int) -> list[int]:
    """The ``rows`` (dim 0) an owner of [lo, hi) along ``dim`` sends: along dim 0 those in its
    range, along another dimension all of them (its block of each)."""
    return [r for r in rows if lo <= r < hi] if dim == 0 else rows


def _local_index(rows: list[int], dim: int, lo: int, local: torch.Tensor) -> torch.Tensor:
    shifted = [r - lo for r in rows] if dim == 0 else rows
    return torch.tensor(shifted, dtype=torch.long, device=local.device)


def _send_and_receive(
    group: Any,
    ranks: list[int],
    me: int,
    send: dict[int, list[torch.Tensor]],
    recv_numel: dict[int, int],
    like: torch.Tensor,
) -> dict[int, torch.Tensor]:
    ops, buffers = [], {}
    for g in range(len(ranks)):
        if g == me:
            continue
        if send[g]:
            ops.append(dist.P2POp(dist.isend, torch.cat(send[g]), ranks[g], group=group))
        if recv_numel[g]:
            buffers[g] = torch.empty(recv_numel[g], dtype=torch.float32, device=like.device)
            ops.append(dist.P2POp(dist.irecv, buffers[g], ranks[g], group=group))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return buffers


def _world_rank(world: World, global_rank: int) -> int | None:
    """The agent's rank of a job-wide rank (None: not in the agent's group)."""
    if not world.collective:
        return global_rank
    try:
        return dist.get_group_rank(world.group, global_rank)
    except (ValueError, RuntimeError):
        return None
