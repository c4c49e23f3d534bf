"""``slope``: a significant monotonic trend over the last ``window`` updates.

Test: Mann-Kendall on the window in arrival order. The statistic
``S = sum_{i<j} sign(y_j - y_i)`` is kept incrementally (O(window) per update: add the new
value's signs against the window, remove the oldest's); its variance has the tie correction
``Var S = [n(n-1)(2n+5) - sum_t t(t-1)(2t+5)] / 18`` (t: sizes of groups of equal values,
counted incrementally too); the one-sided p-value uses the normal approximation with
continuity correction, ``Z = (|S| - 1) / sqrt(Var S)`` (the standard Mann-Kendall test).

Defaults: ``window = 50`` and ``alpha = 1e-5`` because the test is repeated on every update of
many series: on N(0, 1) noise no alarm in 1.2e5 updates, while a drift of 0.05 std per update
is caught after about 40 updates (window 20 needs about 0.2 std per update).

Size: the Theil-Sen slope, the median of the pairwise slopes ``(y_j - y_i) / (x_j - x_i)``
over pairs with different steps, in metric units per training step (O(window^2), computed only
when the trend is significant and when ``statistic`` is read).

Triggered when the trend is in ``direction`` with p < ``alpha`` and, when given,
``|slope| >= min_slope`` and ``|slope| * (step span of the window) / |median of window| >=
min_rel_change`` (the change the trend makes over the window, relative to its level).

Onset estimator: on the update that starts a triggered period, a hinge is fitted to the
window by least squares, ``y = a + b * max(0, x - tau)`` with ``tau`` at each window step
(flat up to ``tau``, linear after), or a plain line (the trend began before the window); the
onset is the first step after the best ``tau`` (the window's first step for the plain line).
It is never earlier than the start of the window in which the trend first became significant,
and it stays fixed while the detector remains triggered. A level shift inside a long window is
a significant trend too; the hinge then puts the onset a few updates before the shift (early:
the safe side for a rollback), where a drift's onset tends to come a few updates late.

There is no baseline. ``reset()`` forgets the departure AND empties the window, so that the
test restarts on data measured after the reset (for example after a remediation). Non-finite
values are gaps (see ``agent.detectors.base``).

>>> from agent.detectors.slope import SlopeDetector
>>> d = SlopeDetector(window=10, alpha=0.01)
>>> values = [1.0, 1.01, 0.99, 1.0, 1.01, 0.99, 1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7]
>>> [step for step, v in enumerate(values) if d.update(step, v).triggered]
[10, 11, 12]
>>> d.onset_step, d.direction, round(d.statistic, 3)
(7, 'falling', -0.04)
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from typing import Any, Literal

import numpy as np
from pydantic import Field

from agent.detectors.base import (
    TREND_FALLING,
    TREND_RISING,
    Detector,
    DetectorParams,
    StateFields,
    Trend,
)


class SlopeParams(DetectorParams):
    window: int = Field(
        50, ge=6, description="Number of latest finite values the trend is tested on."
    )
    direction: Literal["falling", "rising", "both"] = Field(
        "falling", description="Which trend triggers."
    )
    alpha: float = Field(
        1e-5,
        gt=0,
        lt=1,
        description="One-sided Mann-Kendall p-value below which the trend is significant. "
        "Small by default: the test is repeated on every update of many series.",
    )
    min_slope: float | None = Field(
        None,
        ge=0,
        description="Optional: also require |Theil-Sen slope| >= this, in metric units per step.",
    )
    min_rel_change: float | None = Field(
        None,
        ge=0,
        description="Optional: also require |slope| * (step span of the window) / |median of "
        "the window| >= this (0.1: the trend moves the metric by 10% over the window).",
    )


def mann_kendall_p(s: int, variance: float, trend: Trend) -> float:
    """One-sided p-value of Mann-Kendall's S for a trend in ``trend`` (normal approximation,
    continuity correction)."""
    if variance <= 0.0:
        return 1.0
    signed = s if trend == TREND_RISING else -s  # > 0 when the data go the tested way
    z = (signed - 1) / math.sqrt(variance) if signed > 0 else 0.0
    return 0.5 * math.erfc(z / math.sqrt(2.0))


def _tie_term(t: int) -> int:
    """A group of t equal values lowers 18 Var S by t(t-1)(2t+5)."""
    return t * (t - 1) * (2 * t + 5)


def mann_kendall_variance(values: np.ndarray) -> float:
    """Var S under no trend, with the tie correction. ``values``: (n,)."""
    n = values.shape[0]
    _, counts = np.unique(values, return_counts=True)  # sizes of groups of equal values
    ties = sum(_tie_term(int(t)) for t in counts)
    return (n * (n - 1) * (2 * n + 5) - ties) / 18.0


def theil_sen_slope(steps: np.ndarray, values: np.ndarray) -> float:
    """Median of pairwise slopes over pairs with different steps; 0.0 when there are none.
    ``steps``, ``values``: (n,)."""
    i, j = np.triu_indices(steps.shape[0], k=1)  # (n(n-1)/2,) each
    dx = steps[j] - steps[i]
    keep = dx != 0
    if not np.any(keep):
        return 0.0
    return float(np.median((values[j] - values[i])[keep] / dx[keep]))


def hinge_onset(steps: np.ndarray, values: np.ndarray) -> float:
    """First step of the sloped part of the best least-squares hinge fit (see the module
    docstring). ``steps``, ``values``: (n,), n >= 4."""
    n = steps.shape[0]
    yc = values - values.mean()  # (n,)
    syy = float(yc @ yc)
    best_sse, best_onset = math.inf, float(steps[0])
    # k = -1: a plain line, the trend began before the window; k >= 0: flat up to steps[k].
    for k in range(-1, n - 2):
        feature = steps - steps[0] if k < 0 else np.maximum(0.0, steps - steps[k])  # (n,)
        fc = feature - feature.mean()
        sff = float(fc @ fc)
        if sff <= 0.0:
            continue
        sse = syy - float(fc @ yc) ** 2 / sff
        if sse < best_sse:
            best_sse, best_onset = sse, float(steps[k + 1] if k >= 0 else steps[0])
    return best_onset


class SlopeDetector(Detector):
    """Mann-Kendall trend test with a Theil-Sen slope. See the module docstring."""

    type = "slope"
    Params = SlopeParams
    params: SlopeParams
    _state_fields = StateFields(ints=("s",), as_saved=("p_value",))

    def _reset_state(self) -> None:
        self._steps: deque[int] = deque(maxlen=self.params.window)
        self._values: deque[float] = deque(maxlen=self.params.window)
        self._s = 0  # Mann-Kendall S of the window (exact integer)
        self._p_value: float | None = None
        self._slope_cache: float | None = None
        self._count_values()

    def _count_values(self) -> None:
        """Rebuild the tie bookkeeping from the window."""
        self._counts: dict[float, int] = {}  # value -> occurrences in the window
        self._tie_term = 0  # sum over tie groups of t(t-1)(2t+5), for Var S
        for v in self._values:
            self._count(v, +1)

    def _count(self, value: float, change: int) -> None:
        before = self._counts.get(value, 0)
        after = before + change
        self._tie_term += _tie_term(after) - _tie_term(before)
        if after:
            self._counts[value] = after
        else:
            del self._counts[value]

    def _forget_departure(self) -> None:
        self._reset_state()

    @property
    def ready(self) -> bool:
        return len(self._values) == self.params.window

    @property
    def kendall_s(self) -> int:
        """Mann-Kendall S of the current window."""
        return self._s

    @property
    def p_value(self) -> float | None:
        """One-sided p-value of the latest test (the smaller side for direction "both")."""
        return self._p_value

    @property
    def statistic(self) -> float | None:
        """Theil-Sen slope of the window, metric units per step (None before the window is
        full)."""
        if not self.ready:
            return None
        if self._slope_cache is None:
            with np.errstate(all="ignore"):  # values near 1e308 overflow: documented, silent
                self._slope_cache = theil_sen_slope(
                    np.fromiter(self._steps, np.float64), np.fromiter(self._values, np.float64)
                )
        return self._slope_cache

    def _update_finite(self, step: int, value: float) -> None:
        with np.errstate(all="ignore"):  # values near 1e308 overflow: documented, silent
            self._test(step, value)

    def _test(self, step: int, value: float) -> None:
        p = self.params
        window = np.fromiter(self._values, np.float64, count=len(self._values))  # (<= window,)
        if len(self._values) == p.window:  # the oldest value leaves the window
            oldest = self._values.popleft()
            self._steps.popleft()
            self._count(oldest, -1)
            window = window[1:]
            self._s -= int(np.sign(window - oldest).sum())
        self._s += int(np.sign(value - window).sum())
        self._values.append(value)
        self._steps.append(step)
        self._count(value, +1)
        self._slope_cache = None
        if not self.ready:
            return
        n = p.window
        variance = (n * (n - 1) * (2 * n + 5) - self._tie_term) / 18.0
        tested: tuple[Trend, ...] = (
            (TREND_FALLING, TREND_RISING)
            if p.direction == "both"
            else ((TREND_FALLING,) if p.direction == "falling" else (TREND_RISING,))
        )
        trend, self._p_value = min(
            ((t, mann_kendall_p(self._s, variance, t)) for t in tested), key=lambda tp: tp[1]
        )
        significant = self._p_value < p.alpha and self._large_enough(trend)
        if not significant:
            self._set_verdict(None, None)
            return
        onset = self._onset_step if self._triggered and self._direction == trend else None
        if onset is None:
            steps = np.fromiter(self._steps, np.float64, count=n)  # (window,)
            values = np.fromiter(self._values, np.float64, count=n)  # (window,)
            onset = int(hinge_onset(steps, values))
        self._set_verdict(trend, onset)

    def _large_enough(self, trend: Trend) -> bool:
        p = self.params
        if p.min_slope is None and p.min_rel_change is None:
            return True
        slope = self.statistic
        assert slope is not None
        if (slope < 0) != (trend == TREND_FALLING):
            return False  # Theil-Sen and Mann-Kendall disagree on the sign: no trend to size
        if p.min_slope is not None and abs(slope) < p.min_slope:
            return False
        if p.min_rel_change is not None:
            span = self._steps[-1] - self._steps[0]
            level = abs(float(np.median(np.fromiter(self._values, np.float64))))
            change = abs(slope) * span
            if change < p.min_rel_change * level or change == 0.0:
                return False
        return True

    def _get_state(self) -> dict[str, Any]:
        return {**super()._get_state(), "steps": list(self._steps), "values": list(self._values)}

    def _set_state(self, state: Mapping[str, Any]) -> None:
        super()._set_state(state)
        self._steps = deque((int(s) for s in state["steps"]), maxlen=self.params.window)
        self._values = deque((float(v) for v in state["values"]), maxlen=self.params.window)
        self._slope_cache = None
        self._count_values()
