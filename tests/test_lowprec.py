from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.testbed.lowprec import ROUNDING_MODES, round_mantissa


def _r(values: list[float], bits: int, mode: str) -> list[float]:
    return round_mantissa(torch.tensor(values, dtype=torch.float32), bits, mode).tolist()


# 1.3 = 1.0100110..b, -1.3, 1.75 = 1.11b (a tie at 1 bit), 2.5 = 1.01b * 2 (a tie at 1 bit)
HAND_PICKED = [1.0, 1.3, -1.3, 1.75, -1.75, 2.5, 1.5]
EXPECTED_1_BIT = {
    "rne": [1.0, 1.5, -1.5, 2.0, -2.0, 2.0, 1.5],  # ties to the even mantissa
    "floor": [1.0, 1.0, -1.5, 1.5, -2.0, 2.0, 1.5],
    "ceil": [1.0, 1.5, -1.0, 2.0, -1.5, 3.0, 1.5],
    "trunc": [1.0, 1.0, -1.0, 1.5, -1.5, 2.0, 1.5],
    "away": [1.0, 1.5, -1.5, 2.0, -2.0, 3.0, 1.5],
}


@pytest.mark.parametrize("mode", ROUNDING_MODES)
def test_hand_picked_values_at_one_bit(mode: str) -> None:
    assert _r(HAND_PICKED, 1, mode) == EXPECTED_1_BIT[mode]


def test_three_bits_and_carry_into_exponent() -> None:
    # 1.3 at 3 bits: the grid is 1, 1.125, 1.25, 1.375, ...
    assert _r([1.3], 3, "floor") == [1.25]
    assert _r([1.3], 3, "ceil") == [1.375]
    assert _r([1.3], 3, "rne") == [1.25]  # 1.3 is closer to 1.25 than to 1.375
    # 1.96875 = 1.11111b: rounding up at 3 bits carries into the exponent -> 2.0
    assert _r([1.96875], 3, "away") == [2.0]
    assert _r([-1.96875], 3, "floor") == [-2.0]
    # The largest finite float rounded up in magnitude overflows to inf, as IEEE would.
    big = torch.finfo(torch.float32).max
    assert _r([big], 1, "ceil") == [math.inf]
    assert _r([big], 1, "floor")[0] < big


def test_special_values_pass_through() -> None:
    x = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan])
    for mode in ROUNDING_MODES:
        y = round_mantissa(x, 2, mode)
        assert y[0].item() == 0.0 and not torch.signbit(y[0])
        assert y[1].item() == 0.0 and torch.signbit(y[1])
        assert y[2].item() == math.inf and y[3].item() == -math.inf
        assert math.isnan(y[4].item())


def test_23_bits_is_identity_and_input_untouched() -> None:
    x = torch.randn(100)
    before = x.clone()
    assert torch.equal(round_mantissa(x, 23, "floor"), x)
    round_mantissa(x, 3, "floor")
    assert torch.equal(x, before)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"x": torch.ones(2, dtype=torch.float64), "bits": 3, "mode": "rne"}, "float32"),
        ({"x": torch.ones(2), "bits": 24, "mode": "rne"}, "bits"),
        ({"x": torch.ones(2), "bits": -1, "mode": "rne"}, "bits"),
        ({"x": torch.ones(2), "bits": 3, "mode": "nearest"}, "mode"),
    ],
)
def test_bad_arguments(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        round_mantissa(**kwargs)


def _bits_of(v: float) -> int:
    return torch.tensor([v], dtype=torch.float32).view(torch.int32).item() & 0x7FFFFFFF


def _float_of_magnitude(magnitude: int, negative: bool) -> float:
    v = torch.tensor([magnitude], dtype=torch.int32).view(torch.float32).item()
    return -v if negative else v


finite_f32 = st.floats(allow_nan=False, allow_infinity=False, width=32)


@settings(max_examples=200, deadline=None)
@given(x=finite_f32, bits=st.integers(0, 22), mode=st.sampled_from(ROUNDING_MODES))
def test_result_is_representable_and_on_the_right_side(x: float, bits: int, mode: str) -> None:
    r = _r([x], bits, mode)[0]
    drop = 23 - bits
    ulp = 1 << drop
    if math.isinf(r):  # only reachable by rounding the top binade up in magnitude
        assert mode != "trunc" and abs(x) > 2.0**127
        return
    assert _bits_of(r) % ulp == 0, "the dropped mantissa bits must be zero"
    # r is a neighbour of x on the grid: stepping one grid unit from r past x overshoots.
    if r != x:
        toward_x = _bits_of(r) + ulp if abs(x) > abs(r) else _bits_of(r) - ulp
        neighbour = _float_of_magnitude(toward_x, negative=(x < 0 or r < 0))
        assert min(r, neighbour) <= x <= max(r, neighbour)
    if mode == "floor":
        assert r <= x
    elif mode == "ceil":
        assert r >= x
    elif mode == "trunc":
        assert abs(r) <= abs(x) and (r == 0 or (r > 0) == (x > 0))
    elif mode == "away":
        assert abs(r) >= abs(x) and (x == 0 or (r > 0) == (x > 0))
    else:  # rne: never farther from x than half a grid unit of r's binade
        if r != x:
            spacing = abs(_float_of_magnitude(_bits_of(r) + ulp, False) - abs(r))
            spacing_below = abs(abs(r) - _float_of_magnitude(max(_bits_of(r) - ulp, 0), False))
            assert abs(r - x) <= max(spacing, spacing_below) / 2


def test_mean_error_sign_biased_vs_unbiased() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200_000, generator=g)
    rel_err = {
        m: ((round_mantissa(x, 5, m) - x) / x.abs().clamp_min(1e-30)) for m in ROUNDING_MODES
    }
    # floor/ceil: every error has one sign; mean relative error ~ 2^-6 in size
    assert (rel_err["floor"] <= 0).all() and rel_err["floor"].mean() < -0.005
    assert (rel_err["ceil"] >= 0).all() and rel_err["ceil"].mean() > 0.005
    # trunc shrinks, away grows magnitudes
    assert ((round_mantissa(x, 5, "trunc").abs() - x.abs()) <= 0).all()
    assert ((round_mantissa(x, 5, "away").abs() - x.abs()) >= 0).all()
    # rne is unbiased: its mean error is two orders of magnitude below floor's
    assert abs(rel_err["rne"].mean()) < abs(rel_err["floor"].mean()) / 100
    # and the error of a sum: biased rounding accumulates, unbiased does not
    sum_err = {m: float((round_mantissa(x, 5, m) - x).sum()) for m in ("rne", "floor")}
    assert abs(sum_err["rne"]) * 20 < abs(sum_err["floor"])
