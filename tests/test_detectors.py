"""Each detector on seeded step, ramp, spike and noise-only series: exact firing indices and
onset steps, plus the behaviour specific to each algorithm.

The series are fed one value per evaluation, at training steps 0, 10, 20, ... (EVERY = 10), so
an index i is step 10 i. Ground truth: STEP drops by 10 noise std at index 60 (step 600); RAMP
leaves its level at index 60 (step 600) at -0.5 noise std per update; SPIKE is a single
25-std dip at index 70.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from pydantic import ValidationError
from scipy import stats

from agent.detectors import build_detector
from agent.detectors.base import Detector
from agent.detectors.baseline import BaselineDetector
from agent.detectors.cusum import CUSUMDetector
from agent.detectors.ewma import EWMADetector, EWMAParams
from agent.detectors.page_hinkley import PageHinkleyDetector
from agent.detectors.signals import noise_series, ramp_series, spike_series, step_series
from agent.detectors.slope import (
    SlopeDetector,
    hinge_onset,
    mann_kendall_p,
    mann_kendall_variance,
    theil_sen_slope,
)
from agent.detectors.threshold import ThresholdDetector

EVERY = 10
STEP = step_series(120, at=60, before=1.0, after=0.5, noise=0.05, seed=1)
RAMP = ramp_series(160, start=60, slope=-0.01, level=1.0, noise=0.02, seed=2)
SPIKE = spike_series(120, at=70, height=-0.5, level=1.0, noise=0.02, seed=3)
TRUE_ONSET = 600  # STEP and RAMP


def feed(detector: Detector, values: list[float], every: int = EVERY) -> list[int]:
    """Indices at which the detector is triggered."""
    return [i for i, v in enumerate(values) if detector.update(every * i, v).triggered]


def first_fire(detector: Detector, values: list[float], every: int = EVERY):
    """(index, onset step, direction) at the first triggered update, or None."""
    for i, v in enumerate(values):
        if detector.update(every * i, v).triggered:
            return i, detector.onset_step, detector.direction
    return None


# (type, params) -> expected (first index, onset step) on STEP and RAMP, and the exact
# triggered indices on SPIKE. Defaults everywhere except the threshold's level.
EXPECTED = {
    ("threshold", (("below", 0.8),)): {
        "step": (60, 600),
        "ramp": (80, 800),  # 1 - 0.01 (i - 59) < 0.8 from i = 80: onset = first triggered
        "spike": [70],
    },
    ("baseline", ()): {
        "step": (60, 600),
        "ramp": (67, 640),  # onset: below median - margin/2 (margin 5 robust std = 0.096)
        "spike": [70],
    },
    ("slope", ()): {
        # A level shift inside the 50-update window is a trend until the window has passed it;
        # the hinge puts its onset 8 updates early (documented).
        "step": (75, 520),
        "step_until": 92,
        "ramp": (74, 600),
        "spike": [],
    },
    ("ewma", ()): {
        "step": (60, 600),
        "ramp": (68, 630),  # onset: |z| beyond z/2
        "spike": [70],
    },
    ("cusum", ()): {
        "step": (61, 600),
        "ramp": (66, 610),
        # C- jumps to ~24 (a 25-std dip) and decays by k = 0.75 per update: (24 - 10) / 0.75
        # updates above h, then quiet.
        "spike": list(range(70, 88)),
    },
    ("page_hinkley", ()): {
        "step": (61, 600),
        "ramp": (66, 610),
        "spike": list(range(70, 78)),
    },
}
CASES = [(name, dict(params), exp) for (name, params), exp in EXPECTED.items()]
IDS = [name for name, _, _ in CASES]


@pytest.mark.parametrize(("name", "params", "expected"), CASES, ids=IDS)
def test_step_first_fire_and_onset(name, params, expected):
    got = first_fire(build_detector(name, params), STEP)
    assert got == (*expected["step"], "falling")
    index, onset, _ = got
    assert onset <= EVERY * index  # the onset is never later than the firing step
    if name == "slope":  # a hinge fitted to a step: early, within 10 updates
        assert TRUE_ONSET - 10 * EVERY <= onset < TRUE_ONSET
    else:  # a clean 10-std step: exact onset
        assert onset == TRUE_ONSET


@pytest.mark.parametrize(("name", "params", "expected"), CASES, ids=IDS)
def test_step_stays_triggered_after_firing(name, params, expected):
    fired = feed(build_detector(name, params), STEP)
    assert fired == list(range(expected["step"][0], expected.get("step_until", 120)))


@pytest.mark.parametrize(("name", "params", "expected"), CASES, ids=IDS)
def test_ramp_first_fire_and_onset(name, params, expected):
    got = first_fire(build_detector(name, params), RAMP)
    assert got == (*expected["ramp"], "falling")
    index, onset, _ = got
    assert onset <= EVERY * index
    if name != "threshold":  # the others estimate the start of the ramp, within 5 updates
        assert abs(onset - TRUE_ONSET) <= 5 * EVERY


@pytest.mark.parametrize(("name", "params", "expected"), CASES, ids=IDS)
def test_spike_fires_only_transiently(name, params, expected):
    detector = build_detector(name, params)
    assert feed(detector, SPIKE) == expected["spike"]
    assert not detector.triggered  # back to quiet at the end of the series


@pytest.mark.parametrize(("name", "params", "expected"), CASES, ids=IDS)
def test_noise_only_never_fires(name, params, expected):
    if name == "threshold":
        params = {"below": 0.7, "above": 1.3}  # 6 noise std away
    for seed in range(20):
        values = noise_series(200, level=1.0, noise=0.05, seed=seed)
        assert feed(build_detector(name, params), values) == [], f"seed {seed}"


# ------------------------------------------------------------------------------ threshold
def test_threshold_band_directions_and_runs():
    d = ThresholdDetector(above=2.0, below=-2.0)
    values = [0.0, 3.0, 3.0, -3.0, -3.0, 0.0, 2.0, 2.5]
    out = [(d.update(s, v).triggered, d.onset_step, d.direction) for s, v in enumerate(values)]
    assert out == [
        (False, None, None),
        (True, 1, "rising"),
        (True, 1, "rising"),
        (True, 3, "falling"),  # a jump across the band starts a new run
        (True, 3, "falling"),
        (False, None, None),
        (False, None, None),  # strict: 2.0 is not above 2.0
        (True, 7, "rising"),
    ]
    assert d.statistic == 2.5 and d.baseline is None and d.ready


def test_threshold_nonfinite_values():
    d = ThresholdDetector(above=1.0)
    d.update(0, 5.0)
    d.update(1, math.nan)  # NaN is not above: ends the run
    assert not d.triggered and d.onset_step is None and d.n_nonfinite == 1
    d.update(2, math.inf)  # +inf is above
    assert d.triggered and d.onset_step == 2
    low = ThresholdDetector(below=0.0).update(0, -math.inf)
    assert low.triggered and low.direction == "falling"


def test_threshold_params_errors():
    with pytest.raises(ValidationError, match="above"):
        ThresholdDetector()
    with pytest.raises(ValidationError, match="greater than"):
        ThresholdDetector(above=1.0, below=2.0)
    with pytest.raises(ValidationError):
        ThresholdDetector(above=math.nan)


# ------------------------------------------------------------------------------ baseline
def test_baseline_rel_and_z_both_required_when_both_given():
    warm = [10.0, 10.01, 9.99, 10.0, 10.02]  # median 10, MAD 0.01 -> scale 0.0148
    both = BaselineDetector(warmup=5, rel=0.5, z=4.0)
    z_only = BaselineDetector(warmup=5, z=4.0)
    rel_only = BaselineDetector(warmup=5, rel=0.5)
    for s, v in enumerate(warm):
        for d in (both, z_only, rel_only):
            d.update(s, v)
    assert both.baseline == 10.0
    assert both.scale == pytest.approx(0.014826)
    # 9.0: a 10% drop, z = -67: the z criterion holds, the relative one does not.
    assert [d.update(5, 9.0).triggered for d in (both, z_only, rel_only)] == [False, True, False]
    assert both.statistic == pytest.approx(-1.0 / 0.014826)
    # 4.0: a 60% drop: both hold.
    assert [d.update(6, 4.0).triggered for d in (both, z_only, rel_only)] == [True, True, True]
    assert both.margin() == pytest.approx(5.0)  # the larger of rel |m| = 5 and z s = 0.059


def test_baseline_relative_holds_but_z_does_not_on_a_noisy_warmup():
    d = BaselineDetector(warmup=5, rel=0.2, z=4.0)
    for s, v in enumerate([10.0, 13.0, 7.0, 12.0, 8.0]):  # median 10, MAD 2 -> scale 2.97
        d.update(s, v)
    assert not d.update(5, 7.5).triggered  # a 25% drop is only z = -0.84
    assert d.update(6, -2.0).triggered  # z = -4.05 and 120%


def test_baseline_default_is_robust_z_5_and_null_criteria_rejected():
    assert BaselineDetector().params.z == 5.0
    assert BaselineDetector().params.rel is None
    assert BaselineDetector(rel=0.3).params.z is None
    with pytest.raises(ValidationError, match="`rel`, `z` or both"):
        BaselineDetector(rel=None, z=None)
    with pytest.raises(ValidationError, match="shorter than `warmup`"):
        BaselineDetector(warmup=10, window=5)


def test_baseline_constant_warmup_has_no_division_by_zero():
    d = BaselineDetector(warmup=5, direction="both")
    for s in range(5):
        d.update(s, 2.0)
    assert d.scale == pytest.approx(2e-12)  # the relative floor 1e-12 |median|
    assert not d.update(5, 2.0).triggered and d.statistic == 0.0
    assert d.update(6, 1.999).triggered and d.direction == "falling"
    floored = BaselineDetector(warmup=5, direction="both", min_scale=0.01)
    for s in range(5):
        floored.update(s, 2.0)
    assert not floored.update(5, 1.999).triggered
    assert floored.statistic == pytest.approx(-0.1)
    zeros = BaselineDetector(warmup=3, direction="rise")
    for s in range(3):
        zeros.update(s, 0.0)
    assert zeros.update(3, 1.0).triggered
    assert math.isfinite(zeros.statistic) and zeros.statistic > 1e300


def test_baseline_relative_uses_the_magnitude_of_a_negative_median():
    d = BaselineDetector(warmup=3, rel=0.5, direction="both")
    for s in range(3):
        d.update(s, -2.0)
    assert not d.update(3, -2.9).triggered
    assert d.update(4, -3.1).triggered and d.direction == "falling"  # below -2 - 0.5 * 2
    assert d.update(5, -0.9).triggered and d.direction == "rising"  # above -2 + 1


def test_baseline_onset_is_the_start_of_the_half_margin_run():
    d = BaselineDetector(warmup=4, rel=0.5)  # median 2, margin 1: trigger < 1, half < 1.5
    values = [2.0, 2.0, 2.0, 2.0, 1.6, 1.4, 1.6, 1.45, 1.2, 0.9, 0.8]
    fired = feed(d, values, every=1)
    assert fired == [9, 10]
    assert d.onset_step == 7  # 1.6 at index 6 broke the earlier run that began at 5


def test_baseline_rolling_window_follows_a_slow_drift_but_not_a_departure():
    drift = [1.0 + 0.005 * i + e for i, e in enumerate(noise_series(200, noise=0.01, seed=4))]
    frozen = BaselineDetector(warmup=20, rel=0.2, direction="both")
    rolling = BaselineDetector(warmup=20, rel=0.2, direction="both", window=30)
    assert feed(frozen, drift)[0] == 52  # warm-up median 1.0475; +20% = 1.257 at i = 52
    assert feed(rolling, drift) == []
    # The last 30 values learned: index 199 is held until the next update.
    assert rolling.baseline == float(np.median(drift[169:199]))
    # A persistent step is never absorbed: values that trigger are not learned. The last
    # pre-step value (index 59) is learned at index 60; nothing after it.
    d = BaselineDetector(warmup=20, z=5.0, window=30)
    assert feed(d, STEP[:61]) == [60]
    assert d.baseline == float(np.median(STEP[30:60]))  # the 1.125 outlier was learned too
    assert [d.update(EVERY * i, STEP[i]).triggered for i in range(61, 120)] == [True] * 59
    assert d.baseline == float(np.median(STEP[30:60]))
    with pytest.raises(ValidationError, match="needs `z` >= 3"):
        BaselineDetector(window=60, z=2.0)


def test_baseline_rolling_scale_stays_calibrated_on_long_noise():
    # Only runs beyond half the margin (and triggering values) are kept out, so the MAD of
    # pure noise is not dragged down by its own band.
    for z in (3.0, 5.0):
        d = BaselineDetector(warmup=30, window=50, z=z, direction="both")
        scales = []
        for i, v in enumerate(noise_series(6000, noise=1.0, seed=5)):
            d.update(i, v)
            if i >= 100:
                scales.append(d.scale)
        assert np.mean(scales) == pytest.approx(1.0, abs=0.08)


def test_baseline_reset_forgets_departure_keeps_baseline():
    d = build_detector("baseline", {})
    feed(d, STEP[:70])
    assert d.triggered and d.onset_step == 600
    baseline = d.baseline
    d.reset()
    assert not d.triggered and d.onset_step is None and d.baseline == baseline
    d.update(700, STEP[70])
    assert d.triggered and d.onset_step == 700  # a new departure, counted from now


# ------------------------------------------------------------------------------ slope
def test_mann_kendall_s_is_incremental_and_exact():
    rng = np.random.default_rng(0)
    values = np.round(rng.normal(size=300), 1)  # rounded: many ties
    d = SlopeDetector(window=25, direction="both")
    for i, v in enumerate(values):
        d.update(i, float(v))
        window = values[max(0, i - 24) : i + 1]
        brute = int(sum(np.sign(window[j:] - window[j - 1]).sum() for j in range(1, len(window))))
        assert d.kendall_s == brute
    window = values[-25:]
    tau = stats.kendalltau(np.arange(25), window)
    # tau_b = S / sqrt((n0 - n1) n0): no ties in x, ties in y
    _, counts = np.unique(window, return_counts=True)
    n0 = 25 * 24 / 2
    n2 = float(np.sum(counts * (counts - 1) / 2))
    assert d.kendall_s == pytest.approx(tau.statistic * math.sqrt(n0 * (n0 - n2)))


def test_mann_kendall_variance_and_p_value():
    no_ties = np.arange(10.0)
    assert mann_kendall_variance(no_ties) == pytest.approx(10 * 9 * 25 / 18)
    ties = np.array([1.0, 1.0, 2.0, 3.0, 3.0, 3.0])
    assert mann_kendall_variance(ties) == pytest.approx((6 * 5 * 17 - 2 * 1 * 9 - 3 * 2 * 11) / 18)
    var = 10 * 9 * 25 / 18
    assert mann_kendall_p(-30, var, "falling") == pytest.approx(stats.norm.sf(29 / math.sqrt(var)))
    assert mann_kendall_p(-30, var, "rising") == 0.5
    assert mann_kendall_p(5, 0.0, "rising") == 1.0  # a constant window


def test_theil_sen_matches_scipy_and_uses_steps():
    rng = np.random.default_rng(1)
    steps = np.cumsum(rng.integers(1, 30, size=40)).astype(float)  # irregular evaluations
    values = 3.0 - 0.002 * steps + rng.normal(scale=0.05, size=40)
    expected = stats.theilslopes(values, steps).slope
    assert theil_sen_slope(steps, values) == pytest.approx(expected)
    d = SlopeDetector(window=40)
    for s, v in zip(steps, values, strict=True):
        d.update(int(s), float(v))
    assert d.statistic == pytest.approx(expected) and d.triggered
    assert theil_sen_slope(np.array([5.0, 5.0]), np.array([1.0, 2.0])) == 0.0  # no distinct x


def test_hinge_onset_on_clean_data():
    steps = np.arange(0.0, 200.0, 10.0)  # 20 points
    values = np.where(steps < 120, 1.0, 1.0 - 0.01 * (steps - 110))  # flat to 110, then down
    assert hinge_onset(steps, values) == 120.0
    assert hinge_onset(steps, 2.0 - 0.01 * steps) == 0.0  # a trend older than the window


def test_slope_min_slope_and_min_rel_change():
    # RAMP falls by 0.01 per update = 0.001 per step; a full 50-update window spans 490 steps,
    # so the trend moves the metric by 0.49 over a window.
    assert first_fire(SlopeDetector(min_slope=0.0005), RAMP) == (84, 590, "falling")
    assert first_fire(SlopeDetector(min_slope=0.002), RAMP) is None
    assert first_fire(SlopeDetector(min_rel_change=0.1), RAMP) == (75, 590, "falling")
    # 0.49 / level >= 0.5 once the window's median level is below ~0.9 (and the Theil-Sen
    # slope, dragged down by the flat part, has caught up).
    assert first_fire(SlopeDetector(min_rel_change=0.5), RAMP) == (96, 590, "falling")
    # Relative to a level that must fall to ~0.5: late; the onset is then where that
    # window's hinge falls, not the true start (the size condition decided the firing).
    assert first_fire(SlopeDetector(min_rel_change=1.0), RAMP) == (136, 870, "falling")


def test_slope_directions():
    rising = [2.0 - v for v in RAMP]
    assert first_fire(SlopeDetector(), rising) is None
    assert first_fire(SlopeDetector(direction="rising"), rising) == (74, 600, "rising")
    assert first_fire(SlopeDetector(direction="both"), rising) == (74, 600, "rising")


def test_slope_reset_empties_the_window():
    d = SlopeDetector()
    feed(d, RAMP[:80])
    assert d.triggered and d.onset_step == 600 and d.statistic < 0
    d.reset()
    assert not d.triggered and not d.ready and d.statistic is None and d.kendall_s == 0


# ------------------------------------------------------------------------------ ewma
def test_ewma_alpha_halflife():
    assert EWMAParams().weight == 0.05
    assert EWMAParams(halflife=10).weight == pytest.approx(1 - 0.5**0.1)
    assert EWMAParams(halflife=10).alpha is None
    with pytest.raises(ValidationError, match="exactly one"):
        EWMAParams(alpha=0.1, halflife=3)
    with pytest.raises(ValidationError, match="greater than or equal to 3"):
        EWMAParams(z=2.0)


def test_ewma_std_is_calibrated_on_long_noise():
    # Only runs beyond z/2 are kept out of the statistics, so the std of pure noise stays
    # honest (the EW variance itself is biased by (1 - alpha) 2 / (2 - alpha): 0.987 in std).
    for z in (4.0, 5.0):
        d = EWMADetector(z=z)
        stds = []
        for i, v in enumerate(noise_series(6000, noise=1.0, seed=5)):
            d.update(i, v)
            if i >= 1000:
                stds.append(d.std)
        assert np.mean(stds) == pytest.approx(0.987, abs=0.03)


def test_ewma_does_not_absorb_a_shift():
    d = EWMADetector()
    assert feed(d, STEP[:61]) == [60]
    frozen = d.baseline  # index 59 was learned at index 60; nothing after it
    assert frozen == pytest.approx(1.0, abs=0.03)
    assert [d.update(EVERY * i, STEP[i]).triggered for i in range(61, 120)] == [True] * 59
    assert d.baseline == frozen
    assert d.statistic == pytest.approx((STEP[-1] - d.baseline) / d.std)
    up = EWMADetector(direction="both")
    assert feed(up, [2.0 - v for v in SPIKE]) == [70]
    assert EWMADetector(direction="rising").update(0, 1.0).statistic is None  # warm-up


# ------------------------------------------------------------------------------ cusum
def test_cusum_sums_by_hand():
    d = CUSUMDetector(warmup=5, k=0.5, h=2.0)
    for s, v in enumerate([1.0, 2.0, 3.0, 2.0, 2.0]):  # mean 2, std sqrt(0.5)
        d.update(s, v)
    sd = math.sqrt(0.5)
    assert d.baseline == 2.0 and d.std == pytest.approx(sd)
    d.update(5, 2.0 - 2 * sd)  # u = -2: C- = 1.5
    assert d.sums == pytest.approx((1.5, 0.0)) and not d.triggered
    d.update(6, 2.0 - 1 * sd)  # C- = 1.5 + 1 - 0.5 = 2.0: not above h
    assert d.sums == pytest.approx((2.0, 0.0)) and not d.triggered
    d.update(7, 2.0 - 1 * sd)  # C- = 2.5 > h
    assert d.triggered and d.onset_step == 5 and d.direction == "falling"
    assert d.statistic == pytest.approx(-2.5)
    d.update(8, 2.0 + 10 * sd)  # C- -> 0, C+ = 9.5
    assert d.sums == pytest.approx((0.0, 9.5))
    assert d.triggered and d.onset_step == 8 and d.direction == "rising"


def test_cusum_one_sided_and_reset():
    d = CUSUMDetector(direction="rising")
    assert feed(d, STEP) == []
    d = CUSUMDetector()
    feed(d, STEP[:80])
    baseline = d.baseline
    d.reset()
    assert d.sums == (0.0, 0.0) and not d.triggered and d.baseline == baseline


# ------------------------------------------------------------------------------ page-hinkley
def test_page_hinkley_raw_units_by_hand():
    d = PageHinkleyDetector(warmup=3, delta=0.1, threshold=1.0, standardize=False, alpha=1.0)
    for s in range(3):
        d.update(s, 0.0)
    assert d.sigma == 1.0 and d.baseline == 0.0
    d.update(3, 0.0)  # m+ = -0.1 (min), m- = -0.1 (min)
    d.update(4, 2.0)  # mean 0.4: m+ = -0.1 + 1.6 - 0.1 = 1.4; PH+ = 1.5 > 1
    assert d.triggered and d.direction == "rising" and d.onset_step == 4
    assert d.statistic == pytest.approx(1.5)


def test_page_hinkley_forgetting_and_direction():
    assert feed(PageHinkleyDetector(direction="rising"), STEP) == []
    small = step_series(300, at=60, before=1.0, after=0.9, noise=0.05, seed=6)  # -2 std
    assert first_fire(PageHinkleyDetector(), small) == (72, 580, "falling")
    # With forgetting, PH tends to shift / (1 - alpha) = 2 / 0.5 = 4 std at most: never 10.
    assert first_fire(PageHinkleyDetector(alpha=0.5), small) is None
    d = PageHinkleyDetector()
    feed(d, STEP[:80])
    d.reset()
    assert not d.triggered and d.statistic is None and d.ready
