"""The one place where loss divergence and loss degradation are defined.

Both work on the per-step training loss (cross-entropy, nats) of one run, smoothed by an
exponential moving average (EMA) with ``span`` steps (weight 2 / (span + 1) on the newest
value) so that single noisy batches do not count:

- **divergence**: the first step at which the loss is non-finite, or the EMA loss rises more
  than ``margin`` nats (default 0.5) above its own running minimum (only steps >= ``min_step``
  count; the running minimum covers all earlier steps). A loss that explodes, or that climbs
  back up by half a nat and more, has diverged.
- **degradation** (the milder symptom, for faults whose loss does not diverge outright, as the
  router faults at this size): the first step from which the EMA loss stays more than
  ``margin`` nats (default 0.05) above a reference for ``patience`` consecutive steps. The
  reference is the EMA loss of a reference run (the clean run of the same seed) when one is
  given, else the run's own running minimum. Non-finite losses count as degraded.

Steps are indices into the loss list (0 = the first optimizer step).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

DIVERGENCE_MARGIN = 0.5  # nats above the running minimum of the EMA loss
DEGRADATION_MARGIN = 0.05  # nats above the reference EMA loss
EMA_SPAN = 50  # steps
DEGRADATION_PATIENCE = 100  # consecutive steps


def ema(values: Sequence[float], span: int = EMA_SPAN) -> list[float]:
    """Exponential moving average; a non-finite value makes the rest non-finite too."""
    if span < 1:
        raise ValueError(f"ema: span must be >= 1, got {span}")
    weight = 2.0 / (span + 1)
    out: list[float] = []
    level: float | None = None
    for v in values:
        v = float(v)
        level = v if level is None else level + weight * (v - level)
        out.append(level)
    return out


def divergence_step(
    losses: Sequence[float],
    *,
    margin: float = DIVERGENCE_MARGIN,
    span: int = EMA_SPAN,
    min_step: int = 0,
) -> int | None:
    """First step at which the loss diverged (see module docstring), or None."""
    if margin <= 0:
        raise ValueError(f"divergence_step: margin must be > 0, got {margin}")
    running_min = math.inf
    for step, (raw, smooth) in enumerate(zip(losses, ema(losses, span), strict=True)):
        if not math.isfinite(raw) or not math.isfinite(smooth):
            return step
        if step >= min_step and smooth - running_min > margin:
            return step
        running_min = min(running_min, smooth)
    return None


def degradation_step(
    losses: Sequence[float],
    reference: Sequence[float] | None = None,
    *,
    margin: float = DEGRADATION_MARGIN,
    span: int = EMA_SPAN,
    patience: int = DEGRADATION_PATIENCE,
    min_step: int = 0,
) -> int | None:
    """First step of a run of ``patience`` degraded steps (see module docstring), or None.

    A degraded stretch still in progress at the end of ``losses`` counts only if it is
    ``patience`` steps long.
    """
    if margin <= 0:
        raise ValueError(f"degradation_step: margin must be > 0, got {margin}")
    if patience < 1:
        raise ValueError(f"degradation_step: patience must be >= 1, got {patience}")
    smooth = ema(losses, span)
    if reference is not None:
        if len(reference) < len(losses):
            raise ValueError(
                f"degradation_step: reference has {len(reference)} steps, fewer than the "
                f"run's {len(losses)}"
            )
        baseline = ema(reference[: len(losses)], span)
    else:
        baseline, running_min = [], math.inf
        for s in smooth:
            baseline.append(running_min)
            running_min = min(running_min, s)
    start: int | None = None
    for step, (raw, s, b) in enumerate(zip(losses, smooth, baseline, strict=True)):
        degraded = not math.isfinite(raw) or not math.isfinite(s) or s - b > margin
        if step < min_step or not degraded:
            start = None
            continue
        if start is None:
            start = step
        if step - start + 1 >= patience:
            return start
    return None
