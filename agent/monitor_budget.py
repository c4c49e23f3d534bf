"""An adaptive QK budget (``qk.budget``): how many layers and heads each evaluation measures, so
that the monitor thread's QK work stays within a fraction of the training step time.

Measured, never assumed: the step time is the wall time between two ``Agent.step`` calls (an
exponential mean), the cost of a head is the CPU seconds of a QK job (on the monitor thread or
in the monitor process, ``qk.worker``) divided by the query heads it measured (the layer's
control matrices included: their cost is shared by the heads). One evaluation every ``delta``
steps may then take

    budget x delta x step seconds                                       (seconds per evaluation)

that is ``heads = that / seconds per head`` query heads: all heads of ``heads // H`` layers
(rotating), or, below one layer, ``heads`` of one layer's heads (rotating). Until a job has been
timed, every layer is measured (the configured ``layers_per_eval`` / ``heads_per_layer``).

What it changes for detection: a layer measured every k-th evaluation is seen every k x delta
steps (its increment still spans delta steps; rules with ``per_steps`` keep their fall rate per
step), and a fault that collapses a layer between two of its read-outs is seen late: on the
test bed's 4-layer model, one layer at a time lost its fault to the loss detectors, where the
same QK heads measured as one head of every layer (``heads_per_layer``) kept it
(benchmarks/results/detection_cadence.md). This controller still reduces layers first (heads
only when one whole layer is over the budget), since a layer's fixed work (its control
matrices) is paid whatever its heads; on the test bed that fixed work dominates, so heads in
turn saved nothing there.
"""

from __future__ import annotations

import math
import threading

_ALPHA = 0.2  # weight of the newest observation in the exponential means


class MonitorBudget:
    """See the module docstring. ``fraction``: the budget, e.g. 0.01 for 1% of the step time."""

    def __init__(self, fraction: float, *, delta: int, layers: int, heads: int) -> None:
        if not 0 < fraction <= 1:
            raise ValueError(f"qk.budget must be in (0, 1], got {fraction}")
        self.fraction = fraction
        self.delta = delta
        self.layers = layers  # attention layers of the model
        self.heads = heads  # query heads of the widest layer
        self.step_seconds: float | None = None  # exponential mean, training thread
        self.head_seconds: float | None = None  # exponential mean, monitor thread
        self._last_step_time: float | None = None
        self._lock = threading.Lock()

    def on_step(self, now: float) -> None:
        """Training thread, once per step (``now``: a monotonic clock, seconds)."""
        last, self._last_step_time = self._last_step_time, now
        if last is not None and now > last:
            self.step_seconds = _mean(self.step_seconds, now - last)

    def on_job(self, seconds: float, heads: int) -> None:
        """Monitor thread: a QK job took ``seconds`` of CPU time for ``heads`` query heads."""
        if heads > 0 and seconds >= 0:
            with self._lock:
                self.head_seconds = _mean(self.head_seconds, seconds / heads)

    def restart(self) -> None:
        """The run moved (a rollback): the next step interval is not a step."""
        self._last_step_time = None

    def plan(self) -> tuple[int | None, int | None]:
        """``(layers_per_eval, heads_per_layer)`` for the next evaluation; ``(None, None)``
        (the configured sampling) until both the step and a job have been timed."""
        with self._lock:
            head = self.head_seconds
        if head is None or self.step_seconds is None or head <= 0:
            return None, None
        allowed = self.fraction * self.delta * self.step_seconds / head  # query heads
        if allowed >= self.layers * self.heads:
            return self.layers, None
        if allowed >= self.heads:
            return max(1, math.floor(allowed / self.heads)), None
        return 1, max(1, math.floor(allowed))


def _mean(current: float | None, value: float) -> float:
    return value if current is None else (1 - _ALPHA) * current + _ALPHA * value
