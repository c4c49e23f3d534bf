"""The loss detectors people use today, as offline yardsticks for the mechanism alerts.

Each takes a run's per-step training loss (nats; index = step) and returns the first step at
which it would have fired (None: never), counting only steps >= ``min_step``:

- ``zscore_spike_step``: OLMo-core's ``StabilityMonitorCallback``: a spike when the loss exceeds
  the mean of the previous ``window`` (128) losses by ``z`` (6) population standard deviations
  (no verdict before the window is full, or when the deviation is below 1e-10).
- ``ema_rise_step``: an EMA of the loss (span 50) rising ``margin`` (0.1) nats above its own
  running minimum (``divergence.divergence_step`` with a 0.1-nat margin); a non-finite loss
  fires at once.
- ``lightning_spike_step``: Lightning's ``SpikeDetection`` with its defaults (``mode="min"``,
  ``window=10``, ``warmup=1``, ``atol=None``, ``rtol=2.0``, ``finite_only=True``): a
  non-finite loss, or a loss that rose since the last accepted one and lies at least
  ``rtol`` x the running mean of the last ``window`` accepted losses away from it.

``earliest_loss_alarm`` is the first of the three, with the name of the one that fired.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence

from agent.testbed.divergence import divergence_step


def zscore_spike_step(
    losses: Sequence[float], *, window: int = 128, z: float = 6.0, min_step: int = 0
) -> int | None:
    history: deque[float] = deque(maxlen=window)
    for step, value in enumerate(losses):
        if len(history) == window and step >= min_step:
            mean = sum(history) / window
            std = math.sqrt(sum((x - mean) ** 2 for x in history) / window)
            if std >= 1e-10 and value > mean + z * std:
                return step
        history.append(value)
    return None


def ema_rise_step(
    losses: Sequence[float], *, margin: float = 0.1, span: int = 50, min_step: int = 0
) -> int | None:
    return divergence_step(losses, margin=margin, span=span, min_step=min_step)


def lightning_spike_step(
    losses: Sequence[float],
    *,
    window: int = 10,
    warmup: int = 1,
    rtol: float = 2.0,
    min_step: int = 0,
) -> int | None:
    accepted: deque[float] = deque(maxlen=window)
    last = 0.0
    for step, value in enumerate(losses):
        if step >= warmup:
            if not math.isfinite(value):
                spike = True
            elif value - last <= 0.0 or not accepted:
                spike = False
            else:
                mean = sum(accepted) / len(accepted)
                spike = abs(value - mean) >= abs(rtol * mean)
            if spike and step >= min_step:
                return step
            if spike:
                continue  # Lightning raises here; before min_step the value is not accepted
        if math.isfinite(value):
            accepted.append(value)
            last = value
    return None


BASELINES = {
    "zscore_128_6sigma": zscore_spike_step,
    "ema_rise_0.1": ema_rise_step,
    "lightning_spike": lightning_spike_step,
}


def earliest_loss_alarm(losses: Sequence[float], *, min_step: int = 0) -> tuple[int | None, str]:
    """(step, detector name) of the first loss baseline to fire at or after ``min_step``."""
    fired = [
        (step, name)
        for name, detect in BASELINES.items()
        if (step := detect(losses, min_step=min_step)) is not None
    ]
    return min(fired) if fired else (None, "")
