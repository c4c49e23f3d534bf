"""The one measurement pipeline: from a training loop's steps to named samples.

The agent measures through it, and so does the test bed's recorder (``agent.testbed``), so
the clean bands, tests and benchmarks check exactly what the agent's rules see.

Per step, on the training thread (cheap, no host-device sync):

* ``record(step, loss, grad_norm)`` buffers the loss and grad norm as device tensors (the
  grad norm is computed from ``model``'s gradients on symptom steps when not given);
* ``collect(step)`` returns the samples due at ``step``:
  - every ``symptoms.every`` steps the buffered values, read in one transfer (``loss``,
    ``loss_nonfinite``, ``grad_norm``);
  - every ``router.every`` steps the router hooks' device-side sums (``RouterProbe``): the
    hooks buffer each forward's logits; ``apply_lag`` steps before a read-out the buffers are
    handed to ``submit`` and reduced there, so the read-out at t covers the forwards up to
    t - ``apply_lag`` and the training thread pays only a product per forward;
  - every ``qk.delta`` steps fp32 snapshots of the sampled Q/K weights are taken and a job is
    handed to ``submit`` (the agent's monitor thread; inline in the test bed); a result
    measured at step t is returned at step t + ``scheduling.apply_lag`` (waiting for it if it
    is late), so every rank feeds the same samples to the rules at the same step.

The symptom and router read-outs of device tensors end in one host transfer each. On a GPU
the transfer is started at the read-out step and its samples are returned ``apply_lag`` steps
later (``agent.host_read``: the copy has arrived by then, nothing waits); on a CPU, or with
``apply_lag`` 0, at the read-out step itself.

Each part is guarded on its own: a part that fails is reported through ``report(what,
text)`` and skipped (its buffered values dropped), the other parts go on.
``restart()`` forgets what belongs to an abandoned path (after a rollback).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Protocol

import torch

from agent import samples as m
from agent.costs import MONITOR_THREAD, Costs
from agent.discovery import AttentionSite, RouterSite
from agent.discovery.controls import find_controls
from agent.grad_norm import ZEROED, OwnGradNorm
from agent.host_read import HostRead
from agent.monitor_budget import MonitorBudget
from agent.monitor_process import ProcessWorker, process_supported
from agent.probes import QKJob, QKSnapshots, compute_qk_samples
from agent.router_buffer import HandedBatch
from agent.router_probe import RouterProbe
from agent.samples import Sample
from agent.step_inputs import Scalar

if TYPE_CHECKING:
    from agent.config import AgentConfig

Submit = Callable[[Callable[[], list[Sample]]], Future]
Report = Callable[[str, str], None]


def run_inline(fn: Callable[[], list[Sample]]) -> Future:
    """A ``Submit`` that computes on the calling thread (the test bed's recorder)."""
    future: Future = Future()
    try:
        future.set_result(fn())
    except Exception as exc:
        future.set_exception(exc)
    return future


class Measurements:
    """See the module docstring. ``config`` is an ``AgentConfig`` (its qk, router, symptoms
    and scheduling sections)."""

    adaptive_budget = True  # ``qk.budget`` is supported (agent.monitor_budget)
    process_worker = True  # ``qk.worker`` may be a process (agent.monitor_process)

    def __init__(
        self,
        model: torch.nn.Module,
        config: AgentConfig,
        attention_sites: list[AttentionSite],
        router_sites: list[RouterSite],
        *,
        submit: Submit = run_inline,
        report: Report | None = None,
        costs: Costs | None = None,
    ) -> None:
        if config.qk.budget is not None and not self.adaptive_budget:
            raise ValueError(
                "qk.budget is supported in one process only: set qk.layers_per_eval / "
                "qk.heads_per_layer for a distributed run (benchmarks/results/scale.md)"
            )
        self.model = model
        self.costs = costs if costs is not None else Costs()
        self.config = config
        self.attention_sites = attention_sites
        self.router_sites = router_sites
        self.submit = submit
        self.report = report or (lambda what, text: None)
        self.router_probe = RouterProbe(router_sites, config.router.default_top_k, self.costs)
        self.router_probe.attach()
        qk = config.qk
        self.qk = self._qk_snapshots(
            attention_sites,
            delta=qk.delta,
            layers_per_eval=qk.layers_per_eval,
            heads_per_layer=qk.heads_per_layer,
            device=qk.snapshot_device,
            control_rows=qk.control_rows,
            controls={
                site.name: find_controls(model, site, router_sites, qk.controls)
                for site in attention_sites
            },
        )
        self.worker = self._start_worker(config.qk.worker)
        # its shared files, removed at close even when the worker exited and was dropped
        self._worker_files = None if self.worker is None else self.worker.files
        self.budget = (
            MonitorBudget(
                qk.budget,
                delta=qk.delta,
                layers=len(attention_sites),
                heads=max((s.num_heads for s in attention_sites), default=1),
            )
            if qk.budget is not None
            else None
        )
        self._loss: list[tuple[int, Scalar]] = []
        self._grad: list[tuple[int, Scalar]] = []
        self._own_grad_norm = OwnGradNorm(model)
        self._own_grad_steps: set[int] = set()  # buffered grad norms the agent measured
        # agent.step calls since the last symptom read-out whose optimizer step is known, and
        # those of them the optimizer skipped (agent.optimizer_steps)
        self._steps_known = self._steps_skipped = 0
        self._pending: list[tuple[int, Future]] = []  # (due step, future of samples)
        # (due step, what the samples are, their maker): read-outs whose host transfer from
        # a GPU is in flight (agent.host_read)
        self._reads: list[tuple[int, str, Callable[[], list[Sample]]]] = []
        # read-out step -> the routers' batches handed over apply_lag steps before, and the
        # future of their reduced rows (computed on the monitor thread)
        self._router_handed: dict[int, tuple[list[HandedBatch], Future]] = {}
        # Set by the distributed pipeline (agent.distributed.measurements); None in one process:
        self.now: float | None = None  # rank 0's clock at the latest read-out
        self.notes: Any = None  # the latest read-out's ranks involved (ReadOutNotes)

    def _qk_snapshots(self, sites: list[AttentionSite], **kwargs: Any) -> QKSnapshots:
        return QKSnapshots(sites, **kwargs)

    def _start_worker(self, mode: str) -> ProcessWorker | None:
        """The monitor process for the QK jobs (``qk.worker``), or None: the monitor thread."""
        if mode == "thread" or not self.attention_sites:
            return None
        usable = self.process_worker and process_supported() and not self.qk._cuda
        if mode == "process" and not usable:
            self.router_probe.detach()  # a failed construction leaves no hooks behind
            raise ValueError(
                "qk.worker: 'process' needs the attention weights on the CPU in a one-process "
                "run (on a GPU or across ranks the jobs run on the monitor thread: 'auto')"
            )
        if not usable:
            return None
        worker = ProcessWorker(self.qk.buffers)
        if not worker.process.alive:
            self.report("qk monitor", f"{worker.process.error}; measuring on the monitor thread")
            return None
        self.router_probe.allocate_cpu_with(worker.files.allocate)  # reduced there too
        return worker

    # -- the training thread -----------------------------------------------------------------
    def record(
        self,
        step: int,
        loss: Scalar | None,
        grad_norm: Scalar | None,
        *,
        skipped: bool | None = None,
    ) -> None:
        """Buffer one step's (checked) loss and grad norm; see ``agent.step_inputs``.
        ``skipped``: the optimizer did not step (``agent.optimizer_steps``; None: unknown):
        the step's gradient norm, inf or NaN after a GradScaler's overflow, is left out, and
        the step counts in ``optimizer_skipped_share``."""
        if loss is not None:
            self._loss.append((step, loss))
        if skipped is not None:
            self._steps_known += 1
            self._steps_skipped += skipped
            if skipped:
                return
        if grad_norm is not None:
            self._grad.append((step, grad_norm))
        elif self.config.symptoms.grad_norm and step % self.config.symptoms.every == 0:
            self._measure_grad_norm(step)

    def _measure_grad_norm(self, step: int) -> None:
        """The loop passed no grad norm: the agent's own (a device tensor, no sync)."""
        norm = self._guarded("grad norm", self._own_grad_norm.measure, None)
        if norm is not None:
            self._grad.append((step, norm))
            self._own_grad_steps.add(step)
        elif self._own_grad_norm.problem is not None:
            self.report("grad norm", self._own_grad_norm.problem)

    def collect(self, step: int) -> list[Sample]:
        """Every sample due at ``step`` (see the module docstring)."""
        new = self._reads_due(step)
        lag = self.config.scheduling.apply_lag
        if step % self.config.symptoms.every == 0:
            for read in self._guarded("symptoms", self._read_symptoms, [], clear=True):
                new += self._take_or_defer(step, "symptoms", read)
            if self._steps_known:
                share = self._steps_skipped / self._steps_known
                new.append(Sample.make(step, m.OPTIMIZER_SKIPPED_SHARE, share))
                self._steps_known = self._steps_skipped = 0
        self._hand_over_routers(step)
        if self.router_sites and step % self.config.router.every == 0:
            rows = self._router_rows(step)
            read = self._guarded(
                "router probe", lambda: self.router_probe.start_read(step, rows), None
            )
            if read is not None:
                new += self._take_or_defer(step, "router probe", read)
            for err in self.router_probe.errors:
                self.report("router probe", err)
            self.router_probe.errors.clear()
        if self.budget is not None:
            self._apply_budget(step)
        for job in self._guarded("qk snapshot", lambda: self.qk.on_step(step), []):
            self._pending.append((step + lag, self._submit_job(job)))
        new += self._collect_due(step)
        return self._check_own_grad_norm(new)

    def _check_own_grad_norm(self, samples: list[Sample]) -> list[Sample]:
        """Report (once) a grad norm of the agent's own that reads exactly 0: gradients zeroed
        in place before ``agent.step`` (``agent.grad_norm.ZEROED``). ``samples`` unchanged."""
        if not self._own_grad_steps:
            return samples
        for sample in samples:
            if sample.metric == m.GRAD_NORM and sample.step in self._own_grad_steps:
                self._own_grad_steps.discard(sample.step)
                if sample.value == 0.0:
                    self.report("grad norm", ZEROED)
        return samples

    def _take_or_defer(self, step: int, what: str, read: PendingRead) -> list[Sample]:
        """A read-out's samples now, or ``apply_lag`` steps later when its host transfer is in
        flight from a GPU."""
        lag = self.config.scheduling.apply_lag
        if read.in_flight and lag > 0:
            self._reads.append((step + lag, what, read.samples))
            return []
        return self._guarded(what, read.samples, [])

    def _reads_due(self, step: int) -> list[Sample]:
        out: list[Sample] = []
        keep = []
        for due, what, make in self._reads:
            if due > step:
                keep.append((due, what, make))
            else:
                out += self._guarded(what, make, [])
        self._reads = keep
        return out

    def _apply_budget(self, step: int) -> None:
        """Time the step; before a snapshot step, size the next evaluation to the budget."""
        assert self.budget is not None
        self.budget.on_step(time.perf_counter())
        if step % self.qk.delta == 0:
            layers, heads = self.budget.plan()
            if layers is not None:
                self.qk.layers_per_eval, self.qk.heads_per_layer = layers, heads

    def restart(self) -> None:
        """The run continues from an earlier state: drop what was measured on the abandoned
        path (snapshots, results not yet applied, buffered values)."""
        if self.budget is not None:
            self.budget.restart()
        if self.worker is not None:
            self.worker.reset()
        self.qk.reset()
        self.router_probe.reset()
        for future in [f for _, f in self._pending + list(self._router_handed.values())]:
            future.cancel()
        self._pending.clear()
        self._reads.clear()
        self._router_handed.clear()
        self._loss.clear()
        self._grad.clear()
        self._own_grad_steps.clear()
        self._steps_known = self._steps_skipped = 0

    def close(self) -> None:
        self.router_probe.detach()
        if self.worker is not None:
            self.worker.close()
        if self._worker_files is not None:  # a worker that exited: its files all the same
            self._worker_files.close()
        for future in [f for _, f in self._pending + list(self._router_handed.values())]:
            future.cancel()
        self._pending.clear()
        self._reads.clear()
        self._router_handed.clear()

    # -- parts ---------------------------------------------------------------------------------
    def _read_symptoms(self) -> list[SymptomRead]:
        """The buffered loss and grad norm, one host transfer each started now."""
        out = []
        for buffer, metric in ((self._loss, m.LOSS), (self._grad, m.GRAD_NORM)):
            if buffer:
                out.append(SymptomRead(metric, buffer))
                buffer.clear()
        return out

    def _hand_over_routers(self, step: int) -> None:
        """``apply_lag`` steps before a router read-out, hand the routers' buffered forwards to
        the monitor process (when the QK jobs run there and it is ready) or the monitor
        thread: the read-out at t then covers the forwards up to t - apply_lag, reduced off
        the training thread. With ``apply_lag`` 0 (or not below ``router.every``)
        the read-out reduces everything up to t itself."""
        every = self.config.router.every
        lag = self.config.scheduling.apply_lag
        if not self.router_sites or not 0 < lag < every or (step + lag) % every:
            return
        batches = self._guarded("router probe", self.router_probe.hand_over, None)
        if batches is None:
            return
        future = None
        worker = self._ready_worker()
        if worker is not None:
            future = worker.reduce(batches, lambda seconds: self.costs.add(MONITOR_THREAD, seconds))
            if future.done() and future.exception() is not None:  # not on shared files
                future = None
        if future is None:
            reduce = self.costs.on_monitor_thread(lambda: [b.reduce() for b in batches])
            future = self.submit(reduce)
        self._router_handed[step + lag] = (batches, future)

    def _router_rows(self, step: int) -> list[torch.Tensor | None] | None:
        """The reduced rows handed over for read-out ``step`` (None: nothing was handed over;
        the read-out reduces what is buffered); a reduction that failed gives no rows."""
        for stale in [s for s in self._router_handed if s < step]:  # a read-out was skipped
            self._router_handed.pop(stale)[1].cancel()
        handed = self._router_handed.pop(step, None)
        if handed is None:
            return None
        batches, future = handed
        try:
            rows = self.costs.call(
                "monitor results", lambda: future.result(timeout=self.config.scheduling.max_wait_s)
            )
        except Exception as exc:
            self.report("router probe", f"{type(exc).__name__}: {exc}")
            return [None] * len(self.router_sites)
        self.router_probe.recycle(batches)
        return rows

    def _submit_job(self, job: QKJob) -> Future:
        orders = tuple(self.config.qk.orders)
        worker = self._ready_worker()
        if worker is not None:
            return worker.submit(job, orders, lambda seconds: self._done(job, seconds))
        return self.submit(self.costs.on_monitor_thread(lambda: self._compute(job, orders)))

    def _ready_worker(self) -> ProcessWorker | None:
        """The monitor process when it takes jobs now (None: the monitor thread); one that
        exited is reported once and dropped."""
        if self.worker is not None and not self.worker.process.alive:
            self.report(
                "qk monitor", f"{self.worker.process.error}; measuring on the monitor thread"
            )
            self.worker = None
        return self.worker if self.worker is not None and self.worker.ready else None

    def _done(self, job: QKJob, seconds: float) -> None:
        """The monitor process computed ``job`` in ``seconds`` of its CPU time (its reader
        thread): the buffers go back to the pool, the time to the costs and the budget."""
        self.qk.buffers.finished(job)
        self.costs.add(MONITOR_THREAD, seconds)
        if self.budget is not None:
            self.budget.on_job(seconds, len(job.heads))

    def _compute(self, job: QKJob, orders: tuple[int, ...]) -> list[Sample]:
        """The job's samples (monitor thread); its snapshot buffers are reused afterwards."""
        start = time.thread_time()
        samples = compute_qk_samples(job, orders)
        self.qk.buffers.finished(job)
        if self.budget is not None:
            self.budget.on_job(time.thread_time() - start, len(job.heads))
        return samples

    def _collect_due(self, step: int) -> list[Sample]:
        out: list[Sample] = []
        keep: list[tuple[int, Future]] = []
        for due, future in self._pending:
            if due > step:
                keep.append((due, future))
                continue
            try:
                out += self.costs.call(
                    "monitor results",
                    lambda f=future: f.result(timeout=self.config.scheduling.max_wait_s),
                )
            except Exception as exc:
                self.report("qk monitor", f"{type(exc).__name__}: {exc}")
        self._pending = keep
        return out

    def _guarded(self, what: str, fn: Callable[[], Any], default: Any, *, clear: bool = False):
        try:
            return self.costs.call(_PART.get(what, what), fn)
        except Exception as exc:
            self.report(what, f"{type(exc).__name__}: {exc}")
            if clear:  # a value that cannot be read must not block every later read
                self._loss.clear()
                self._grad.clear()
            return default


# The ``Costs`` part each guarded measurement adds its time to.
_PART = {"symptoms": "read-outs", "router probe": "read-outs", "qk snapshot": "snapshots"}


class PendingRead(Protocol):
    """A read-out whose host transfer was started: its samples, now or once it arrived."""

    @property
    def in_flight(self) -> bool: ...

    def samples(self) -> list[Sample]: ...


class SymptomRead:
    """The buffered values of one symptom metric: (step, host float or 0-dim tensor) pairs,
    whose tensors travel in one ``HostRead``."""

    def __init__(self, metric: str, buffered: list[tuple[int, Scalar]]) -> None:
        self.metric = metric
        self.steps = [s for s, _ in buffered]
        self.values = [v for _, v in buffered]
        tensors = [v for v in self.values if isinstance(v, torch.Tensor)]
        stacked = torch.stack([t.float().reshape(()) for t in tensors]) if tensors else None
        self.read = None if stacked is None else HostRead(stacked)

    @property
    def in_flight(self) -> bool:
        return self.read is not None and self.read.in_flight

    def samples(self) -> list[Sample]:
        host = iter(self.read.tolist() if self.read is not None else [])
        out = []
        for s, v in zip(self.steps, self.values, strict=True):
            value = next(host) if isinstance(v, torch.Tensor) else float(v)
            out.append(Sample.make(s, self.metric, value))
            if self.metric == m.LOSS:
                nonfinite = 0.0 if math.isfinite(value) else 1.0
                out.append(Sample.make(s, m.LOSS_NONFINITE, nonfinite))
        return out
