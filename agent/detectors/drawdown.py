"""``drawdown``: the value is a factor below the highest (or above the lowest) value of a recent
window of steps, however slowly it got there.

Triggered while ``high / value >= ratio`` (falling), where ``high`` is the largest value
measured within the last ``span`` steps (this one included), or ``value / low >= ratio``
(rising), ``low`` the smallest. Values at or below ``floor`` count as ``floor`` (an entropy of
exactly 0, a learning rate of 0). The window is in steps, not evaluations, so a rule means the
same at any cadence.

It is the complement of ``log_cusum``: that one watches a fall *rate* and forgives a drift
slower than its allowance ``k``; this one watches the depth reached within a window, whatever
the rate, so a bias that drifts at 3% per evaluation, under a rate rule's allowance, still
crosses it. A healthy series drifts too, so on its own it is not specific: the shipped rule
that uses it (``qk_delta2_entropy_slow_collapse``) also requires the direction to hold and the
learning rate to stay put. With ``direction: both`` on a learning rate it says "the schedule
moved x``ratio`` within the span" (a decay, a cut, a warm-up, a restart).

Onset: the first step after the extreme the value departed from. Baseline: the window's high
(the low for ``rising``; with ``both``, the side departed further), so a rule's ``clear:
{baseline_ratio_above: 0.8}`` means back near the high. Statistic: the log of the ratio reached
(``ln(high / value)`` falling, positive; ``-ln(value / low)`` rising, negative; the larger side
with ``both``). Non-finite values are gaps. A step that goes back (a rollback) drops the values
of the abandoned future. O(window) per update: the values measured within ``span`` steps are
kept.

>>> from agent.detectors.drawdown import DrawdownDetector
>>> d = DrawdownDetector(ratio=1.3, span=40)
>>> values = [3.0, 2.9, 2.8, 2.6, 2.4, 2.2, 2.0, 1.9]
>>> [step for step, v in zip(range(0, 80, 10), values) if d.update(step, v).triggered]
[50, 60, 70]
>>> d.onset_step, d.baseline
(40, 2.6)
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field

from agent.detectors.base import TREND_FALLING, TREND_RISING, Detector, DetectorParams


class DrawdownParams(DetectorParams):
    ratio: float = Field(
        description=(
            "Trigger when the value is this factor below the window's highest value "
            "(falling: high / value >= ratio) or above its lowest (rising: value / low >= "
            "ratio); above 1: 1.43 is 30% under the high, 1.5 a third under it or half above "
            "the low."
        ),
        gt=1.0,
    )
    span: int = Field(
        description="Steps: the window is the values measured at most this many steps before "
        "the current one (and the current one).",
        ge=1,
    )
    direction: Literal["falling", "rising", "both"] = Field(
        "falling", description="What triggers: a fall from the high, a rise from the low, either."
    )
    floor: float = Field(
        1e-9, gt=0, description="Values at or below this count as this (metric units)."
    )


class DrawdownDetector(Detector):
    """Depth against a window's extreme. See the module docstring."""

    type = "drawdown"
    Params = DrawdownParams
    params: DrawdownParams

    def _reset_state(self) -> None:
        self._window: deque[tuple[int, float]] = deque()  # (step, value) within span, in order
        self._baseline: float | None = None  # the window's extreme the value is judged from

    @property
    def baseline(self) -> float | None:
        return self._baseline

    @property
    def ready(self) -> bool:
        """After the first finite value (a window needs a value)."""
        return bool(self._window)

    def _rewound(self, step: int) -> None:
        while self._window and self._window[-1][0] >= step:
            self._window.pop()  # measured in a future the rollback abandoned

    def _update_finite(self, step: int, value: float) -> None:
        p = self.params
        value = max(value, p.floor)
        window = self._window
        while window and window[0][0] < step - p.span:
            window.popleft()
        window.append((step, value))
        high_at = max(range(len(window)), key=lambda i: (window[i][1], -i))  # first highest
        low_at = min(range(len(window)), key=lambda i: (window[i][1], i))  # first lowest
        fall = math.log(window[high_at][1] / value)  # >= 0
        rise = math.log(value / window[low_at][1])  # >= 0
        self._statistic = fall if fall >= rise else -rise
        # the side judged: the watched one, or with ``both`` the one departed further
        falling = p.direction == "falling" or (p.direction == "both" and fall >= rise)
        extreme_at, depth = (high_at, fall) if falling else (low_at, rise)
        self._baseline = window[extreme_at][1]
        if depth >= math.log(p.ratio) - 1e-12:  # a fall of exactly x ratio triggers
            trend = TREND_FALLING if falling else TREND_RISING
            self._set_verdict(trend, window[extreme_at + 1][0])
        else:
            self._set_verdict(None, None)

    def _get_state(self) -> dict[str, Any]:
        return {"window": [[s, v] for s, v in self._window], "baseline": self._baseline}

    def _set_state(self, state: Mapping[str, Any]) -> None:
        self._window = deque((int(s), float(v)) for s, v in state["window"])
        self._baseline = state["baseline"]
