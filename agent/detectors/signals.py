"""Deterministic synthetic series for tests, docs and benchmarks of the detectors.

Each generator returns a list of ``n`` floats: a shape (flat, step, ramp, spike) plus
Gaussian noise of standard deviation ``noise`` from a seeded generator. The noise is
Box-Muller on ``random.Random(seed).random()``, whose sequence Python guarantees across
versions, so the exact indices that tests assert do not depend on the numpy version.

>>> from agent.detectors.signals import step_series
>>> step_series(6, at=3, before=1.0, after=0.0, noise=0.0)
[1.0, 1.0, 1.0, 0.0, 0.0, 0.0]
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable


def gaussian_noise(n: int, noise: float = 1.0, seed: int = 0) -> list[float]:
    """``n`` independent N(0, noise^2) draws."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if noise < 0 or not math.isfinite(noise):
        raise ValueError(f"noise must be a finite standard deviation >= 0, got {noise}")
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        u1, u2 = rng.random(), rng.random()  # u1 in [0, 1): 1 - u1 in (0, 1], log is finite
        out.append(noise * math.sqrt(-2.0 * math.log(1.0 - u1)) * math.cos(2.0 * math.pi * u2))
    return out


def _check_index(name: str, index: int, n: int) -> None:
    if not 0 <= index <= n:
        raise ValueError(f"{name} must be in [0, n={n}], got {index}")


def _plus_noise(n: int, shape: Callable[[int], float], noise: float, seed: int) -> list[float]:
    """``shape(i) + gaussian_noise(n, noise, seed)[i]`` for i in range(n)."""
    return [shape(i) + e for i, e in enumerate(gaussian_noise(n, noise, seed))]


def noise_series(n: int, level: float = 0.0, noise: float = 1.0, seed: int = 0) -> list[float]:
    """A flat ``level`` plus noise."""
    return _plus_noise(n, lambda i: level, noise, seed)


def step_series(
    n: int, at: int, before: float = 1.0, after: float = 0.5, noise: float = 0.01, seed: int = 0
) -> list[float]:
    """``before`` for indices < ``at``, ``after`` from index ``at`` on, plus noise."""
    _check_index("at", at, n)
    return _plus_noise(n, lambda i: before if i < at else after, noise, seed)


def ramp_series(
    n: int, start: int, slope: float, level: float = 1.0, noise: float = 0.01, seed: int = 0
) -> list[float]:
    """``level`` before index ``start``, then ``level + slope * (i - start + 1)``: index
    ``start`` is the first departed value. Plus noise. ``slope`` is per index."""
    _check_index("start", start, n)
    return _plus_noise(n, lambda i: level + slope * max(0, i - start + 1), noise, seed)


def spike_series(
    n: int,
    at: int,
    height: float,
    level: float = 1.0,
    noise: float = 0.01,
    seed: int = 0,
    width: int = 1,
) -> list[float]:
    """``level`` plus noise, and ``height`` added at indices ``at`` .. ``at + width - 1``."""
    if width < 1:
        raise ValueError(f"width must be >= 1, got {width}")
    _check_index("at", at, n - width)
    return _plus_noise(n, lambda i: level + (height if at <= i < at + width else 0.0), noise, seed)
