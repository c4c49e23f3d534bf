"""``log_cusum`` on step, ramp, spike and noise series, with exact indices."""

from __future__ import annotations

import math

import pytest

from agent.detectors.log_cusum import LogCUSUMDetector
from agent.detectors.signals import noise_series


def fired(d: LogCUSUMDetector, values: list[float]) -> list[int]:
    return [i for i, v in enumerate(values) if d.update(i, v).triggered]


def geometric(n: int, start: int, rate: float, level: float = 2.0) -> list[float]:
    """``level`` until index ``start``, then multiplied by ``rate`` at every index."""
    return [level * rate ** max(0, i - start + 1) for i in range(n)]


def test_a_sustained_fall_fires_once_the_excess_rate_adds_up_to_h_at_any_level():
    # 20% per update: ln(0.8) = -0.223, 0.123 beyond the allowance; > 1.0 after 9 updates.
    for level in (2.0, 2000.0, 0.002):
        d = LogCUSUMDetector(k=0.1, h=1.0)
        steps = fired(d, geometric(30, start=10, rate=0.8, level=level))
        assert steps == list(range(18, 30)), level
        assert d.onset_step == 10 and d.direction == "falling"
        assert math.isclose(d.baseline, level)


def test_a_slow_drift_and_a_one_time_step_are_forgiven():
    slow = geometric(200, start=10, rate=0.92)  # 8% per update: below the 10% allowance
    assert fired(LogCUSUMDetector(k=0.1, h=1.0), slow) == []
    step = [2.0] * 20 + [0.9] * 20  # ln(0.45) = -0.80: 0.70 beyond the allowance, < h
    assert fired(LogCUSUMDetector(k=0.1, h=1.0), step) == []
    # A smaller h takes it while the excess lasts: 0.70 at the step, 0.60 one update later.
    assert fired(LogCUSUMDetector(k=0.1, h=0.5), step) == [20, 21]


def test_a_one_update_dip_fires_once_and_the_next_value_clears_it():
    values = [1.0] * 10 + [0.3] + [1.0] * 10  # ln(1/0.3) - 0.1 = 1.10 > h, then back
    assert fired(LogCUSUMDetector(k=0.1, h=1.0), values) == [10]  # a rule's `for` holds it


def test_noise_alone_never_fires():
    values = noise_series(2000, level=2.0, noise=0.1, seed=3)  # 5% relative noise
    assert fired(LogCUSUMDetector(k=0.1, h=1.0), values) == []


def test_rising_and_both_directions():
    values = [1.0] * 5 + [1.0 * 1.3**i for i in range(1, 10)]  # ln 1.3 = 0.262 per update
    # 0.162 beyond the allowance per update: > 1.0 at the 7th rising update (index 11).
    assert fired(LogCUSUMDetector(k=0.1, h=1.0, direction="rising"), values) == list(range(11, 14))
    assert fired(LogCUSUMDetector(k=0.1, h=1.0, direction="falling"), values) == []
    both = LogCUSUMDetector(k=0.1, h=1.0, direction="both")
    assert fired(both, values) == list(range(11, 14)) and both.direction == "rising"


def test_the_baseline_outlives_the_sum_until_the_series_comes_back():
    d = LogCUSUMDetector(k=0.1, h=1.0)
    collapse = geometric(20, start=5, rate=0.5)  # 2.0 -> 2e-5
    flat = [collapse[-1]] * 100  # stays down: the sum (8.9) decays by k per update
    fired(d, collapse + flat)
    assert not d.triggered and math.isclose(d.baseline, 2.0)  # still "fell from 2.0"
    for i, v in enumerate([v * 0.7 for v in flat[:3]], start=120):  # falls further: same ref
        d.update(i, v)
    assert math.isclose(d.baseline, 2.0)
    for i, v in enumerate([3.0, 3.0, 1.5, 0.75, 0.375], start=130):  # back, then a new fall
        d.update(i, v)
    assert d.triggered and d.onset_step == 132 and math.isclose(d.baseline, 3.0)


def test_zero_and_negative_values_count_as_the_floor():
    d = LogCUSUMDetector(k=0.1, h=1.0, floor=1e-3)
    assert fired(d, [1.0, 1.0, 0.0, -5.0, 0.0]) == [2, 3, 4]
    assert math.isclose(d.statistic, -(math.log(1.0 / 1e-3) - 3 * 0.1))


def test_min_updates_2_lets_a_fall_under_way_fire_as_before_but_not_a_single_dip():
    # The dip above, ln(1/0.3) - 0.1 = 1.10 > h on its one update: with min_updates 2 the
    # excursion is one update old when it crosses h, and the next value clears it.
    dip = [1.0] * 10 + [0.3] + [1.0] * 10
    assert fired(LogCUSUMDetector(k=0.1, h=1.0, min_updates=2), dip) == []
    # A fall already under way (20% per update, crossing h at its 9th update) fires on the
    # same update as with min_updates 1: nothing is lost on a trend.
    fall = geometric(30, start=10, rate=0.8)
    d = LogCUSUMDetector(k=0.1, h=1.0, min_updates=2)
    assert fired(d, fall) == list(range(18, 30)) and d.onset_step == 10
    # An accelerating collapse that jumps over h on its 3rd update (as a biased attention
    # backward's H(Delta_2): -11%, -14%, -43%) fires there too.
    collapse = [1.92, 1.92, 1.72, 1.50, 0.96, 0.29]
    assert fired(LogCUSUMDetector(k=0.06, h=0.4, min_updates=2), collapse) == [4, 5]
    # A step that stays is taken one update later, while its excess lasts (0.80 - 0.2 > 0.5).
    step = [2.0] * 20 + [0.9] * 20
    assert fired(LogCUSUMDetector(k=0.1, h=0.5, min_updates=2), step) == [21]


def test_min_updates_counts_the_excursion_not_the_updates_above_h():
    d = LogCUSUMDetector(k=0.1, h=1.0, min_updates=3)
    # -5%, then -70%: the sum (0.0 after the allowance, then 1.10) crosses h on the excursion's
    # first update (the 5% fall is inside the allowance); -50% next: second update; third: fires
    values = [1.0, 0.95, 0.285, 0.1425, 0.1425]
    assert fired(d, values) == [4]
    assert d.statistic is not None and d.statistic < -1.0


def test_a_state_saved_before_min_updates_loads_as_an_excursion_of_no_updates():
    d = LogCUSUMDetector(k=0.1, h=1.0, min_updates=2)
    for i, v in enumerate([2.0, 1.5, 1.0]):
        d.update(i, v)
    state = d.state_dict()
    assert state["state"]["low_updates"] == 2
    for key in ("high_updates", "low_updates"):
        del state["state"][key]
    del state["params"]["min_updates"]  # the parameter's default then: 1 (not this detector)
    old = LogCUSUMDetector(k=0.1, h=1.0)
    old.load_state_dict(state)
    assert old.state_dict()["state"]["low_updates"] == 0
    assert old.update(3, 0.3).triggered  # 0.69 + 1.10 - 2 x 0.1 beyond the allowance


# ----------------------------------------------------------------- noise_k / noise_h


def scaled(**kw: float) -> LogCUSUMDetector:
    """The shipped QK rule's detector, with k and h raised to the series' noise."""
    return LogCUSUMDetector(k=0.06, h=0.4, min_updates=3, noise_k=0.5, noise_h=3.0, **kw)


def test_noise_scaling_keeps_a_noisy_series_quiet_that_the_fixed_allowance_fires_on():
    # 12% relative noise per value, as the head-mean H(Delta_2) of a small HF model (9-16%
    # per evaluation): the fixed 6% allowance and 0.4 interval fire again and again.
    fixed_hits, scaled_hits, sigmas = 0, 0, []
    for seed in range(6):
        values = noise_series(2000, level=1.0, noise=0.12, seed=seed)
        fixed_hits += len(fired(LogCUSUMDetector(k=0.06, h=0.4, min_updates=3), values))
        d = scaled()
        scaled_hits += len(fired(d, values))
        sigmas.append(d.noise)
    assert fixed_hits >= 8 and scaled_hits <= 1
    # The log-change of a level with N(0, 0.12) noise has sigma ~ 0.12 x sqrt(2) = 0.170.
    assert abs(sum(sigmas) / len(sigmas) - 0.12 * math.sqrt(2)) < 0.017


def test_on_a_quiet_series_noise_scaling_changes_nothing_once_the_noise_is_known():
    # 1% noise (the test bed's H(Delta_2) moves 1-4% per evaluation): 0.5 sigma and 3 sigma
    # stay under the floors k = 0.06 and h = 0.4, so a collapse fires on the same updates.
    quiet = noise_series(40, level=2.0, noise=0.02, seed=1)
    collapse = [quiet[-1] * 0.8**i for i in range(1, 12)]
    values = quiet + collapse
    plain = fired(LogCUSUMDetector(k=0.06, h=0.4, min_updates=3), values)
    d = scaled()
    assert fired(d, values) == plain and plain[0] == 42  # 3 updates of -0.223 + 0.06
    assert d.noise is not None and 0.5 * d.noise < 0.06 and 3.0 * d.noise < 0.4


def test_a_collapse_on_a_noisy_series_still_fires_and_its_changes_are_not_noise():
    values = noise_series(60, level=1.0, noise=0.12, seed=0)
    d = scaled()
    assert fired(d, values) == []
    before = d.noise
    assert before is not None
    # -40% per evaluation (ln 0.6 = -0.51): far beyond 0.5 sigma; fires on the 3rd update.
    collapse = [values[-1] * 0.6**i for i in range(1, 8)]
    hits = [i for i, v in enumerate(collapse, start=60) if d.update(i, v).triggered]
    # (the onset: the noise's last value, already a fall beyond the allowance)
    assert hits[0] == 62 and d.onset_step == 59
    assert d.noise == before  # a departure that fired is not the series' noise


def test_no_trigger_before_the_noise_is_known_and_a_collapse_from_the_start_fires_then():
    # Half the window (8 changes, 9 values) before it can fire. A collapse from the first value
    # on (-50% per value) is taken by the plain detector at its 3rd update; its changes are the
    # first noise here, all equal: sigma 0, so k and h stay at their floors and it fires on the
    # first update after the 8th change.
    collapse = [2.0 * 0.5**i for i in range(12)]
    assert fired(LogCUSUMDetector(k=0.06, h=0.4, min_updates=3), collapse)[0] == 3
    d = scaled()
    assert fired(d, collapse[:9]) == [] and d.noise is not None and d.noise < 1e-12
    assert [i for i, v in enumerate(collapse[9:], start=9) if d.update(i, v).triggered] == [
        9,
        10,
        11,
    ]
    quiet = scaled()
    fired(quiet, [1.0] * 8)  # 7 changes: not yet
    assert not quiet.ready and quiet.noise is None


def test_a_noise_scaled_state_round_trips_and_an_older_state_loads_without_noise():
    values = noise_series(50, level=1.0, noise=0.12, seed=4) + [0.5, 0.3, 0.2, 0.1]
    d = scaled()
    for i, v in enumerate(values[:30]):
        d.update(i, v)
    copy = scaled()
    copy.load_state_dict(d.state_dict())
    rest = list(enumerate(values[30:], start=30))
    assert [d.update(i, v).triggered for i, v in rest] == [
        copy.update(i, v).triggered for i, v in rest
    ]
    assert copy.noise == d.noise and copy.state_dict() == d.state_dict()
    # A state saved before noise scaling existed (no such keys) loads as "no noise known".
    plain = LogCUSUMDetector(k=0.06, h=0.4, min_updates=3)
    for i, v in enumerate(values[:30]):
        plain.update(i, v)
    state = plain.state_dict()
    for key in ("noise", "changes", "pending", "fired"):
        del state["state"][key]
    for key in ("noise_k", "noise_h", "noise_window"):
        del state["params"][key]
    old = LogCUSUMDetector(k=0.06, h=0.4, min_updates=3)
    old.load_state_dict(state)
    assert old.noise is None and old.state_dict() == plain.state_dict()


def fired_at_cadence(d: LogCUSUMDetector, every: int, rate_per_step: float, n_steps: int) -> list:
    """Feed a series that is flat at 2.0 until step 500 and then falls by ``rate_per_step`` (log)
    per step, read every ``every`` steps; the steps at which ``d`` triggers."""
    out = []
    for step in range(0, n_steps, every):
        value = 2.0 * math.exp(-rate_per_step * max(0, step - 500))
        if d.update(step, value).triggered:
            out.append(step)
    return out


def test_per_steps_changes_nothing_at_its_own_cadence():
    for rate in (0.001, 0.004, 0.01, 0.03):
        plain = LogCUSUMDetector(k=0.06, h=0.4, min_updates=2)
        scaled = LogCUSUMDetector(k=0.06, h=0.4, min_updates=2, per_steps=25)
        assert fired_at_cadence(plain, 25, rate, 2000) == fired_at_cadence(scaled, 25, rate, 2000)
        assert plain.sums == scaled.sums and plain.onset_step == scaled.onset_step


def test_per_steps_keeps_the_fall_rate_and_the_span_at_another_cadence():
    # 0.0016 per step: 0.04 per 25 steps, under the 0.06 allowance. Read every 12 steps without
    # per_steps the allowance is 0.06 per 12 steps (0.005 per step): quiet either way.
    slow = 0.0016
    assert fired_at_cadence(LogCUSUMDetector(k=0.06, h=0.4, per_steps=25), 12, slow, 3000) == []
    # 0.0016 per step read every 50 steps: 0.08 per update, beyond a per-update allowance of
    # 0.06 (it fires), within 0.06 per 25 steps (it does not).
    assert fired_at_cadence(LogCUSUMDetector(k=0.06, h=0.4), 50, slow, 3000) != []
    assert fired_at_cadence(LogCUSUMDetector(k=0.06, h=0.4, per_steps=25), 50, slow, 3000) == []
    # A collapse at 0.008 per step (0.2 per 25 steps; excess 0.14 per 25 steps) crosses h = 0.4
    # after about 72 steps of fall at both cadences with per_steps.
    fast = 0.008
    at_25 = fired_at_cadence(LogCUSUMDetector(k=0.06, h=0.4, per_steps=25), 25, fast, 1000)[0]
    at_12 = fired_at_cadence(LogCUSUMDetector(k=0.06, h=0.4, per_steps=25), 12, fast, 1000)[0]
    assert at_25 == 575 and abs(at_12 - at_25) <= 12, (at_25, at_12)
    # Without per_steps the 12-step reading allows 0.06 per 12 steps: 0.096 per 12 steps of
    # fall leave 0.036 of excess per update (0.003 per step against 0.0056), and the alert
    # comes six readings later.
    late = fired_at_cadence(LogCUSUMDetector(k=0.06, h=0.4), 12, fast, 1000)[0]
    assert late == 648


def test_per_steps_rescales_min_updates_but_never_below_two_updates():
    # min_updates 2 per 25 steps: read every 12 steps the excursion must span 4 updates
    # (round(2 x 25 / 12)); read every 100 steps, still 2 updates (not 1: one outlier).
    def first(every: int, min_updates: int, per_steps: int | None) -> int | None:
        d = LogCUSUMDetector(k=0.0, h=0.4, min_updates=min_updates, per_steps=per_steps)
        dropped = [2.0 * 0.5 ** max(0, i - 9) for i in range(30)]  # halves at every update
        hits = [i for i, v in enumerate(dropped) if d.update(i * every, v).triggered]
        return hits[0] if hits else None

    assert first(25, 2, 25) == first(25, 2, None) == 11  # the 2nd update of the excursion
    assert first(12, 2, 25) == 13  # the 4th
    assert first(12, 2, None) == 11
    assert first(100, 2, 25) == 11  # the 2nd, not the 1st
    assert first(100, 1, 25) == 10  # min_updates 1 stays 1


def test_a_state_saved_before_per_steps_loads_and_its_gap_is_known_from_the_next_value():
    d = LogCUSUMDetector(k=0.06, h=0.4, min_updates=2, per_steps=25)
    for step in range(0, 300, 12):
        d.update(step, 2.0)
    assert d.state_dict()["state"]["previous_step"] == 288
    # A version without per_steps saved neither the parameter nor the step of the last value.
    plain = LogCUSUMDetector(k=0.06, h=0.4, min_updates=2)
    for step in range(0, 300, 12):
        plain.update(step, 2.0)
    state = plain.state_dict()
    del state["state"]["previous_step"]
    del state["params"]["per_steps"]
    old = LogCUSUMDetector(k=0.06, h=0.4, min_updates=2)
    old.load_state_dict(state)
    old.update(300, 2.0)
    plain.update(300, 2.0)
    assert old.state_dict() == plain.state_dict()
    # A rule that gained per_steps does not take a state saved without it (the rule engine
    # starts such a rule fresh: its detector changed).
    with pytest.raises(ValueError, match="per_steps"):
        LogCUSUMDetector(k=0.06, h=0.4, min_updates=2, per_steps=25).load_state_dict(state)


def test_with_per_steps_sparser_values_learn_the_noise_in_about_as_many_steps_not_changes():
    # Half the window is 8 changes: 200 steps at 25 steps apart. A layer read every 100 steps
    # (measured in turn) is ready after max(4, ceil(8 x 25 / 100)) = 4 changes, 5 values;
    # every 50 steps after 4 as well; every 12 steps (and without per_steps) after 8.
    def ready_after(every: int, per_steps: int | None) -> int:
        d = LogCUSUMDetector(
            k=0.06, h=0.4, noise_k=0.5, noise_h=3.0, per_steps=per_steps, direction="falling"
        )
        for i, v in enumerate([1.0, 1.02, 0.99, 1.01, 1.0, 0.98, 1.01, 1.0, 0.99, 1.0]):
            d.update(i * every, v)
            if d.ready and d.noise is not None:
                return i
        raise AssertionError("never ready")

    assert ready_after(100, 25) == 4
    assert ready_after(50, 25) == 4
    assert ready_after(25, 25) == ready_after(12, 25) == ready_after(100, None) == 8
    # and a collapse read every 100 steps fires once those 4 changes are known
    d = LogCUSUMDetector(k=0.06, h=0.4, noise_k=0.5, noise_h=3.0, per_steps=25)
    collapse = [2.0 * 0.5**i for i in range(8)]
    assert [i for i, v in enumerate(collapse) if d.update(i * 100, v).triggered][0] == 5
