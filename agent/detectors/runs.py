"""Runs beyond a half band: the onset estimator and the learning filter shared by the
detectors that judge each value against a band around a learned baseline (``baseline``,
``ewma``).

Each value is on a *side* of the half band: -1 below it, +1 above it, 0 inside (the band is
half the trigger margin; only the sides a detector watches count). This class tracks

- the first step of the current run of consecutive values on each side: the detectors' onset
  estimate (the earliest step after which the series stayed beyond half the margin);
- which values a learning baseline may learn: each value is held for one update and released
  unless it belongs to a run (it and its predecessor or its successor on the same non-zero
  side) or it triggered. So the first points of a departure are never absorbed into the
  baseline, while isolated excursions of noise are (dropping every value beyond the band
  instead would shrink the estimated spread of pure noise, and with it the band, in a
  feedback loop that ends with a detector that always fires).

>>> from agent.detectors.runs import HalfBandRuns
>>> runs = HalfBandRuns()
>>> [runs.observe(step, side, value, learnable=True)
...  for step, side, value in [(0, 0, 1.0), (1, -1, 0.2), (2, 0, 1.1), (3, -1, 0.3), (4, -1, 0.1)]]
[None, 1.0, 0.2, 1.1, None]
>>> runs.low_since
3
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from agent.detectors.base import TREND_FALLING, TREND_RISING, Trend

Sides = tuple[bool, bool]  # (watch the low side, watch the high side)


def run_start(inside: bool, since: int | None, step: int) -> int | None:
    """First step of the current run of updates ``inside`` a condition, after the update at
    ``step``: None when it is outside, ``step`` when a run begins, else ``since``."""
    if not inside:
        return None
    return step if since is None else since


class HalfBandRuns:
    """See the module docstring. O(1) per value."""

    def __init__(self) -> None:
        self.forget()

    def forget(self) -> None:
        """Forget the runs and the held value."""
        self.low_since: int | None = None  # first step of the current run on side -1
        self.high_since: int | None = None  # first step of the current run on side +1
        self._held: float | None = None  # the previous value, released at the next update
        self._held_side = 0
        self._held_prev_side = 0  # side of the value before the held one
        self._prev_side = 0  # side of the latest value

    def observe(self, step: int, side: int, value: float, learnable: bool) -> float | None:
        """Record ``value`` at ``step`` on ``side`` (-1, 0, +1); returns the previous value
        if it may be learned now, else None. ``learnable`` False (the value triggered) means
        the value itself is never released."""
        assert side in (-1, 0, 1)
        self.low_since = run_start(side < 0, self.low_since, step)
        self.high_since = run_start(side > 0, self.high_since, step)
        released = None
        if self._held is not None:
            in_run = self._held_side != 0 and self._held_side in (self._held_prev_side, side)
            if not in_run:
                released = self._held
        self._held = value if learnable else None
        self._held_side, self._held_prev_side = side, self._prev_side
        self._prev_side = side
        return released

    def judge(
        self, step: int, x: float, center: float, margin: float, value: float, sides: Sides
    ) -> tuple[Trend | None, int | None, float | None]:
        """Judge ``x`` against the band ``center -/+ margin`` on the watched ``sides`` (low,
        high): its side of the half band ``center -/+ margin / 2`` goes to ``observe`` with
        ``value``, the value to learn. Returns the trend (None unless ``x`` is beyond the full
        margin), the onset of its run, and the value ``observe`` released for learning."""
        side = 0
        if sides[0] and x < center - 0.5 * margin:
            side = -1
        elif sides[1] and x > center + 0.5 * margin:
            side = 1
        triggered = (side < 0 and x < center - margin) or (side > 0 and x > center + margin)
        released = self.observe(step, side, value, learnable=not triggered)
        if not triggered:
            return None, None, released
        return (TREND_FALLING if side < 0 else TREND_RISING), self.since(side), released

    def since(self, side: int) -> int | None:
        """First step of the current run on ``side``."""
        return self.low_since if side < 0 else self.high_since

    def state_dict(self) -> dict[str, Any]:
        return {
            "low_since": self.low_since,
            "high_since": self.high_since,
            "held": self._held,
            "held_side": self._held_side,
            "held_prev_side": self._held_prev_side,
            "prev_side": self._prev_side,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.low_since = state["low_since"]
        self.high_since = state["high_since"]
        self._held = state["held"]
        self._held_side = int(state["held_side"])
        self._held_prev_side = int(state["held_prev_side"])
        self._prev_side = int(state["prev_side"])
