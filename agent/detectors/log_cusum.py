"""``log_cusum``: a CUSUM on the relative change between successive values: a sustained fall
(or rise) *rate*, whatever the level.

Each update after the first adds the log-change ``d = ln(value) - ln(previous)`` to one-sided
sums with an allowance ``k`` per update (natural-log units: 0.1 is about 10% per update):

    C- = max(0, C- - d - k)      (falling)        C+ = max(0, C+ + d - k)      (rising)

and triggers while a watched sum exceeds ``h`` (log units: 1.0 is a fall to 1/e, beyond the
allowance). There is no baseline to learn, so nothing a series did before can disarm it: a
healthy series that drifts slower than ``k`` per update never accumulates (a router sharpening
through its warm-up, a slow phase transition), a one-time step smaller than ``h + k`` is
forgiven (a learning-rate change), while a collapse that keeps going fires within a few
updates at any level. Values at or below ``floor`` count as ``floor`` (an entropy of exactly 0).

Onset: the first update of the triggered sum's current excursion. Baseline: the value just
before the departure began (what the series fell or rose from). It outlives the sum: a series
that collapsed and stays down lets its sum decay by ``k`` per update, but the baseline is
replaced only by a departure that starts from within ``h`` of it (the series came back), so a
rule's ``clear: {baseline_ratio_above: 0.8}`` keeps the alert firing until the value recovers.
The statistic is the larger sum, signed (- falling, + rising). Non-finite values are gaps.

``min_updates`` (default 1): a sum triggers only once its current excursion spans that many
updates. With 2, a single outlying value from a quiet series (a noisy read-out: the sum jumps
past ``h`` on the excursion's first update and the next value clears it) cannot trigger,
while a departure already under way triggers on the update it crosses ``h``, as with 1: a
collapse accelerates through a few updates before it crosses, a noisy read-out comes out of
nowhere. A step that stays is then taken one update later when its excess still exceeds
``h`` (a one-time step below ``h + min_updates x k`` is forgiven). Unlike a rule's ``for``,
which needs ``h`` exceeded at two evaluations and so delays every alert, it costs nothing on
a trend.

``per_steps`` (default off): ``k`` and ``min_updates`` count updates, so what they mean
depends on how far apart the values are: a rule tuned on a value every 25 steps watches a
fall rate twice as steep, over an excursion half as long, when its metric comes every 12
steps (an agent configured with ``qk.delta: 12``, or every 200 steps for a layer measured in
turn with ``layers_per_eval``). With ``per_steps`` they are given per that many steps and
rescaled to the gap between each value and the one before: the allowance of an update is
``k x gap / per_steps`` (the same fall rate per step), and a sum triggers once its excursion
spans ``round(min_updates x per_steps / gap)`` updates (about the same number of steps), but
never fewer than ``min(min_updates, 2)``: a single outlying read-out is one update at any gap.
At a gap of ``per_steps`` nothing changes. ``h`` is a total fall and stays.

``noise_k`` and ``noise_h`` (default off): ``k`` and ``h`` are fixed in log units, but how far
a healthy series moves between evaluations depends on the model (the head-mean H(Delta_2) of
the test bed moves 1-4% per evaluation, that of a small HF Mixtral or Qwen2-MoE 9-16%). With
them the allowance and the decision interval are raised to the series' own noise, as in a
textbook CUSUM on standardized values (Montgomery: k = 0.5 sigma, h = 4 or 5 sigma):

    k_eff = max(k, noise_k x sigma)        h_eff = max(h, noise_h x sigma)

where sigma is the robust spread (1.4826 x the median absolute deviation) of the last
``noise_window`` log-changes that were noise. The first half window of changes are noise
whatever they are: until then the sums accumulate with ``k`` and ``h`` but cannot trigger
(``ready`` is False), so a noisy series' first values cannot fire it, and a collapse already
under way from the first value (a steady fall has a small spread) fires as soon as they are
known. With ``per_steps``, values sparser than that (a layer measured in turn) learn about as
many steps' worth instead: half the window x ``per_steps`` / gap changes, but at least 4 (a
layer read every 100 steps would otherwise stay blind for 800 steps after its first value).
After that a departure's changes are held until its sum is back to 0, and join the
noise only if it did not fire. ``k`` and ``h`` stay the floor, so a quiet series is judged
exactly as without them.

>>> from agent.detectors.log_cusum import LogCUSUMDetector
>>> d = LogCUSUMDetector(k=0.1, h=1.0, direction="falling")
>>> values = [2.0, 1.95, 2.0, 1.9, 1.2, 0.6, 0.3, 0.3]
>>> [step for step, v in enumerate(values) if d.update(step, v).triggered]
[6, 7]
>>> d.onset_step, round(d.baseline, 2)
(4, 1.9)
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field

from agent.detectors.base import DetectorParams, StateFields
from agent.detectors.baseline import MAD_TO_STD
from agent.detectors.cusum import EXCURSION_UPDATES, MIN_UPDATES_FIELD, TwoSidedSums

SPARSE_NOISE_CHANGES = 4  # the fewest noise changes a sparse series learns sigma from


class LogCUSUMParams(DetectorParams):
    k: float = Field(0.1, ge=0, description="Allowance per update, natural-log units.")
    h: float = Field(1.0, gt=0, description="Decision interval, natural-log units.")
    direction: Literal["falling", "rising", "both"] = Field(
        "falling", description="Which sum triggers: C- (falling), C+ (rising) or either."
    )
    floor: float = Field(
        1e-9, gt=0, description="Values at or below this count as this (metric units)."
    )
    min_updates: int = MIN_UPDATES_FIELD
    per_steps: int | None = Field(
        None,
        ge=1,
        description=(
            "Give k and min_updates per this many steps (the cadence a rule was tuned at): each "
            "update's allowance is k x gap / per_steps and an excursion must span "
            "round(min_updates x per_steps / gap) updates (at least min(min_updates, 2)), gap "
            "being the steps since the previous value. None: per update, whatever the gap."
        ),
    )
    noise_k: float | None = Field(
        None,
        gt=0,
        description=(
            "Raise k to this many times the series' own noise (the robust spread of its recent "
            "log-changes): k_eff = max(k, noise_k x sigma). None: k as given."
        ),
    )
    noise_h: float | None = Field(
        None,
        gt=0,
        description="Raise h likewise: h_eff = max(h, noise_h x sigma). None: h as given.",
    )
    noise_window: int = Field(
        16,
        ge=4,
        description=(
            "How many recent noise log-changes give sigma (with noise_k or noise_h); the "
            "detector can trigger once half of them are known (with per_steps, where values "
            "come further apart: as many steps' worth, at least 4 changes)."
        ),
    )

    @property
    def scaled(self) -> bool:
        """Whether k or h follows the series' noise."""
        return self.noise_k is not None or self.noise_h is not None

    def noise_changes_needed(self, gap: int | None = None) -> int:
        """How many noise changes must be known before the first trigger: half the window;
        with ``per_steps``, where values come ``gap`` > ``per_steps`` steps apart, about as many
        steps' worth (half the window x per_steps / gap changes), but never fewer than
        ``SPARSE_NOISE_CHANGES`` (nor than half the window, where that is less)."""
        half = max(2, self.noise_window // 2)
        if self.per_steps is None or gap is None or gap <= self.per_steps:
            return half
        return max(min(SPARSE_NOISE_CHANGES, half), math.ceil(half * self.per_steps / gap))


class LogCUSUMDetector(TwoSidedSums):
    """CUSUM on log-changes. See the module docstring."""

    type = "log_cusum"
    Params = LogCUSUMParams
    params: LogCUSUMParams
    _state_fields = StateFields(
        floats=("c_high", "c_low"),
        as_saved=("previous", "high_since", "low_since", "high_from", "low_from"),
        added={**EXCURSION_UPDATES, "noise": None, "previous_step": None},
    )

    def _reset_state(self) -> None:
        self._previous: float | None = None  # ln of the previous value
        self._previous_step: int | None = None  # its step
        self._high_from: float | None = None  # the value the current departure rose from
        self._low_from: float | None = None  # ... fell from (kept by reset: the baseline)
        window = self.params.noise_window
        self._changes: deque[float] = deque(maxlen=window)  # recent noise log-changes
        self._noise: float | None = None  # sigma of self._changes (None: too few yet)
        self._forget_departure()

    def _forget_departure(self) -> None:
        super()._forget_departure()
        # the log-changes of the departure under way (noise unless it fires)
        self._pending: deque[float] = deque(maxlen=self.params.noise_window)
        self._fired = False  # whether the departure under way has triggered

    @property
    def ready(self) -> bool:
        """After the first finite value (a change needs a value to change from); with
        ``noise_k`` or ``noise_h``, once the noise is known."""
        return self._previous is not None and (not self.params.scaled or self._noise is not None)

    @property
    def noise(self) -> float | None:
        """sigma: the robust spread of the recent noise log-changes (None: too few yet)."""
        return self._noise

    @property
    def baseline(self) -> float | None:
        watched = self.params.direction
        if watched == "both":
            watched = "rising" if self._c_high > self._c_low else "falling"
        start = self._low_from if watched == "falling" else self._high_from
        if start is not None:
            return start
        return None if self._previous is None else math.exp(self._previous)

    def _update_finite(self, step: int, value: float) -> None:
        p = self.params
        now = math.log(max(value, p.floor))
        before, self._previous = self._previous, now
        before_step, self._previous_step = self._previous_step, step
        if before is None:
            return
        low_was, high_was = self._c_low, self._c_high
        change = now - before
        k, h, young = p.k, p.h, None
        if p.per_steps is not None and before_step is not None and step > before_step:
            gap = (step - before_step) / p.per_steps  # in units of per_steps
            # about the same span in steps, but never fewer than 2 updates where 2 or more
            # were asked for: a single outlying read-out is one update at any gap
            k, young = k * gap, max(round(p.min_updates / gap), min(p.min_updates, 2))
        if p.scaled:
            k, h = self._noise_scaled(k, p.noise_k), self._noise_scaled(h, p.noise_h)
        self._accumulate(step, change, k, h, p.direction, young)
        if p.scaled:
            self._learn_noise(change, None if before_step is None else step - before_step)
        if low_was == 0.0 and self._c_low != 0.0 and self._came_back(before, self._low_from, -1):
            self._low_from = math.exp(before)
        if high_was == 0.0 and self._c_high != 0.0 and self._came_back(before, self._high_from, 1):
            self._high_from = math.exp(before)

    def _noise_scaled(self, floor: float, times: float | None) -> float:
        if times is None or self._noise is None:
            return floor
        return max(floor, times * self._noise)

    def _learn_noise(self, change: float, gap: int | None) -> None:
        """File ``change`` (over ``gap`` steps): the first ones are noise whatever they are (no
        trigger until enough are known); after that, held while a watched departure is under
        way and noise once that departure ended without firing."""
        if self._noise is None:
            self._set_verdict(None, None)
            self._changes.append(change)
            self._pending.clear()
            self._fired = False
            self._measure_noise(self.params.noise_changes_needed(gap))
            return
        self._fired = self._fired or self._triggered
        self._pending.append(change)
        watched = self.params.direction
        departing = (watched != "falling" and self._c_high > 0.0) or (
            watched != "rising" and self._c_low > 0.0
        )
        if departing:
            return
        if not self._fired:
            self._changes.extend(self._pending)
            self._measure_noise(1)  # known already: follow the window
        self._pending.clear()
        self._fired = False

    def _measure_noise(self, needed: int) -> None:
        """sigma of the noise changes, once there are ``needed`` of them."""
        if len(self._changes) >= needed:
            center = statistics.median(self._changes)
            spread = statistics.median(abs(x - center) for x in self._changes)
            self._noise = MAD_TO_STD * spread

    def _get_state(self) -> dict[str, Any]:
        state = super()._get_state()
        return {
            **state,
            "changes": list(self._changes),
            "pending": list(self._pending),
            "fired": self._fired,
        }

    def _set_state(self, state: Mapping[str, Any]) -> None:
        super()._set_state(state)
        window = self.params.noise_window
        self._changes = deque((float(x) for x in state.get("changes", ())), maxlen=window)
        self._pending = deque((float(x) for x in state.get("pending", ())), maxlen=window)
        self._fired = bool(state.get("fired", False))

    def _came_back(self, level: float, reference: float | None, sign: int) -> bool:
        """Whether a new departure from ``level`` (ln) starts a new reference: there is none
        yet, or the series is back within ``h`` of the old one."""
        if reference is None:
            return True
        return sign * (level - math.log(max(reference, self.params.floor))) <= self.params.h
