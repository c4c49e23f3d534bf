"""The one measurement pipeline: from a training loop's steps to named samples.

The agent measures through it, and so does the test bed's recorder (``agent.testbed``), so
the clean bands, tests and benchmarks check exactly what the agent's rules see.

Per step, on the training thread (cheap, no host-device sync):

* ``record(step, loss, grad_norm)`` buffers the loss and grad norm as device tensors (the
  grad norm is computed from ``model``'s gradients on symptom steps when not given);
* ``collect(step)`` returns the samples due at ``step``:
  - every ``symptoms.every`` steps the buffered values, read in one transfer (``loss``,
    ``loss_nonfinite``, ``grad_norm``);
  - every ``router.every`` steps the router hooks' device-side sums (``RouterProbe``);
  - every ``qk.delta`` steps fp32 snapshots of the sampled Q/K weights are taken and a job is
    handed to ``submit`` (the agent's monitor thread; inline in the test bed); a result
    measured at step t is returned at step t + ``scheduling.apply_lag`` (waiting for it if it
    is late), so every rank feeds the same samples to the rules at the same step.

Each part is guarded on its own: a part that fails is reported through ``report(what,
text)`` and skipped (its buffered values dropped), the other parts go on.
``restart()`` forgets what belongs to an abandoned path (after a rollback).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import torch

from agent import samples as m
from agent.discovery import AttentionSite, RouterSite
from agent.discovery.controls import find_controls
from agent.probes import QKJob, QKSnapshots, RouterProbe, compute_qk_samples
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

    def __init__(
        self,
        model: torch.nn.Module,
        config: AgentConfig,
        attention_sites: list[AttentionSite],
        router_sites: list[RouterSite],
        *,
        submit: Submit = run_inline,
        report: Report | None = None,
    ) -> None:
        self.model = model
        self.config = config
        self.attention_sites = attention_sites
        self.router_sites = router_sites
        self.submit = submit
        self.report = report or (lambda what, text: None)
        self.router_probe = RouterProbe(router_sites, config.router.default_top_k)
        self.router_probe.attach()
        qk = config.qk
        self.qk = self._qk_snapshots(
            attention_sites,
            delta=qk.delta,
            layers_per_eval=qk.layers_per_eval,
            heads_per_layer=qk.heads_per_layer,
            device=qk.snapshot_device,
            controls={
                site.name: find_controls(model, site, router_sites, qk.controls)
                for site in attention_sites
            },
        )
        self._loss: list[tuple[int, Scalar]] = []
        self._grad: list[tuple[int, Scalar]] = []
        self._pending: list[tuple[int, Future]] = []  # (due step, future of samples)
        # Set by the distributed pipeline (agent.distributed.measurements); None in one process:
        self.now: float | None = None  # rank 0's clock at the latest read-out
        self.notes: Any = None  # the latest read-out's ranks involved (ReadOutNotes)

    def _qk_snapshots(self, sites: list[AttentionSite], **kwargs: Any) -> QKSnapshots:
        return QKSnapshots(sites, **kwargs)

    # -- the training thread -----------------------------------------------------------------
    def record(self, step: int, loss: Scalar | None, grad_norm: Scalar | None) -> None:
        """Buffer one step's (checked) loss and grad norm; see ``agent.step_inputs``."""
        if loss is not None:
            self._loss.append((step, loss))
        if grad_norm is not None:
            self._grad.append((step, grad_norm))
        elif self.config.symptoms.grad_norm and step % self.config.symptoms.every == 0:
            self._measure_grad_norm(step)

    def _measure_grad_norm(self, step: int) -> None:
        """The loop passed no grad norm: the agent's own (a device tensor, no sync)."""
        norm = self._guarded("grad norm", lambda: _grad_norm(self.model), None)
        if norm is not None:
            self._grad.append((step, norm))

    def collect(self, step: int) -> list[Sample]:
        """Every sample due at ``step`` (see the module docstring)."""
        new: list[Sample] = []
        if step % self.config.symptoms.every == 0:
            new += self._guarded("symptoms", self._read_symptoms, [], clear=True)
        if self.router_sites and step % self.config.router.every == 0:
            new += self._guarded("router probe", lambda: self.router_probe.read(step), [])
            for err in self.router_probe.errors:
                self.report("router probe", err)
            self.router_probe.errors.clear()
        lag = self.config.scheduling.apply_lag
        for job in self._guarded("qk snapshot", lambda: self.qk.on_step(step), []):
            self._pending.append((step + lag, self._submit_job(job)))
        new += self._collect_due(step)
        return new

    def restart(self) -> None:
        """The run continues from an earlier state: drop what was measured on the abandoned
        path (snapshots, results not yet applied, buffered values)."""
        self.qk.reset()
        for _, future in self._pending:
            future.cancel()
        self._pending.clear()
        self._loss.clear()
        self._grad.clear()

    def close(self) -> None:
        self.router_probe.detach()
        for _, future in self._pending:
            future.cancel()
        self._pending.clear()

    # -- parts ---------------------------------------------------------------------------------
    def _read_symptoms(self) -> list[Sample]:
        out: list[Sample] = []
        for buffer, metric in ((self._loss, m.LOSS), (self._grad, m.GRAD_NORM)):
            if not buffer:
                continue
            steps = [s for s, _ in buffer]
            values = _to_floats([v for _, v in buffer])  # one host transfer
            buffer.clear()
            for s, v in zip(steps, values, strict=True):
                out.append(Sample.make(s, metric, v))
                if metric == m.LOSS:
                    out.append(Sample.make(s, m.LOSS_NONFINITE, 0.0 if math.isfinite(v) else 1.0))
        return out

    def _submit_job(self, job: QKJob) -> Future:
        orders = tuple(self.config.qk.orders)
        return self.submit(lambda: compute_qk_samples(job, orders))

    def _collect_due(self, step: int) -> list[Sample]:
        out: list[Sample] = []
        keep: list[tuple[int, Future]] = []
        for due, future in self._pending:
            if due > step:
                keep.append((due, future))
                continue
            try:
                out += future.result(timeout=self.config.scheduling.max_wait_s)
            except Exception as exc:
                self.report("qk monitor", f"{type(exc).__name__}: {exc}")
        self._pending = keep
        return out

    def _guarded(self, what: str, fn: Callable[[], Any], default: Any, *, clear: bool = False):
        try:
            return fn()
        except Exception as exc:
            self.report(what, f"{type(exc).__name__}: {exc}")
            if clear:  # a value that cannot be read must not block every later read
                self._loss.clear()
                self._grad.clear()
            return default


def _to_floats(values: list[Scalar]) -> list[float]:
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    if not tensors:
        return [float(v) for v in values]
    host = iter(torch.stack([t.float().reshape(()) for t in tensors]).cpu().tolist())
    return [next(host) if isinstance(v, torch.Tensor) else float(v) for v in values]


def _grad_norm(model: torch.nn.Module) -> torch.Tensor | None:
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads:
        return None
    norms = torch._foreach_norm(grads)
    return torch.linalg.vector_norm(torch.stack([n.float() for n in norms]))
