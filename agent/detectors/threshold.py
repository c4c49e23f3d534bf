"""``threshold``: the value is above or below a fixed level.

Triggered when ``value > above`` or ``value < below`` (strict). The onset is the first step of
the current run of consecutive triggered updates. There is no warm-up and no baseline; the
statistic is the latest value.

Non-finite values are compared as they are, unlike the statistical detectors: NaN is neither
above nor below anything (it ends a run; a dedicated ``loss_nonfinite`` rule handles NaN),
+inf is above every ``above`` and -inf below every ``below``.

>>> from agent.detectors.threshold import ThresholdDetector
>>> d = ThresholdDetector(above=2.0)
>>> [d.update(step, v).triggered for step, v in zip(range(0, 50, 10), [1, 3, 3.5, 1, 4])]
[False, True, True, False, True]
>>> d.onset_step, d.direction
(40, 'rising')
"""

from __future__ import annotations

from pydantic import Field, model_validator

from agent.detectors.base import (
    TREND_FALLING,
    TREND_RISING,
    Detector,
    DetectorParams,
    StateFields,
)


class ThresholdParams(DetectorParams):
    above: float | None = Field(
        None, description="Trigger when the value is strictly above this level (metric units)."
    )
    below: float | None = Field(
        None, description="Trigger when the value is strictly below this level (metric units)."
    )

    @model_validator(mode="after")
    def _check_levels(self) -> ThresholdParams:
        if self.above is None and self.below is None:
            raise ValueError("threshold needs `above`, `below` or both")
        if self.above is not None and self.below is not None and self.below > self.above:
            raise ValueError(
                f"threshold `below` ({self.below}) is greater than `above` ({self.above}): "
                "every value would trigger"
            )
        return self


class ThresholdDetector(Detector):
    """Fixed levels. See the module docstring."""

    type = "threshold"
    Params = ThresholdParams
    params: ThresholdParams
    _state_fields = StateFields(as_saved=("run_start",))

    def _reset_state(self) -> None:
        self._run_start: int | None = None  # first step of the current triggered run

    def _forget_departure(self) -> None:
        self._run_start = None

    def _update_finite(self, step: int, value: float) -> None:
        self._compare(step, value)

    def _update_nonfinite(self, step: int, value: float) -> None:
        self._compare(step, value)

    def _compare(self, step: int, value: float) -> None:
        p = self.params
        self._statistic = value
        if p.above is not None and value > p.above:
            trend = TREND_RISING
        elif p.below is not None and value < p.below:
            trend = TREND_FALLING
        else:
            trend = None
        if trend is None:
            self._run_start = None
        elif self._run_start is None or trend != self._direction:
            self._run_start = step  # a new run (a jump from above to below starts one too)
        self._set_verdict(trend, self._run_start)
