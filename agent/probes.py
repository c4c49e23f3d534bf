"""Probes: how the agent measures a live model without slowing it down.

``RouterProbe``: a forward pre-hook per router computes the routing logits from the router's
own input (z = x W^T + b) into a device buffer (``agent.router_buffer``) that is reduced *on
the device*, a batch of forwards at a time, to a few running sums (entropy, p10, margin, expert
load); nothing is copied to the host. ``read()`` turns the sums into samples with one host
transfer for all routers, every ``router_every`` steps, and names (once) every router that has
produced no data.

``QKSnapshots``: every ``delta`` steps, fp32 copies of the Q/K projection weights (and of the
layer's control matrices, ``agent.discovery.controls``) of the layers sampled for the next
evaluation; the increment between two consecutive snapshots of a layer is measured off the
training thread by ``compute_qk_samples``: the QK spectra per head, the persistence of Delta_2's
top direction since the layer's previous evaluation, ||W_k|| per KV head, and the update
entropy and relative size of each control matrix.

Layer and head sampling (for very deep or wide models): each evaluation covers
``layers_per_eval`` layers (a rotating window over all attention layers) and, in each,
``heads_per_layer`` query heads (a rotating window over that layer's heads). A layer is thus
visited every ceil(L / layers_per_eval) evaluations and each head every
ceil(H / heads_per_layer) visits. ``None`` means all. Rules that reduce over heads (``mean``)
see the mean of the heads sampled in that evaluation.
"""

from __future__ import annotations

import math
import time
import warnings
from collections import deque
from dataclasses import dataclass, field

import torch

from agent import samples as m
from agent.costs import Costs
from agent.discovery import AttentionSite, RouterSite
from agent.discovery.controls import control_label
from agent.monitors import (
    qk_delta2_direction,
    qk_increment_spectrum,
    qk_monitor_spectra_batched,
    router_conditioning_ratio,
    router_similarity,
    spectrum_stats,
    update_spectrum,
)
from agent.monitors.router import ROUTING_SUM_FIELDS
from agent.router_buffer import HandedBatch, RouterLogitBuffer
from agent.router_output import router_input
from agent.samples import Sample

# Running sums kept per router (``ROUTING_SUM_FIELDS``): entropy mean, normalized entropy, p10,
# margin, number of forwards counted.
_ROUTER_SUMS = len(ROUTING_SUM_FIELDS)


class RouterProbe:
    """Device-side routing statistics for every discovered router.

    The logits are computed in the hooks from the router's input and weight, z = x W^T + b,
    never guessed from what the router returns (Llama 4 returns sigmoid scores first). A
    forward pre-hook on the router module does it; when the weight is applied by the router's
    parent (``RouterSite.owner``, e.g. ``F.linear(x, self.classifier.weight)``), the parent is
    hooked too and uses its own input whenever the router module was not called during its
    forward. Only training-mode forwards count.
    """

    def __init__(
        self, sites: list[RouterSite], default_top_k: int = 1, costs: Costs | None = None
    ) -> None:
        self.sites = sites
        self.hook_seconds = 0.0  # wall seconds in the hooks (training thread only)
        if costs is not None:
            costs.source("router hooks", lambda: self.hook_seconds)
        self.default_top_k = default_top_k
        for site in sites:
            top_k = site.top_k or default_top_k
            if not 1 <= top_k <= site.num_experts:
                raise ValueError(
                    f"router {site.name}: top_k must be in [1, {site.num_experts}], got {top_k}"
                )
        self._buffers = [
            RouterLogitBuffer(site.num_experts, site.top_k or default_top_k) for site in sites
        ]
        self._seen = [False] * len(sites)  # the router produced data at least once
        self._called = [False] * len(sites)  # router module called in its owner's forward
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._checked = False  # the first read-out named the routers without data
        self._capture: dict[int, int] = {}  # router index -> step of the stats to capture
        self._captured: dict[int, tuple[int, torch.Tensor]] = {}  # -> (step, (2,) stats)
        self.errors: list[str] = []

    def attach(self) -> None:
        if self._handles:
            return
        for i, site in enumerate(self.sites):
            hook = self._router_hook(i, site)
            self._handles.append(site.module.register_forward_pre_hook(hook, with_kwargs=True))
            if site.owner is not None:
                self._handles += [
                    site.owner.register_forward_pre_hook(self._owner_enter(i)),
                    site.owner.register_forward_hook(self._owner_exit(i, site), with_kwargs=True),
                ]

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _router_hook(self, index: int, site: RouterSite):
        def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            self._called[index] = True
            if module.training:  # evaluation passes would mix another distribution in
                self._record(index, site, args, kwargs)

        return hook

    def _owner_enter(self, index: int):
        def hook(module: torch.nn.Module, args: tuple) -> None:
            self._called[index] = False

        return hook

    def _owner_exit(self, index: int, site: RouterSite):
        def hook(module: torch.nn.Module, args: tuple, kwargs: dict, output: object) -> None:
            if not self._called[index] and module.training:
                self._record(index, site, args, kwargs)

        return hook

    def _record(self, index: int, site: RouterSite, args: tuple, kwargs: dict) -> None:
        """Buffer one forward's z = x W^T + b (on the device; reduced in batches). Runs in
        every training forward: detached tensors (no autograd context needed), few calls."""
        start = time.perf_counter()
        try:
            x = router_input(args, kwargs, site.d_model)  # (..., d)
            if x is None or x.numel() == 0:
                return
            self._buffers[index].add(
                x.detach().reshape(-1, x.shape[-1]), site.weight().detach(), _detached(site.bias())
            )
            self._seen[index] = True
            if self._capture and index in self._capture:  # the weight is whole in the forward
                self._captured[index] = (self._capture.pop(index), self.weight_stats(index))
        except Exception as exc:  # never break the user's forward
            if len(self.errors) < 10:
                self.errors.append(f"router probe {site.name}: {exc!r}")
        finally:
            self.hook_seconds += time.perf_counter() - start

    def _name_silent_routers(self) -> None:
        """Once, at the first read-out: warn about every router that produced no data."""
        self._checked = True
        pairs = zip(self.sites, self._seen, strict=True)
        silent = [site.name for site, seen in pairs if not seen]
        if not silent:
            return
        message = (
            f"mechwatch router probe: no routing data from {', '.join(silent)} by the first "
            "read-out: the router module was never called in a training forward with an input "
            "of its width (a router applied functionally by a module other than its parent, or "
            "never run); its router metrics stay empty"
        )
        warnings.warn(message, stacklevel=3)
        self.errors.append(message)

    def take(self, index: int) -> torch.Tensor | None:
        """Router ``index``'s sums since the last read-out, (5 + E,) on the device: the
        ``_ROUTER_SUMS`` running sums, then the summed load fractions (None: no data yet).
        Resets them."""
        try:
            return self._buffers[index].take()
        except Exception as exc:  # a batch that cannot be reduced is dropped, never raised
            self._buffers[index].reset()
            if len(self.errors) < 10:
                self.errors.append(f"router probe {self.sites[index].name}: {exc!r}")
            return None

    def reset(self) -> None:
        """Drop what the hooks buffered (the run continues from another state)."""
        for buffer in self._buffers:
            buffer.reset()

    def weight_stats(self, index: int) -> torch.Tensor:
        """(2,) on the device: the conditioning ratio and the expert similarity of router
        ``index``'s weight as it is now (the whole [E, d] weight)."""
        weight = self.sites[index].weight().detach()
        eps = router_conditioning_ratio(weight).reshape(1)
        sim = router_similarity(weight).reshape(1)
        return torch.cat([eps, sim])

    def capture_weight_stats(self, index: int, step: int) -> None:
        """Compute ``weight_stats(index)`` in the next training forward, where a sharded
        weight (FSDP2) is whole, and keep it as the stats of ``step`` (``take_captured``)."""
        self._capture[index] = step

    def take_captured(self, index: int) -> tuple[int, torch.Tensor] | None:
        """(step, (2,) stats) captured since the last call, or None."""
        return self._captured.pop(index, None)

    def check_silent(self) -> None:
        """At the first read-out: name (once) every router that has produced no data."""
        if not self._checked:
            self._name_silent_routers()

    def hand_over(self) -> list[HandedBatch]:
        """Every router's forwards since its last take or hand-over, to reduce on the monitor
        thread (``HandedBatch.reduce``); the hooks go on in each router's spare buffer."""
        return [buffer.hand_over() for buffer in self._buffers]

    def recycle(self, batches: list[HandedBatch]) -> None:
        """The handed batches were reduced: their buffers may take forwards again."""
        for buffer, batch in zip(self._buffers, batches, strict=True):
            buffer.recycle(batch)

    def read(self, step: int, rows: list[torch.Tensor | None] | None = None) -> list[Sample]:
        """Samples of read-out ``step`` (one host transfer): from ``rows`` (per router, the
        reduced sums of a hand-over, ``HandedBatch.reduce``) or, when None, from everything
        buffered since the last read (``take``)."""
        self.check_silent()
        if rows is None:
            rows = [self.take(i) for i in range(len(self.sites))]
        host_rows, names = [], []
        for i, (site, row) in enumerate(zip(self.sites, rows, strict=True)):
            if row is None:
                continue
            stats = self.weight_stats(i)
            host_rows.append(torch.cat([row.to(stats.device, stats.dtype), stats]))
            names.append(site)
        if not host_rows:
            return []
        host = [r.cpu().tolist() for r in host_rows]  # the one synchronization of this read
        out: list[Sample] = []
        for site, values in zip(names, host, strict=True):
            out += router_samples(step, site, values[:-2], (step, values[-2], values[-1]))
        return out


def _detached(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach()


def router_samples(
    step: int,
    site: RouterSite,
    sums: list[float],
    stats: tuple[int, float, float] | None,
) -> list[Sample]:
    """One router's samples at read-out ``step`` from its sums (``RouterProbe.take``: the
    running sums, then the summed load) and its weight stats ``(step, eps, similarity)``
    (None: none this time); nothing when no forward was counted."""
    n = sums[_ROUTER_SUMS - 1]
    if n <= 0:
        return []
    e = site.num_experts
    load = [x / n for x in sums[_ROUTER_SUMS : _ROUTER_SUMS + e]]
    load_entropy = -sum(x * math.log(x) for x in load if x > 0)
    lab = {"router": site.name}
    out = [
        Sample.make(step, m.ROUTER_ENTROPY, sums[0] / n, **lab),
        Sample.make(step, m.ROUTER_ENTROPY_NORM, sums[1] / n, **lab),
        Sample.make(step, m.ROUTER_ENTROPY_P10, sums[2] / n, **lab),
        Sample.make(step, m.ROUTER_MARGIN, sums[3] / n, **lab),
        Sample.make(step, m.ROUTER_LOAD_MAX, max(load), **lab),
        Sample.make(step, m.ROUTER_LOAD_ENTROPY, load_entropy, **lab),
        Sample.make(step, m.ROUTER_DEAD_EXPERTS, sum(1 for x in load if x == 0), **lab),
    ]
    if stats is not None:
        at, eps, sim = stats
        out += [
            Sample.make(at, m.ROUTER_EPS, eps, **lab),
            Sample.make(at, m.ROUTER_SIMILARITY, sim, **lab),
        ]
    return out


@dataclass
class QKJob:
    """Two snapshots of one layer, delta steps apart, and the heads to measure."""

    step: int  # step of the newer snapshot
    site: AttentionSite
    previous: dict[str, torch.Tensor]  # fp32 snapshot at step - delta
    current: dict[str, torch.Tensor]  # fp32 snapshot at step
    heads: list[int]  # query heads to measure
    controls: dict[str, str] = field(default_factory=dict)  # parameter name -> "param" label
    # (layer, head) -> Delta_2's top direction (d,) at the head's previous evaluation; updated
    # by compute_qk_samples (jobs of one layer run in order on the one monitor thread)
    directions: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict, repr=False)
    ready: torch.cuda.Event | None = field(default=None, repr=False)  # copies done (CUDA)
    control_rows: int | None = None  # controls larger than this are measured on these rows


def control_slice(w: torch.Tensor, rows: int | None) -> torch.Tensor:
    """The part of a control matrix [out, in] the agent measures: its first ``rows`` rows
    when both dimensions exceed ``rows`` (``qk.control_rows``), else all of it (a view)."""
    if rows is None or min(w.shape[-2:]) <= rows:
        return w
    return w[..., :rows, :]


class SnapshotBuffers:
    """Preallocated fp32 snapshot tensors, reused: a snapshot is one copy kernel into a free
    buffer (the cast included), no allocation once the run has gone round once.

    A buffer is free again when the job that read it has finished (``finished``, called on
    the monitor thread) and it is not the previous snapshot of a layer's next evaluation;
    the training thread takes the finished jobs back at its next snapshot step (``reclaim``).
    """

    def __init__(self) -> None:
        self._free: dict[tuple[str, torch.Size, torch.device], list[torch.Tensor]] = {}
        self._finished: deque[QKJob] = deque()  # appended by the monitor thread

    def copy(self, name: str, p: torch.Tensor, target: torch.device) -> torch.Tensor:
        """An fp32 copy of ``p`` on ``target`` in a reused buffer (asynchronous on a GPU)."""
        free = self._free.get((name, p.shape, target))
        buffer = free.pop() if free else torch.empty(p.shape, dtype=torch.float32, device=target)
        buffer.copy_(p, non_blocking=p.is_cuda and target.type == "cpu")
        return buffer

    def finished(self, job: QKJob) -> None:
        """``job`` was computed (monitor thread): its buffers may be reused."""
        self._finished.append(job)

    def reclaim(self, keep: list[dict[str, torch.Tensor]]) -> None:
        """Free the buffers of the finished jobs, except those in the snapshots ``keep``."""
        kept = {id(t) for snapshot in keep for t in snapshot.values()}
        while self._finished:
            job = self._finished.popleft()
            for snapshot in (job.previous, job.current):
                for name, t in snapshot.items():
                    if isinstance(t, torch.Tensor) and id(t) not in kept:
                        self._free.setdefault((name, t.shape, t.device), []).append(t)
                        kept.add(id(t))  # a buffer is freed once

    def clear(self) -> None:
        self._finished.clear()


def _snapshot(
    site: AttentionSite,
    device: str | None,
    controls: dict[str, torch.nn.Parameter],
    control_rows: int | None = None,
    buffers: SnapshotBuffers | None = None,
) -> dict[str, torch.Tensor]:
    """fp32 copies of the layer's Q/K parameters and of the measured part of its control
    matrices (``control_slice``): the only work on the training thread."""
    buffers = buffers or SnapshotBuffers()
    live = {**site.parameters_to_snapshot()}
    live.update({name: control_slice(p.detach(), control_rows) for name, p in controls.items()})
    out = {}
    for name, p in live.items():
        target = p.device if device is None else torch.device(device)
        out[name] = buffers.copy(name, p.detach(), target)
    return out


class QKSnapshots:
    """Schedules snapshots of sampled layers and hands out jobs for the monitor thread."""

    def __init__(
        self,
        sites: list[AttentionSite],
        *,
        delta: int,
        layers_per_eval: int | None = None,
        heads_per_layer: int | None = None,
        device: str | None = None,
        controls: dict[str, dict[str, torch.nn.Parameter]] | None = None,
        control_rows: int | None = None,
    ) -> None:
        if delta < 1:
            raise ValueError(f"delta must be >= 1 step, got {delta}")
        self.sites = sites
        self.controls = controls or {}  # site name -> {parameter name: parameter}
        self.control_rows = control_rows  # see ``control_slice``
        self.buffers = SnapshotBuffers()
        self.directions: dict[tuple[str, int], torch.Tensor] = {}
        self.delta = delta
        self.layers_per_eval = min(layers_per_eval or len(sites), len(sites))
        self.heads_per_layer = heads_per_layer
        self.device = device
        self._evaluation = 0
        self.evaluated: int | None = None  # the step of the latest evaluation (jobs handed out)
        self._head_offset = {site.name: 0 for site in sites}
        self._previous: dict[str, dict[str, torch.Tensor]] = {}
        self._previous_step: int | None = None
        self._planned: list[AttentionSite] = []
        self._cuda = any(
            p.is_cuda for site in sites for p in site.parameters_to_snapshot().values()
        )

    def reset(self) -> None:
        """Forget the snapshots (after a rollback the weights jumped: no increment across it)."""
        self._previous.clear()
        self._previous_step = None
        self._planned = []
        self.directions.clear()
        self.buffers.clear()

    def _snapshot(self, site: AttentionSite) -> dict[str, torch.Tensor]:
        controls = self.controls.get(site.name, {})
        return _snapshot(site, self.device, controls, self.control_rows, self.buffers)

    def _plan(self) -> list[AttentionSite]:
        n = len(self.sites)
        start = (self._evaluation * self.layers_per_eval) % n if n else 0
        return [self.sites[(start + i) % n] for i in range(self.layers_per_eval)]

    def _heads(self, site: AttentionSite) -> list[int]:
        h = site.num_heads
        count = min(self.heads_per_layer or h, h)
        offset = self._head_offset[site.name]
        self._head_offset[site.name] = (offset + count) % h
        return [(offset + i) % h for i in range(count)]

    def on_step(self, step: int) -> list[QKJob]:
        """Call every step; takes snapshots on multiples of ``delta``; returns due jobs."""
        if not self.sites or step % self.delta != 0:
            return []
        self.buffers.reclaim(list(self._previous.values()))
        evaluating = self._previous_step is not None and step - self._previous_step == self.delta
        measured = self._planned if evaluating else []
        heads = {site.name: self._heads(site) for site in measured}
        if evaluating:
            self._evaluation += 1
            self.evaluated = step
        # Plan the next evaluation: its "previous" snapshots are taken now (a layer measured
        # now and planned again reuses its current snapshot).
        # The plan moves on before the snapshots are taken: one that fails leaves no previous
        # snapshot (that layer's next increment is skipped), never a plan out of step.
        planned, previous = self._plan(), self._previous
        self._planned, self._previous, self._previous_step = planned, {}, step
        names = {site.name for site in measured}
        taken = self._take(measured + [site for site in planned if site.name not in names])
        self._previous = {site.name: taken[site.name] for site in planned}
        jobs = [
            job
            for site in measured
            if site.name in previous
            and (
                job := self._job(
                    step, site, previous[site.name], taken[site.name], heads[site.name]
                )
            )
            is not None
        ]
        if jobs and self._cuda:  # the copies are asynchronous: the monitor thread waits on this
            event = torch.cuda.Event()
            event.record()
            for job in jobs:
                job.ready = event
        return jobs

    def _take(self, sites: list[AttentionSite]) -> dict[str, dict[str, torch.Tensor]]:
        """Snapshots of ``sites`` (by name), all taken at this step."""
        return {site.name: self._snapshot(site) for site in sites}

    def _job(
        self,
        step: int,
        site: AttentionSite,
        previous: dict[str, torch.Tensor],
        current: dict[str, torch.Tensor],
        heads: list[int],
    ) -> QKJob | None:
        """The job measuring ``site``'s increment from ``previous`` to ``current``."""
        labels = {name: control_label(site, name) for name in self.controls.get(site.name, {})}
        return QKJob(
            step,
            site,
            previous,
            current,
            heads,
            labels,
            self.directions,
            control_rows=self.control_rows,
        )


# Heads per call of the batched QK spectra on a GPU: every call sees the same batch size
# (cuSOLVER sets itself up again when it changes; the last chunk is padded).
GPU_CHUNK_SIZE = 32


def qk_chunk_size(factors: torch.Tensor) -> int:
    """Heads per batched call for factors (n, d, d_h): ``GPU_CHUNK_SIZE`` on a GPU; on a CPU
    all n at once for small d (fewer, larger calls) and one at a time from d = 2048 on, where
    a batch of tall matrices runs out of cache (benchmarks/results/batched_speed.md: 12-17%
    slower batched at d = 4096, equal at d = 1024)."""
    if factors.device.type != "cpu":
        return GPU_CHUNK_SIZE
    n, d = factors.shape[0], factors.shape[-2]
    return 1 if d >= 2048 else max(1, n)


@torch.no_grad()
def compute_qk_samples(job: QKJob, orders: tuple[int, ...] = (2, 3)) -> list[Sample]:
    """All QK monitors of one job (runs on the monitor thread, never on live weights)."""
    if job.ready is not None:
        job.ready.synchronize()
    site, heads = job.site, job.heads
    if not heads:  # a rank that measures only this layer's control matrices
        return _control_samples(job)
    d, dh = site.d_model, site.head_dim
    wq0, wk0 = site.factors(job.previous, heads)  # (n, d, d_h) each; wk paired with each head
    wq1, wk1 = site.factors(job.current, heads)
    if d >= 2 * dh:  # one QR pair gives everything, Delta_2's top direction included
        spectra = qk_monitor_spectra_batched(
            wq0, wk0, wq1, wk1, chunk_size=qk_chunk_size(wq0), directions=True
        )
        deltas = {1: spectra.delta1, 2: spectra.delta2, 3: spectra.delta3}
        dwq, dwk, wq_norm = spectra.dwq, spectra.dwk, spectra.wq_norm
        directions = spectra.direction
    else:  # tiny heads relative to the width: the separate monitors
        deltas = {o: qk_increment_spectrum(wq0, wk0, wq1, wk1, order=o) for o in (1, 2, 3)}
        dwq, dwk = update_spectrum(wq0, wq1), update_spectrum(wk0, wk1)
        wq_norm = torch.linalg.matrix_norm(wq1, ord=2)
        directions = qk_delta2_direction(wq0, wk0, wq1, wk1)
    names = {1: m.QK_DELTA1_ENTROPY, 2: m.QK_DELTA2_ENTROPY, 3: m.QK_DELTA3_ENTROPY}
    # One spectrum_stats call for every spectrum of the job: each block (n, k) is padded with
    # zeros to one width (zeros are dropped like any value below the cut-off, and every
    # spectrum's cut-off is eps * d * s_max: max(d, d) = max(d, d_h) = d).
    blocks = [deltas[order] for order in orders] + [dwq, dwk]  # (n, k_i) each
    width = max(b.shape[-1] for b in blocks)
    stacked = torch.cat([torch.nn.functional.pad(b, (0, width - b.shape[-1])) for b in blocks])
    stats = spectrum_stats(stacked, shape=(d, d))  # fields (len(blocks) n,)
    n = len(heads)
    host = torch.stack([stats.entropy, stats.stable_rank, stats.frobenius]).tolist()
    entropy, stable_rank, frobenius = (
        [v[i * n : (i + 1) * n] for i in range(len(blocks))] for v in host
    )
    per_head: dict[str, list[float]] = {}
    for i, order in enumerate(orders):
        per_head[names[order]] = entropy[i]
        if order == 2:
            per_head[m.QK_DELTA2_STABLE_RANK] = stable_rank[i]
            per_head[m.QK_DELTA2_FROBENIUS] = frobenius[i]
    per_head[m.DWQ_ENTROPY] = entropy[len(orders)]
    per_head[m.WQ_SPECTRAL_NORM] = wq_norm.tolist()
    per_head[m.QK_DELTA2_PERSISTENCE] = _persistence(job, directions)
    out: list[Sample] = []
    for metric, values in per_head.items():
        for h, value in zip(heads, values, strict=True):
            if metric == m.QK_DELTA2_PERSISTENCE and math.isnan(value):
                continue  # the head's first evaluation: no earlier direction to compare with
            out.append(Sample.make(job.step, metric, value, layer=site.name, head=h))
    # dW_k and ||W_k|| once per KV head: the first selected query head of each group carries it.
    dwk_entropy = entropy[len(orders) + 1]
    wk_norm = torch.linalg.matrix_norm(wk1, ord=2).tolist()
    seen: set[int] = set()
    for i, h in enumerate(heads):
        g = site.kv_head(h)
        if g not in seen:
            seen.add(g)
            labels = {"layer": site.name, "kv_head": g}
            out.append(Sample.make(job.step, m.DWK_ENTROPY, dwk_entropy[i], **labels))
            out.append(Sample.make(job.step, m.WK_SPECTRAL_NORM, wk_norm[i], **labels))
    return out + _control_samples(job)


def _persistence(job: QKJob, now: torch.Tensor) -> list[float]:
    """|cos| between each head's Delta_2 top direction ``now`` (n, d; unit or zero vectors)
    and the one at its previous evaluation (NaN at a head's first evaluation)."""
    keys = [(job.site.name, h) for h in job.heads]
    before = [job.directions.get(key) for key in keys]
    seen = [i for i, b in enumerate(before) if b is not None]
    out = [math.nan] * len(keys)
    if seen:
        cos = (now[seen] * torch.stack([before[i] for i in seen])).sum(dim=-1).abs().tolist()
        for i, value in zip(seen, cos, strict=True):
            out[i] = value
    for i, key in enumerate(keys):
        job.directions[key] = now[i]
    return out


def _control_samples(job: QKJob) -> list[Sample]:
    """Update entropy and relative size of each control matrix over the job's delta steps."""
    out = []
    for name, label in job.controls.items():
        w0 = control_slice(job.previous[name], job.control_rows).float()  # (m, n)
        w1 = control_slice(job.current[name], job.control_rows).float()
        stats = spectrum_stats(update_spectrum(w0, w1), shape=tuple(w0.shape))
        size = torch.linalg.matrix_norm(w1 - w0) / torch.linalg.matrix_norm(w0).clamp_min(1e-30)
        labels = {"layer": job.site.name, "param": label}
        out.append(Sample.make(job.step, m.CONTROL_UPDATE_ENTROPY, float(stats.entropy), **labels))
        out.append(Sample.make(job.step, m.CONTROL_UPDATE_REL_NORM, float(size), **labels))
    return out
