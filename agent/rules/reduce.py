"""Reduction of several series' values at one step to one number (``reduce:`` in a rule).

NaN in, NaN out: a NaN among the values makes every op return NaN, so a broken head is not
hidden by a mean or a max. Quantiles interpolate linearly between order statistics (numpy's
default): ``quantile([1, 2, 3, 4], 0.25) == 1.75``.

>>> reduce_values("median", [3.0, 1.0, 2.0])
2.0
>>> reduce_values("quantile", [1.0, 2.0, 3.0, 4.0], q=0.25)
1.75
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def quantile(values: Sequence[float], q: float) -> float:
    """Linear-interpolation quantile of a non-empty sequence without NaN, q in [0, 1]."""
    assert values and 0.0 <= q <= 1.0
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    lower = math.floor(position)
    upper = min(lower + 1, len(ordered) - 1)
    fraction = position - lower
    if fraction == 0.0:
        return ordered[lower]  # also keeps inf exact (inf - inf would be NaN)
    return ordered[lower] + (ordered[upper] - ordered[lower]) * fraction


def reduce_values(op: str, values: Sequence[float], q: float | None = None) -> float:
    """Reduce ``values`` (non-empty) with ``op``: min, mean, max, median, sum or quantile."""
    assert values, "reduce_values needs at least one value"
    if any(v != v for v in values):
        return math.nan
    if op == "min":
        return min(values)
    if op == "max":
        return max(values)
    if op == "mean":
        return math.fsum(values) / len(values)
    if op == "sum":
        return math.fsum(values)
    if op == "median":
        return quantile(values, 0.5)
    if op == "quantile":
        assert q is not None, "quantile needs q (the schema guarantees it)"
        return quantile(values, q)
    raise AssertionError(f"unknown reduce op {op!r} (the schema allows only known ops)")
