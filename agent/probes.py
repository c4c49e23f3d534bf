"""Probes: how the agent measures a live model without slowing it down (the router probe
is ``agent.router_probe``, re-exported here).

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
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from agent import samples as m
from agent.discovery import AttentionSite
from agent.discovery.controls import control_label
from agent.monitors import (
    qk_delta2_direction,
    qk_increment_spectrum,
    qk_monitor_spectra_batched,
    spectrum_stats,
    update_spectrum,
)
from agent.monitors.spectrum import default_rtol
from agent.router_probe import RouterProbe, router_samples
from agent.samples import Sample, labels_of

__all__ = [  # the router probe lives in agent.router_probe; re-exported for older imports
    "QKJob",
    "QKSnapshots",
    "RouterProbe",
    "SnapshotBuffers",
    "compute_qk_samples",
    "control_slice",
    "router_samples",
]


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

    def __init__(self, allocate_cpu: Callable[[torch.Size], torch.Tensor] | None = None) -> None:
        self._free: dict[tuple[str, torch.Size, torch.device], list[torch.Tensor]] = {}
        self._finished: deque[QKJob] = deque()  # appended by the monitor thread
        # a new fp32 CPU buffer of a shape (the monitor process's shared files); None: torch.empty
        self.allocate_cpu = allocate_cpu

    def copy(self, name: str, p: torch.Tensor, target: torch.device) -> torch.Tensor:
        """An fp32 copy of ``p`` on ``target`` in a reused buffer (asynchronous on a GPU)."""
        free = self._free.get((name, p.shape, target))
        buffer = free.pop() if free else self._new(p.shape, target, pinned=p.is_cuda)
        buffer.copy_(p, non_blocking=p.is_cuda and target.type == "cpu")
        return buffer

    def _new(self, shape: torch.Size, target: torch.device, *, pinned: bool) -> torch.Tensor:
        """A new buffer; on the host for a GPU weight (``qk.snapshot_device: cpu``) in pinned
        memory, without which the non-blocking copy would wait for the device after all."""
        if self.allocate_cpu is not None and target.type == "cpu":
            return self.allocate_cpu(shape)
        pin = pinned and target.type == "cpu"
        return torch.empty(shape, dtype=torch.float32, device=target, pin_memory=pin)

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
        self._start = 0  # the first layer of the next plan (rotating)
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
        """The layers of the next evaluation: ``layers_per_eval`` of them (it may change
        between evaluations: ``agent.monitor_budget``), rotating."""
        n = len(self.sites)
        count = max(1, min(self.layers_per_eval, n))
        return [self.sites[(self._start + i) % n] for i in range(count)]

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
            self._start = (self._start + len(measured)) % len(self.sites)
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


# Most heads per call of the batched QK spectra on a GPU: a layer's calls all see the same
# batch size (cuSOLVER sets itself up again when it changes; the last chunk is padded).
GPU_CHUNK_SIZE = 32


def qk_chunk_size(factors: torch.Tensor) -> int:
    """Heads per batched call for factors (n, d, d_h). On a GPU at most ``GPU_CHUNK_SIZE``
    and never more than the n heads of the call: a layer of 8 heads padded to 32 did four
    times the work (benchmarks/results/gpu.md, 11.3 s against 3.8 s per evaluation on an
    H200). On a CPU all n at once for small d (fewer, larger calls) and one at a time from
    d = 2048 on, where a batch of tall matrices runs out of cache
    (benchmarks/results/batched_speed.md: 12-17% slower batched at d = 4096, equal at 1024)."""
    n, d = factors.shape[0], factors.shape[-2]
    if factors.device.type != "cpu":
        return max(1, min(GPU_CHUNK_SIZE, n))
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
            wq0,
            wk0,
            wq1,
            wk1,
            chunk_size=qk_chunk_size(wq0),
            directions=True,
            delta1=1 in orders,  # Delta_1 only when asked for: (2, 3) by default
        )
        deltas = {1: spectra.delta1, 2: spectra.delta2, 3: spectra.delta3}
        dwq, dwk, wq_norm = spectra.dwq, spectra.dwk, spectra.wq_norm
        directions = spectra.direction
    else:  # tiny heads relative to the width: the separate monitors
        deltas = {o: qk_increment_spectrum(wq0, wk0, wq1, wk1, order=o) for o in orders}
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
    step = int(job.step)
    head_labels = [labels_of(layer=site.name, head=h) for h in heads]  # made once per head
    out: list[Sample] = []
    for metric, values in per_head.items():
        for labels, value in zip(head_labels, values, strict=True):
            if metric == m.QK_DELTA2_PERSISTENCE and math.isnan(value):
                continue  # the head's first evaluation: no earlier direction to compare with
            out.append(Sample(step, metric, float(value), labels))
    # dW_k and ||W_k|| once per KV head: the first selected query head of each group carries it.
    dwk_entropy = entropy[len(orders) + 1]
    wk_norm = torch.linalg.matrix_norm(wk1, ord=2).tolist()
    seen: set[int] = set()
    for i, h in enumerate(heads):
        g = site.kv_head(h)
        if g not in seen:
            seen.add(g)
            labels = labels_of(layer=site.name, kv_head=g)
            out.append(Sample(step, m.DWK_ENTROPY, float(dwk_entropy[i]), labels))
            out.append(Sample(step, m.WK_SPECTRAL_NORM, float(wk_norm[i]), labels))
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
    """Update entropy and relative size of each control matrix over the job's delta steps:
    one singular-value call per control, then one ``spectrum_stats`` call and one host
    transfer for all of them."""
    if not job.controls:
        return []
    spectra: list[torch.Tensor] = []  # (min(m, n),) per control, trimmed at its own cut-off
    sizes: list[torch.Tensor] = []  # () ||dW||_F / ||W||_F per control
    rtol = math.inf
    for name in job.controls:
        w0 = control_slice(job.previous[name], job.control_rows).float()  # (m, n)
        w1 = control_slice(job.current[name], job.control_rows).float()
        spectra.append(update_spectrum(w0, w1))
        rtol = min(rtol, default_rtol(tuple(w0.shape), w0.dtype))
        sizes.append(
            torch.linalg.matrix_norm(w1 - w0) / torch.linalg.matrix_norm(w0).clamp_min(1e-30)
        )
    # One stats call on the spectra padded with zeros to one width (zeros count as dropped
    # values). ``update_spectrum`` already set every value under its own matrix's cut-off
    # (eps * max(m, n) * s_max, the one ``spectrum_stats(shape=(m, n))`` applies) to zero, so the
    # smallest of the cut-offs drops nothing more: each control's statistics are its own.
    width = max(s.shape[-1] for s in spectra)
    stacked = torch.stack([torch.nn.functional.pad(s, (0, width - s.shape[-1])) for s in spectra])
    stats = spectrum_stats(stacked, rtol=rtol)  # fields (controls,)
    entropies, rel_norms = torch.stack([stats.entropy, torch.stack(sizes)]).tolist()
    step = int(job.step)
    out = []
    for label, entropy, size in zip(job.controls.values(), entropies, rel_norms, strict=True):
        labels = labels_of(layer=job.site.name, param=label)
        out.append(Sample(step, m.CONTROL_UPDATE_ENTROPY, entropy, labels))
        out.append(Sample(step, m.CONTROL_UPDATE_REL_NORM, size, labels))
    return out
