"""The measurement pipeline of one rank in a distributed job: every rank gets the same samples
at the same step.

``DistributedMeasurements`` is ``agent.measurements.Measurements`` with the local values
exchanged at each read-out step (``exchange``: one gather of a small vector; at a QK apply
step one ``all_gather_object`` that also carries the QK samples), on the training thread only:

- symptoms (every ``symptoms.every`` steps): each rank's buffered losses and grad norms (or
  its share of the squared grad norm), merged over the ranks;
- routers (every ``router.every`` steps): each rank's device-side sums, summed; each router's
  weight statistics from its assigned rank, read at the read-out, or for a weight sharded by
  FSDP2 in the first training forward after it (where the weight is whole: those two samples
  then describe the previous read-out step and arrive one read-out later);
- QK spectra: each rank snapshots and measures its share of the heads
  (``snapshots.ShardedQKSnapshots``) on its monitor thread; the results measured at step t are
  gathered at t + ``scheduling.apply_lag`` on every rank, even where a rank's job failed or
  had nothing to do (its part is then missing on every rank alike).

No step without a read-out runs a collective; a local failure never skips one (the failed
part is flagged and left out everywhere, and named in ``notes``). A collective that fails
raises ``world.RankFailure`` out of ``agent.step``: the job stops.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from agent.discovery import AttentionSite
from agent.distributed.assignment import router_rank
from agent.distributed.exchange import (
    FAILED,
    GIVEN_COUNT,
    GIVEN_SUM,
    LOSS_COUNT,
    LOSS_SUM,
    NOT_DUE,
    OK,
    SQUARE_COUNT,
    SQUARE_SUM,
    Layout,
    merge,
    pack_values,
)
from agent.distributed.fetch import is_sharded
from agent.distributed.snapshots import ShardedQKSnapshots, expand_job
from agent.distributed.world import World
from agent.grad_norm import NO_GRADIENTS
from agent.measurements import Measurements
from agent.probes import QKJob, QKSnapshots, compute_qk_samples
from agent.router_probe import WEIGHT_STATS
from agent.samples import Sample
from agent.step_inputs import Scalar

try:
    from torch.distributed.tensor import DTensor, Shard
except ImportError:  # pragma: no cover - torch without DTensor
    DTensor = Shard = None  # type: ignore[assignment,misc]


class DistributedMeasurements(Measurements):
    """See the module docstring. ``world`` is this rank's ``World``."""

    adaptive_budget = False  # each rank would time its own share and plan its own layers
    process_worker = False  # the jobs are expanded per rank (expand_job) on the monitor thread

    def __init__(self, *args: Any, world: World, **kwargs: Any) -> None:
        self.world = world  # before the base class builds the QK snapshots
        super().__init__(*args, **kwargs)
        self._squares: list[tuple[int, Scalar]] = []
        self._qk_due: list[int] = []
        self._sharded_routers = [is_sharded(site.weight()) for site in self.router_sites]

    def _qk_snapshots(self, sites: list[AttentionSite], **kwargs: Any) -> QKSnapshots:
        return ShardedQKSnapshots(sites, world=self.world, **kwargs)

    # -- the training thread -----------------------------------------------------------------
    def _measure_grad_norm(self, step: int) -> None:
        """This rank's share of the squared grad norm, summed over the ranks at the read-out."""
        share = self._guarded(
            "grad norm", lambda: grad_square_share(self.model, self.world.size), None
        )
        if share is not None:
            self._squares.append((step, share))
            self._own_grad_steps.add(step)
        else:  # no gradient on this rank: cleared before agent.step (agent.grad_norm)
            self.report("grad norm", NO_GRADIENTS)

    def collect(self, step: int) -> list[Sample]:
        lag = self.config.scheduling.apply_lag
        self._hand_over_routers(step)
        for job in self._guarded("qk snapshot", lambda: self.qk.on_step(step), []):
            self._pending.append((step + lag, self._submit_job(job)))
        if self.qk.evaluated == step:  # set by every rank's plan, even where a snapshot failed
            self._qk_due.append(step + lag)
        layout = Layout(
            step,
            self.config.symptoms.every,
            tuple(site.num_experts for site in self.router_sites),
            step % self.config.symptoms.every == 0,
            bool(self.router_sites) and step % self.config.router.every == 0,
        )
        qk_due = step in self._qk_due
        if not (layout.symptoms or layout.routers or qk_due):
            return []
        self._qk_due = [due for due in self._qk_due if due != step]
        local = self._local(layout)
        if qk_due:
            qk, error = self._qk_results(step)
            payload = {"packed": local.cpu().tolist(), "qk": qk, "error": error}
            payloads = self.world.gather_objects(payload)  # RankFailure: the agent stops
            gathered = torch.tensor([p["packed"] for p in payloads], dtype=torch.float64)
            qk_lists = [p["qk"] for p in payloads]
        else:
            gathered, qk_lists = self.world.gather(local), None
        samples, self.now, self.notes = merge(gathered, layout, self.router_sites, qk_lists)
        if qk_due:
            for rank, p in enumerate(payloads):
                if p["error"] is not None:
                    self.notes.failed.setdefault(rank, []).append("qk monitor")
        for rank, parts in self.notes.failed.items():
            if rank != self.world.rank:
                self.report(
                    f"rank {rank}",
                    f"{', '.join(parts)} failed on rank {rank} (its event log says why); "
                    "left out of the read-out on every rank",
                )
        return self._check_own_grad_norm(samples)

    def restart(self) -> None:
        super().restart()
        self._squares.clear()
        self._qk_due.clear()
        for j in range(len(self.router_sites)):
            self.router_probe.take_captured(j)
        self.router_probe._capture.clear()

    # -- parts ---------------------------------------------------------------------------------
    def _local(self, layout: Layout) -> torch.Tensor:
        """This rank's vector (``exchange.Layout``); a part that fails is flagged FAILED."""
        entries: list[tuple[int, Scalar]] = [(0, float(layout.step)), (1, time.time())]
        for flag_at, due, part, what in (
            (2, layout.symptoms, self._symptom_entries, "symptoms"),
            (3, layout.routers, self._router_entries, "router probe"),
        ):
            if not due:
                entries.append((flag_at, NOT_DUE))
                continue
            values = self._guarded(what, lambda p=part: p(layout), None, clear=True)
            entries.append((flag_at, OK if values is not None else FAILED))
            entries += values or []
        for err in self.router_probe.errors:
            self.report("router probe", err)
        self.router_probe.errors.clear()
        return pack_values(layout.size, entries, self.world.device)

    def _symptom_entries(self, layout: Layout) -> list[tuple[int, Scalar]]:
        at, every = layout.symptoms_at, layout.every
        out: list[tuple[int, Scalar]] = []
        dropped = []
        buffers = (
            (self._loss, LOSS_SUM, LOSS_COUNT),
            (self._grad, GIVEN_SUM, GIVEN_COUNT),
            (self._squares, SQUARE_SUM, SQUARE_COUNT),
        )
        try:
            for buffer, value_field, count_field in buffers:
                for s, v in buffer:
                    slot = layout.slot(s)
                    if slot is None:
                        dropped.append(s)
                        continue
                    out.append((at + value_field * every + slot, _plain(v)))
                    out.append((at + count_field * every + slot, 1.0))
        finally:  # a value that cannot be read must not block every later read
            for buffer, _, _ in buffers:
                buffer.clear()
        if dropped:
            self.report(
                "symptoms",
                f"values of steps {sorted(set(dropped))[:5]} fall outside the read-out window "
                f"{layout.step - every + 1}-{layout.step} (steps must increase): dropped",
            )
        return out

    def _router_entries(self, layout: Layout) -> list[tuple[int, Scalar]]:
        self.router_probe.check_silent()
        out: list[tuple[int, Scalar]] = []
        at = layout.routers_at
        rows = self._router_rows(layout.step)  # reduced on the monitor thread, or None
        for j, _ in enumerate(self.router_sites):
            width = layout.router_width(j)
            row = self.router_probe.take(j) if rows is None else rows[j]  # (5 + E,), device
            if row is not None:
                out.append((at, row))
            stats = self._weight_stats(j, layout.step)
            if stats is None:
                out.append((at + width - 1, -1.0))
            else:
                stats_at = at + width - 1 - WEIGHT_STATS
                out += [(stats_at, stats[1]), (at + width - 1, float(stats[0]))]
            at += width
        return out

    def _weight_stats(self, j: int, step: int) -> tuple[int, torch.Tensor] | None:
        """Router ``j``'s weight statistics on its assigned rank: now, or for a sharded
        weight the ones captured in the forward after the previous read-out."""
        if router_rank(j, self.world.size) != self.world.rank:
            return None
        if not self._sharded_routers[j]:
            return step, self.router_probe.weight_stats(j)
        captured = self.router_probe.take_captured(j)
        self.router_probe.capture_weight_stats(j, step)
        return captured

    def _submit_job(self, job: QKJob) -> Any:
        orders = tuple(self.config.qk.orders)
        job_fn = self.costs.on_monitor_thread(lambda: compute_qk_samples(expand_job(job), orders))
        return self.submit(job_fn)

    def _qk_results(self, step: int) -> tuple[list[Sample], str | None]:
        """This rank's QK samples due at ``step`` and the first error (reported here)."""
        out: list[Sample] = []
        error = None
        keep = []
        for due, future in self._pending:
            if due != step:
                keep.append((due, future))
                continue
            try:
                out += future.result(timeout=self.config.scheduling.max_wait_s)
            except Exception as exc:
                text = f"{type(exc).__name__}: {exc}"
                self.report("qk monitor", text)
                error = error or text
        self._pending = keep
        return out, error


def _plain(value: Scalar) -> Scalar:
    """A DTensor scalar (a grad norm under FSDP2) as a plain tensor."""
    if DTensor is not None and isinstance(value, DTensor):
        return value.full_tensor()
    return value


def grad_square_share(model: torch.nn.Module, world: int) -> torch.Tensor | None:
    """This rank's share of the squared global grad norm, 0-dim on the device: each gradient
    element counted once over the ranks (a DDP replica's squares / world; a shard's squares /
    the ranks that hold the same shard). None when there are no gradients."""
    parts = []
    for p in model.parameters():
        g = p.grad
        if g is None:
            continue
        holders = world
        if DTensor is not None and isinstance(g, DTensor):
            mesh = g.device_mesh
            shards = math.prod(
                mesh.size(i) for i, pl in enumerate(g.placements) if isinstance(pl, Shard)
            )
            if any(not isinstance(pl, Shard) and not pl.is_replicate() for pl in g.placements):
                raise ValueError(f"a gradient with placements {g.placements} (partial sums)")
            holders = world // shards
            g = g.to_local()
        parts.append(torch.linalg.vector_norm(g.detach().float()).square() / holders)
    return torch.stack(parts).sum() if parts else None
