"""Fetching the rows of parameters that a rank's share of the monitor work needs.

``fetch_rows(params, needs, world, device)``: ``params`` is a list of ``(name, parameter)``;
``needs[i][r]`` is what rank ``r`` needs of ``params[i]`` (``assignment.Need``: None for every
row, a sorted list of rows of dim 0, or an empty list). Returns this rank's ``Rows`` per name
(fp32 copies on ``device``; None: next to the weight). Every rank calls it with the same
arguments (the plan is deterministic): for sharded weights it is a collective.

- a plain tensor (DDP: every rank holds the whole weight) or a replicated DTensor: the rows
  are copied locally, no communication;
- a DTensor sharded along dim 0 on one mesh dimension (FSDP2's ``Shard(0)``, HSDP, a
  column-parallel projection): each owner sends each rank the rows it needs of the owner's
  shard, with point-to-point sends batched into one ``batch_isend_irecv`` per process group
  (fp32); nothing else of the weight moves, never a full unshard;
- any other placement (a 2-D FSDP + TP strided shard, a row-wise shard): ``full_tensor()`` of
  that parameter on every rank, with a warning naming it once.
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
    groups: dict[Any, list[tuple[str, torch.Tensor, list[Need]]]] = {}
    for (name, p), need in zip(params, needs, strict=True):
        p = p.detach()
        shard_dim = _shard_mesh_dim(p)
        if shard_dim is None or shard_dim < 0:  # plain, replicated, or fetched whole
            whole = _whole(name, p)
            if need[world.rank] != []:
                out[name] = _local_rows(whole, need[world.rank], tuple(p.shape), device)
            continue
        group = p.device_mesh.get_group(shard_dim)
        groups.setdefault(group, []).append((name, p, need))
    for group, members in groups.items():
        out.update(_exchange(group, members, world, device))
    return out


def _shard_mesh_dim(p: torch.Tensor) -> int | None:
    """The mesh dimension ``p`` is sharded on along dim 0, when that is its only shard."""
    if not is_sharded(p):
        return None
    dims = [i for i, pl in enumerate(p.placements) if not isinstance(pl, Replicate)]
    if len(dims) == 1 and type(p.placements[dims[0]]) is Shard and p.placements[dims[0]].dim == 0:
        return dims[0]
    return -1  # another layout: fetched whole


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
    """Rows [lo, hi) of shard ``index`` of ``n`` rows in ``parts`` (torch.chunk, as DTensor)."""
    size = math.ceil(n / parts) if n else 0
    return min(index * size, n), min((index + 1) * size, n)


def _wanted(need: Need, n: int) -> list[int]:
    return list(range(n)) if need is None else need


def _exchange(
    group: Any,
    members: list[tuple[str, torch.Tensor, list[Need]]],
    world: World,
    device: str | None,
) -> dict[str, Rows]:
    """One batched point-to-point exchange of the needed rows of dim-0 shards on ``group``."""
    ranks = dist.get_process_group_ranks(group)  # group rank -> global rank
    me = dist.get_rank(group)
    peers = [_world_rank(world, g) for g in ranks]
    send: dict[int, list[torch.Tensor]] = {g: [] for g in range(len(ranks))}
    recv_numel = dict.fromkeys(range(len(ranks)), 0)
    plan = []  # per parameter: (name, p, [(src, rows it sends)], rows needed here, lo, shard)
    for name, p, need in members:
        n, local = p.shape[0], p.to_local()
        row_numel = math.prod(p.shape[1:])
        lo, hi = _bounds(n, len(ranks), me)
        assert local.shape[0] == hi - lo, (name, tuple(local.shape), lo, hi)
        for g in range(len(ranks)):
            theirs = [] if peers[g] is None else _wanted(need[peers[g]], n)
            rows = [r - lo for r in theirs if lo <= r < hi]
            if rows and g != me:
                index = torch.tensor(rows, dtype=torch.long, device=local.device)
                send[g].append(local[index].reshape(-1).float())
        mine = _wanted(need[world.rank], n) if need[world.rank] != [] else []
        pieces = []
        for g in range(len(ranks)):
            g_lo, g_hi = _bounds(n, len(ranks), g)
            rows = [r for r in mine if g_lo <= r < g_hi]
            pieces.append((g, rows))
            if g != me:
                recv_numel[g] += len(rows) * row_numel
        plan.append((name, p, pieces, mine, lo, local))
    buffers = _send_and_receive(group, ranks, me, send, recv_numel, members[0][1].to_local())
    offsets = dict.fromkeys(range(len(ranks)), 0)
    out: dict[str, Rows] = {}
    for name, p, pieces, mine, lo, local in plan:
        if not mine:
            continue
        row_shape = tuple(p.shape[1:])
        parts = []
        for g, rows in pieces:
            if not rows:
                continue
            if g == me:
                index = torch.tensor([r - lo for r in rows], dtype=torch.long, device=local.device)
                parts.append(local[index].float())
                continue
            count = len(rows) * math.prod(row_shape)
            parts.append(buffers[g][offsets[g] : offsets[g] + count].view(len(rows), *row_shape))
            offsets[g] += count
        values = torch.cat(parts)
        target = values.device if device is None else torch.device(device)
        whole = len(mine) == p.shape[0]
        index = None if whole else torch.tensor(mine, dtype=torch.long)
        out[name] = Rows(index, _fp32(values, target), tuple(p.shape))
    return out


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
