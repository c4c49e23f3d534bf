"""QK snapshots of a rank's share of the heads (``assignment``): the distributed
``QKSnapshots``.

Every rank plans the same evaluations (the same layers, the same rotating head windows) and
takes part in the same row fetches (``fetch.fetch_rows``: a collective for sharded weights),
but snapshots only the rows its heads need (and whole control matrices of the layers it owns)
and measures only its heads: about 1/world of the work each. Where a layer's heads are local
to one rank each (tensor-parallel heads; FSDP2 shards on head boundaries) a rank measures its
local heads and its Q/K rows never move. A snapshot is a mapping of
parameter name to ``fetch.Rows``; ``expand_job`` turns a job's snapshots into full-shape
tensors on the monitor thread (zeros in the rows of other ranks' heads), which the monitors
read exactly as in one process.
"""

from __future__ import annotations

import dataclasses

import torch

from agent.discovery import AttentionSite
from agent.discovery.controls import control_label
from agent.distributed.assignment import control_rank, head_rank, rows_needed
from agent.distributed.fetch import Rows, fetch_rows, head_owners
from agent.distributed.world import World
from agent.probes import QKJob, QKSnapshots


class ShardedQKSnapshots(QKSnapshots):
    """``QKSnapshots`` that hold and measure this rank's share only (module docstring)."""

    def __init__(self, sites: list[AttentionSite], *, world: World, **kwargs) -> None:
        super().__init__(sites, **kwargs)
        self.world = world
        self._index = {site.name: i for i, site in enumerate(sites)}
        # Per layer: the rank holding each query head's rows, when heads are local (TP, FSDP2
        # shards on head boundaries); None: round robin (``assignment``).
        self.owners = {site.name: _owners(site, world) for site in sites}

    def _take(self, sites: list[AttentionSite]) -> dict[str, dict[str, Rows]]:
        """This rank's rows of ``sites``, fetched for every rank at once."""
        params: list[tuple[str, torch.Tensor]] = []
        needs = []
        owner: list[str] = []
        for site in sites:
            controls = self.controls.get(site.name, {})
            live = {**site.parameters_to_snapshot(), **controls}
            layer, owners = self._index[site.name], self.owners[site.name]
            per_rank = [
                rows_needed(site, layer, r, self.world.size, list(controls), owners)
                for r in range(self.world.size)
            ]
            for name, p in live.items():
                params.append((name, p))
                needs.append([need.get(name, []) for need in per_rank])
                owner.append(site.name)
        fetched = fetch_rows(params, needs, self.world, self.device)
        out: dict[str, dict[str, Rows]] = {site.name: {} for site in sites}
        for (name, _), site_name in zip(params, owner, strict=True):
            if name in fetched:
                out[site_name][name] = fetched[name]
        return out

    def _job(
        self, step: int, site: AttentionSite, previous: dict, current: dict, heads: list[int]
    ) -> QKJob | None:
        layer = self._index[site.name]
        owners = self.owners[site.name]
        world, rank = self.world.size, self.world.rank
        mine = [h for h in heads if head_rank(layer, h, site.num_heads, world, owners) == rank]
        owns_controls = control_rank(layer, self.world.size) == self.world.rank
        if not (mine or owns_controls and self.controls.get(site.name)):
            return None
        controls = self.controls.get(site.name, {}) if owns_controls else {}
        labels = {name: control_label(site, name) for name in controls}
        return QKJob(
            step,
            site,
            previous,
            current,
            mine,
            labels,
            self.directions,
            control_rows=self.control_rows,
        )


def _owners(site: AttentionSite, world: World) -> list[int] | None:
    q, k = site.q, site.k
    if q.input_major or k.input_major or q.latent is not None or k.latent is not None:
        return None
    return head_owners(
        site.live_parameters[q.weight_name],
        list(q.starts),
        site.live_parameters[k.weight_name],
        list(k.starts),
        [site.kv_head(h) for h in range(site.num_heads)],
        site.head_dim,
        world,
    )


def expand_job(job: QKJob) -> QKJob:
    """The job with full-shape snapshot tensors (monitor thread)."""
    return dataclasses.replace(
        job,
        previous={k: _full(v) for k, v in job.previous.items()},
        current={k: _full(v) for k, v in job.current.items()},
    )


def _full(value: Rows | torch.Tensor) -> torch.Tensor:
    return value.full() if isinstance(value, Rows) else value
