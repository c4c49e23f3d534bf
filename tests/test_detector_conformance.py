"""One conformance suite over every registered detector, plus the registry and the signals."""

from __future__ import annotations

import doctest
import importlib
import json
import math
import subprocess
import sys
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import Field, ValidationError

import agent.detectors as detectors_pkg
from agent.detectors import (
    DETECTORS,
    Detector,
    DetectorParams,
    build_detector,
    detector_from_state,
    register_detector,
)
from agent.detectors.signals import (
    gaussian_noise,
    noise_series,
    ramp_series,
    spike_series,
    step_series,
)

# Parameters a type cannot do without (everything else is left at its default).
REQUIRED = {
    "threshold": {"below": 0.8},
    "log_cusum": {"k": 0.02, "h": 0.5, "floor": 0.05},
    "ema_rise": {"direction": "falling", "span": 5, "margin": 0.2},
    "drawdown": {"ratio": 1.5, "span": 200},
}
# 120 noise values around 1.0, then a ramp down: every built-in fires in the second part.
SERIES = noise_series(120, level=1.0, noise=0.05, seed=11) + ramp_series(
    80, start=0, slope=-0.02, level=1.0, noise=0.05, seed=12
)
NAMES = sorted(DETECTORS)
BUILT_IN = {
    "baseline",
    "cusum",
    "drawdown",
    "ema_rise",
    "ewma",
    "log_cusum",
    "page_hinkley",
    "slope",
    "threshold",
}
# A valid change of parameters per built-in type.
OTHER_VALID_PARAMS = {
    "baseline": {"warmup": 10},
    "cusum": {"h": 5.0},
    "drawdown": {"ratio": 1.6},
    "ewma": {"z": 4.0},
    "ema_rise": {"margin": 0.3},
    "log_cusum": {"h": 0.7},
    "page_hinkley": {"delta": 0.3},
    "slope": {"window": 30},
    "threshold": {"below": 0.5},
}
MODULES = [
    "base",
    "baseline",
    "cusum",
    "drawdown",
    "ema_rise",
    "ewma",
    "log_cusum",
    "page_hinkley",
    "runs",
    "signals",
    "slope",
    "threshold",
]


def make(name: str, **overrides: Any) -> Detector:
    return build_detector(name, {**REQUIRED.get(name, {}), **overrides})


def outputs(d: Detector) -> tuple:
    return (d.triggered, d.onset_step, d.direction, d.statistic, d.baseline, d.ready)


def run(d: Detector, values: list[float], start: int = 0) -> list[tuple]:
    return [outputs(d.update(10 * (start + i), v)) for i, v in enumerate(values)]


def strict_json(state: Mapping[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(state, allow_nan=False))


def test_registry_holds_the_built_ins():
    assert set(DETECTORS) == BUILT_IN == set(OTHER_VALID_PARAMS)
    for name, cls in DETECTORS.items():
        assert cls.type == name


@pytest.mark.parametrize("name", NAMES)
def test_params_are_documented_and_strict(name):
    cls = DETECTORS[name]
    assert issubclass(cls.Params, DetectorParams)
    for field_name, info in cls.Params.model_fields.items():
        assert info.description, f"{name}.{field_name} has no description"
    with pytest.raises(ValidationError, match="bogus"):
        make(name, bogus=1)
    detector = make(name)
    with pytest.raises(ValidationError):  # frozen
        detector.params.bogus = 1  # type: ignore[attr-defined]
    assert repr(detector).startswith(cls.__name__ + "(")


@pytest.mark.parametrize("name", NAMES)
def test_fires_on_the_ramp_with_a_consistent_verdict(name):
    d = make(name)
    fired = False
    for i, v in enumerate(SERIES):
        assert d.update(10 * i, v) is d
        if d.triggered:
            fired = True
            assert d.ready
            assert d.direction == "falling"
            assert d.onset_step is not None and d.onset_step <= 10 * i
            assert d.onset_step >= 10 * 60  # never before the noise-only stretch's second half
        else:
            assert d.onset_step is None and d.direction is None
    assert fired
    assert d.n_updates == len(SERIES) and d.last_step == 10 * (len(SERIES) - 1)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("split", [5, 100, 150])
def test_state_dict_round_trip_mid_stream(name, split):
    original = make(name)
    run(original, SERIES[:split])
    state = strict_json(original.state_dict())
    restored = make(name)
    restored.load_state_dict(state)
    assert outputs(restored) == outputs(original)
    rebuilt = detector_from_state(state)
    rest = SERIES[split:]
    expected = run(original, rest, start=split)
    assert run(restored, rest, start=split) == expected
    assert run(rebuilt, rest, start=split) == expected
    assert strict_json(restored.state_dict()) == strict_json(original.state_dict())


@pytest.mark.parametrize("name", NAMES)
def test_load_state_refuses_another_type_or_other_params(name):
    state = make(name).state_dict()
    other = next(n for n in NAMES if n != name)
    with pytest.raises(ValueError, match="is for type"):
        make(other).load_state_dict(state)
    changed = {**state, "params": {**state["params"], **OTHER_VALID_PARAMS[name]}}
    with pytest.raises(ValueError, match="saved with params"):
        make(name).load_state_dict(changed)


@pytest.mark.parametrize("name", NAMES)
def test_nonfinite_values_do_not_raise_or_poison(name):
    d = make(name)
    run(d, SERIES[:125])
    clean = make(name)
    clean.load_state_dict(d.state_dict())
    baseline = d.baseline
    for bad in (math.nan, math.inf, -math.inf, math.nan):
        d.update(1250, bad)
        assert d.baseline == baseline
    assert d.n_nonfinite == 4
    if name == "threshold":  # compares raw values: NaN is not below; -inf is
        d.update(1251, math.nan)
        assert not d.triggered
        assert d.update(1252, -math.inf).triggered
    else:  # a gap: everything but the counters is as if the values never came
        before, after = clean.state_dict(), d.state_dict()
        for key in ("n_updates", "n_nonfinite", "last_step"):
            before.pop(key), after.pop(key)
        assert after == before
        rest = SERIES[125:]
        assert run(d, rest, start=125) == run(clean, rest, start=125)


@pytest.mark.parametrize("name", NAMES)
def test_nonfinite_values_do_not_count_toward_the_warmup(name):
    d = make(name)
    for i in range(100):
        d.update(i, math.nan)
    assert d.baseline is None and not d.triggered
    if name == "threshold":  # no warm-up; its statistic is the raw latest value
        assert d.ready and math.isnan(d.statistic)
    else:
        assert not d.ready and d.statistic is None


@pytest.mark.parametrize("name", NAMES)
def test_reset_forgets_the_departure_and_keeps_the_baseline(name):
    d = make(name)
    run(d, SERIES[:170])
    assert d.triggered
    baseline = d.baseline
    d.reset()
    assert not d.triggered and d.onset_step is None and d.direction is None
    assert d.baseline == baseline
    d.update(1700, SERIES[170])  # keeps working
    state = strict_json(d.state_dict())
    assert state["type"] == name


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=25, deadline=None)
@given(values=st.lists(st.floats(allow_nan=True, allow_infinity=True), max_size=60))
def test_any_floats_never_raise_and_state_stays_strict_json(name, values):
    # Small windows and warm-ups so that short lists get past them; magnitudes up to 1.8e308
    # may overflow the statistics (documented), but must never raise or break the state.
    small = {"threshold": {}, "slope": {"window": 6}, "log_cusum": {}, "drawdown": {}}.get(
        name, {"warmup": 3}
    )
    d = make(name, **small)
    half = len(values) // 2
    for i, v in enumerate(values[:half]):
        d.update(i, v)
    state = strict_json(d.state_dict())
    restored = detector_from_state(state)
    for i, v in enumerate(values[half:], start=half):
        d.update(i, v)
        restored.update(i, v)
    assert strict_json(restored.state_dict()) == strict_json(d.state_dict())


@pytest.mark.parametrize("name", NAMES)
def test_huge_values_overflow_silently(name):
    # Values near the float64 limit may overflow a detector's statistics (documented); that
    # must not raise, not even when the training script turns warnings into errors.
    small = {
        "threshold": {},
        "slope": {"window": 6, "min_rel_change": 0.1},
        "log_cusum": {},
        "drawdown": {},
    }.get(name, {"warmup": 3})
    d = make(name, **small)
    values = [1.0, 2.0, 1.5, 1e308, -1e308, 1.7e308, -1.7e308, 1.0, math.nan] * 3
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for i, v in enumerate(values):
            d.update(i, v)
            _ = d.statistic
    strict_json(d.state_dict())


@pytest.mark.parametrize("name", NAMES)
def test_accepts_ints_and_numpy_scalars(name):
    a, b = make(name), make(name)
    for i, v in enumerate(SERIES[:150]):
        a.update(i, v)
        b.update(np.int64(i), np.float64(v))
    assert outputs(a) == outputs(b)


@pytest.mark.parametrize("module", MODULES)
def test_docstring_examples_run(module):
    mod = importlib.import_module(f"agent.detectors.{module}")
    result = doctest.testmod(mod)
    assert result.failed == 0
    if module != "base":
        assert result.attempted > 0, f"{module} has no runnable example"


def test_package_docstring_example_runs():
    result = doctest.testmod(detectors_pkg)
    assert result.failed == 0 and result.attempted > 0


def test_detectors_import_no_torch():
    code = "import sys, agent.detectors, agent.detectors.signals; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ------------------------------------------------------------------------------ registry
class _LastAboveFirst(Detector):
    """A user's detector: the value is above the first value seen."""

    type = "last_above_first"

    class Params(DetectorParams):
        margin: float = Field(0.0, description="How far above.")

    def _reset_state(self) -> None:
        self._first: float | None = None

    def _update_finite(self, step: int, value: float) -> None:
        if self._first is None:
            self._first = value
            return
        above = value > self._first + self.params.margin  # type: ignore[attr-defined]
        self._set_verdict("rising" if above else None, step)

    def _get_state(self) -> dict[str, Any]:
        return {"first": self._first}

    def _set_state(self, state: Mapping[str, Any]) -> None:
        self._first = state["first"]


def test_build_detector_errors():
    with pytest.raises(ValueError, match="unknown detector type 'nope'; valid types: baseline"):
        build_detector("nope", {})
    with pytest.raises(ValidationError) as info:
        build_detector("baseline", {"warmup": "many"})
    assert info.value.errors()[0]["loc"] == ("warmup",)
    with pytest.raises(ValidationError):
        build_detector("cusum", {"h": -1.0})
    with pytest.raises(ValueError, match="must be a mapping"):
        build_detector("cusum", [1, 2])  # type: ignore[arg-type]
    assert isinstance(build_detector("ewma", None), DETECTORS["ewma"])


def test_register_a_users_detector(monkeypatch):
    monkeypatch.setattr(detectors_pkg, "DETECTORS", dict(DETECTORS))
    registry = detectors_pkg.DETECTORS
    assert detectors_pkg.register_detector(_LastAboveFirst) is _LastAboveFirst
    assert registry["last_above_first"] is _LastAboveFirst
    d = detectors_pkg.build_detector("last_above_first", {"margin": 1.0})
    assert [d.update(s, v).triggered for s, v in enumerate([1.0, 1.5, 2.5])] == [
        False,
        False,
        True,
    ]
    assert detectors_pkg.detector_from_state(d.state_dict()).triggered
    detectors_pkg.register_detector(_LastAboveFirst)  # the same class again: a no-op

    class Impostor(_LastAboveFirst):
        pass

    with pytest.raises(ValueError, match="already registered"):
        detectors_pkg.register_detector(Impostor)
    detectors_pkg.register_detector(Impostor, replace=True)
    assert registry["last_above_first"] is Impostor
    assert "last_above_first" not in DETECTORS  # the real registry is untouched


def test_register_rejects_non_detectors():
    with pytest.raises(ValueError, match="Detector subclass"):
        register_detector(dict)  # type: ignore[arg-type]

    class NoType(Detector):
        def _reset_state(self) -> None: ...
        def _update_finite(self, step: int, value: float) -> None: ...
        def _get_state(self) -> dict[str, Any]:
            return {}

        def _set_state(self, state: Mapping[str, Any]) -> None: ...

    with pytest.raises(ValueError, match="`type`"):
        register_detector(NoType)


def test_constructor_arguments():
    cls = DETECTORS["cusum"]
    assert cls(cls.Params(h=3.0)).params.h == 3.0
    assert cls({"h": 3.0}).params.h == 3.0
    assert cls(h=3.0).params.h == 3.0
    with pytest.raises(ValueError, match="not both"):
        cls(cls.Params(), h=3.0)
    with pytest.raises(ValueError, match="CUSUMParams or a mapping"):
        cls(DETECTORS["ewma"].Params())


# ------------------------------------------------------------------------------ signals
def test_signals_are_deterministic_and_shaped():
    assert noise_series(50, seed=3) == noise_series(50, seed=3)
    assert noise_series(50, seed=3) != noise_series(50, seed=4)
    noise = np.array(gaussian_noise(20000, noise=2.0, seed=0))
    assert noise.mean() == pytest.approx(0.0, abs=0.05)
    assert noise.std() == pytest.approx(2.0, rel=0.02)
    assert step_series(5, at=2, before=1.0, after=3.0, noise=0.0) == [1.0, 1.0, 3.0, 3.0, 3.0]
    assert ramp_series(5, start=2, slope=0.5, level=1.0, noise=0.0) == [1.0, 1.0, 1.5, 2.0, 2.5]
    spike = spike_series(6, at=2, height=4.0, level=1.0, noise=0.0, width=2)
    assert spike == [1.0, 1.0, 5.0, 5.0, 1.0, 1.0]
    with_noise = step_series(5, at=2, before=1.0, after=3.0, noise=0.1, seed=9)
    offsets = [v - b for v, b in zip(with_noise, [1.0, 1.0, 3.0, 3.0, 3.0], strict=True)]
    assert offsets == pytest.approx(gaussian_noise(5, 0.1, seed=9))


def test_signals_reject_bad_arguments():
    with pytest.raises(ValueError, match="at must be in"):
        step_series(10, at=11)
    with pytest.raises(ValueError, match="noise"):
        noise_series(10, noise=-1.0)
    with pytest.raises(ValueError, match="width"):
        spike_series(10, at=2, height=1.0, width=0)
    with pytest.raises(ValueError, match="at must be in"):
        spike_series(10, at=9, height=1.0, width=2)
