"""Emulated low-precision rounding: fp32 values rounded to fewer mantissa bits.

The rounding works on the integer view of the fp32 bits, so it is exact and deterministic on
any device: fp32 has 23 explicit mantissa bits; keeping ``bits`` of them clears the low
``23 - bits`` and, depending on the mode, carries one unit of the kept last place into the
magnitude. A carry out of the mantissa increments the exponent, which is exactly the next
representable value (the fp32 exponent range is kept: this emulates a narrow mantissa, not a
narrow exponent). Zero, inf and NaN pass through unchanged.

Modes (the direction is on the real line, as in IEEE 754):

- ``"rne"``: round to nearest, ties to even. Unbiased: the error has mean ~0.
- ``"floor"``: towards -inf. Biased: every error is <= 0.
- ``"ceil"``: towards +inf. Biased: every error is >= 0.
- ``"trunc"``: towards zero. Biased towards smaller magnitudes (error sign = -sign(x)).
- ``"away"``: away from zero. Biased towards larger magnitudes (error sign = sign(x)).
"""

from __future__ import annotations

from typing import Literal, get_args

import torch
from torch import Tensor

RoundingMode = Literal["rne", "floor", "ceil", "trunc", "away"]
ROUNDING_MODES: tuple[str, ...] = get_args(RoundingMode)
UNBIASED_MODES: frozenset[str] = frozenset({"rne"})

FP32_MANTISSA_BITS = 23
_MAGNITUDE_MASK = 0x7FFFFFFF
_SIGN_BIT = -(2**31)  # 0x80000000 as a signed int32


def round_mantissa(x: Tensor, bits: int, mode: RoundingMode) -> Tensor:
    """Round fp32 ``x`` to ``bits`` explicit mantissa bits (0..23) with rounding ``mode``.

    Returns a new fp32 tensor of the same shape. ``bits = 23`` is the identity.
    """
    if x.dtype != torch.float32:
        raise ValueError(f"round_mantissa: expected a float32 tensor, got {x.dtype}")
    if not isinstance(bits, int) or not 0 <= bits <= FP32_MANTISSA_BITS:
        raise ValueError(f"round_mantissa: bits must be an int in 0..23, got {bits!r}")
    if mode not in ROUNDING_MODES:
        raise ValueError(f"round_mantissa: mode must be one of {ROUNDING_MODES}, got {mode!r}")
    drop = FP32_MANTISSA_BITS - bits
    if drop == 0:
        return x.clone()

    raw = x.contiguous().view(torch.int32)
    negative = raw < 0
    magnitude = raw & _MAGNITUDE_MASK  # int32, >= 0
    low_mask = (1 << drop) - 1
    low = magnitude & low_mask  # the bits that are dropped
    kept = magnitude & ~low_mask  # magnitude rounded towards zero
    ulp = 1 << drop  # one unit in the last kept place

    if mode == "trunc":
        round_up = torch.zeros_like(negative)
    elif mode == "away":
        round_up = low != 0
    elif mode == "floor":  # towards -inf: up in magnitude for negative values only
        round_up = (low != 0) & negative
    elif mode == "ceil":  # towards +inf: up in magnitude for positive values only
        round_up = (low != 0) & ~negative
    else:  # "rne"
        half = 1 << (drop - 1)
        kept_is_odd = (kept & ulp) != 0
        round_up = (low > half) | ((low == half) & kept_is_odd)

    rounded = kept + round_up.to(torch.int32) * ulp  # carries into the exponent if needed
    rounded = torch.where(negative, rounded | _SIGN_BIT, rounded)
    out = rounded.view(torch.float32)
    # inf has zero low bits and stays inf; NaN payloads must not be rounded into an inf.
    return torch.where(torch.isnan(x), x, out)
