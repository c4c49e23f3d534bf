"""``drawdown``: depth against the extreme of a window of steps (agent/detectors/drawdown.py)."""

from __future__ import annotations

import math

import pytest

from agent.detectors import DrawdownDetector, detector_from_state


def feed(d: DrawdownDetector, points: list[tuple[int, float]]) -> list[bool]:
    return [d.update(step, value).triggered for step, value in points]


def test_a_slow_fall_triggers_at_the_ratio_whatever_its_rate():
    """3% per value never crosses a rate allowance of 6%, and crosses x1.43 (30% under the
    high) at the 12th value: 0.97^12 = 0.694."""
    d = DrawdownDetector(ratio=1.43, span=500)
    values = [2.0 * 0.97**i for i in range(14)]
    hits = feed(d, [(25 * i, v) for i, v in enumerate(values)])
    assert hits == [False] * 12 + [True, True]
    assert d.onset_step == 25 and d.direction == "falling"  # the step after the high (0)
    assert d.baseline == 2.0 and d.statistic == pytest.approx(-13 * math.log(0.97))


def test_the_window_is_in_steps_and_includes_its_edge():
    d = DrawdownDetector(ratio=2.0, span=100)
    assert feed(d, [(0, 4.0), (50, 3.0), (100, 2.0)]) == [False, False, True]  # 0 is 100 back
    assert not d.update(101, 2.0).triggered  # the 4.0 of step 0 left the window; 3.0 is x1.5
    assert d.baseline == 3.0


def test_rising_and_both_watch_the_low():
    rising = DrawdownDetector(ratio=1.5, span=525, direction="rising")
    assert feed(rising, [(0, 1.0), (10, 1.2), (20, 1.5)]) == [False, False, True]
    assert rising.direction == "rising" and rising.baseline == 1.0 and rising.onset_step == 10
    both = DrawdownDetector(ratio=1.5, span=525, direction="both")
    assert feed(both, [(0, 0.01), (10, 0.009), (20, 0.006)]) == [False, False, True]
    assert both.direction == "falling" and both.baseline == 0.01
    assert feed(both, [(600, 0.006), (610, 0.012)]) == [False, True]  # a warm restart
    assert both.direction == "rising"


def test_zero_counts_as_the_floor_and_triggers():
    d = DrawdownDetector(ratio=10.0, span=100, floor=1e-6)
    assert feed(d, [(0, 1.0), (10, 0.0), (20, -3.0)]) == [False, True, True]
    assert d.statistic == pytest.approx(math.log(1e6))


def test_non_finite_values_are_gaps():
    d = DrawdownDetector(ratio=2.0, span=100)
    feed(d, [(0, 4.0), (10, 1.0)])
    assert d.triggered
    assert d.update(20, math.nan).triggered  # the verdict of the last finite value stands
    assert d.n_nonfinite == 1


def test_a_rollback_drops_the_abandoned_future_and_the_state_round_trips():
    d = DrawdownDetector(ratio=2.0, span=1000)
    feed(d, [(0, 1.0), (100, 4.0), (200, 4.0)])  # 4.0 measured in a future rolled back
    assert not d.update(50, 1.5).triggered  # back to 50: the high is 1.5, not 4.0
    assert d.baseline == 1.5
    state = d.state_dict()
    restored = detector_from_state(state)
    for step, value in [(60, 0.9), (70, 0.7)]:
        assert d.update(step, value).triggered == restored.update(step, value).triggered
    assert restored.state_dict() == d.state_dict() and d.triggered
