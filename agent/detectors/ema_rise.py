"""``ema_rise``: an exponential moving average moving ``margin`` away from its own best level.

The loss alarm most training teams already run, as a detector: the EMA of the series (weight
``2 / (span + 1)`` on the newest value) is compared with the best EMA so far (its running
minimum for ``direction: rising``, as for a loss; its running maximum for ``falling``), and
the detector triggers while it is more than ``margin`` (metric units: nats for a loss) away
from it, after ``warmup`` values. Nothing is learned but the best level, so a series that only
improves never fires, and one that gets worse by ``margin`` does, however slowly.

After a rollback (a step earlier than the last one) it starts over, warm-up included: the best
level of the abandoned path says nothing about the restored one (an earlier, less trained state
has a higher loss, which is no damage).

Onset: the first step of the current run of updates more than half the margin from the best
level (as the ``baseline`` detector estimates it). Baseline: the best level. Statistic: the EMA
minus the best level (signed). Non-finite values are gaps.

>>> from agent.detectors.ema_rise import EMARiseDetector
>>> d = EMARiseDetector(span=1, margin=0.1, warmup=2)
>>> [step for step, v in enumerate([3.0, 2.5, 2.4, 2.45, 2.6, 2.2]) if d.update(step, v).triggered]
[4]
>>> d.baseline, d.onset_step
(2.2, None)
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from agent.detectors.base import (
    TREND_FALLING,
    TREND_RISING,
    Detector,
    DetectorParams,
    StateFields,
)
from agent.detectors.runs import run_start


class EMARiseParams(DetectorParams):
    span: int = Field(50, ge=1, description="EMA span, in values (weight 2 / (span + 1)).")
    margin: float = Field(0.1, gt=0, description="Distance from the best EMA, metric units.")
    warmup: int = Field(50, ge=1, description="Finite values before it may trigger.")
    direction: Literal["rising", "falling"] = Field(
        "rising", description="rising: worse is higher (a loss); falling: worse is lower."
    )


class EMARiseDetector(Detector):
    """EMA against its best level. See the module docstring."""

    type = "ema_rise"
    Params = EMARiseParams
    params: EMARiseParams
    _state_fields = StateFields(ints=("n_finite",), as_saved=("level", "best", "since"))

    def _reset_state(self) -> None:
        self._n_finite = 0
        self._level: float | None = None  # the EMA
        self._best: float | None = None  # its best value so far
        self._since: int | None = None  # first step of the run beyond half the margin

    def _rewound(self, step: int) -> None:
        self._reset_state()
        self._clear_verdict()

    @property
    def ready(self) -> bool:
        return self._n_finite >= self.params.warmup

    @property
    def baseline(self) -> float | None:
        return self._best

    def _update_finite(self, step: int, value: float) -> None:
        p = self.params
        self._n_finite += 1
        weight = 2.0 / (p.span + 1)
        level = value if self._level is None else self._level + weight * (value - self._level)
        self._level = level
        sign = 1.0 if p.direction == "rising" else -1.0
        if self._best is None or sign * (level - self._best) <= 0.0:
            self._best = level
        worse = sign * (level - self._best)
        self._since = run_start(worse > p.margin / 2, self._since, step)
        self._statistic = level - self._best
        if self.ready and worse > p.margin:
            self._set_verdict(TREND_RISING if sign > 0 else TREND_FALLING, self._since)
        else:
            self._set_verdict(None, None)
