"""Clean bands: where a monitor sits in healthy runs, and when a faulty run leaves it.

A monitor's clean band at step t is [min, max] of its value over the clean runs at t, widened
by ``rel_margin`` of the value (and ``abs_margin``). A run *departs* the band at the first
cadence step that starts ``consecutive`` samples in a row outside it (on the chosen side).
This is how the docs and tests compare a faulty run with clean runs of other seeds; it is an
offline yardstick, not the agent's detector (the agent has no clean runs to compare with).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from agent.testbed.metrics_file import monitor_series

Series = tuple[Sequence[int], Sequence[float]]  # (steps, values)
Side = Literal["below", "above", "either"]


@dataclass(frozen=True)
class Band:
    """Per-step bounds: ``bounds[step] = (low, high)``."""

    bounds: dict[int, tuple[float, float]]

    def contains(self, step: int, value: float, side: Side = "either") -> bool | None:
        """Whether ``value`` is inside the band at ``step`` (None: no band at that step)."""
        if step not in self.bounds:
            return None
        low, high = self.bounds[step]
        below, above = value < low, value > high
        if side == "below":
            return not below
        if side == "above":
            return not above
        return not (below or above)


def clean_band(
    runs: Sequence[Series], *, rel_margin: float = 0.15, abs_margin: float = 0.0
) -> Band:
    """Band of the clean ``runs`` at every step that all of them have."""
    if not runs:
        raise ValueError("clean_band: need at least one clean run")
    if rel_margin < 0 or abs_margin < 0:
        raise ValueError("clean_band: margins must be >= 0")
    per_run = [dict(zip(steps, values, strict=True)) for steps, values in runs]
    common = set(per_run[0]).intersection(*per_run[1:])
    bounds = {}
    for step in sorted(common):
        values = [run[step] for run in per_run]
        low, high = min(values), max(values)
        bounds[step] = (
            low - rel_margin * abs(low) - abs_margin,
            high + rel_margin * abs(high) + abs_margin,
        )
    return Band(bounds)


def departure_step(
    series: Series,
    band: Band,
    *,
    side: Side = "below",
    consecutive: int = 2,
    min_step: int = 0,
) -> int | None:
    """First step that starts ``consecutive`` in-band-checkable samples outside ``band``."""
    if consecutive < 1:
        raise ValueError(f"departure_step: consecutive must be >= 1, got {consecutive}")
    start: int | None = None
    count = 0
    for step, value in zip(*series, strict=True):
        inside = band.contains(step, value, side)
        if inside is None or step < min_step:
            continue
        if inside:
            start, count = None, 0
            continue
        if start is None:
            start = step
        count += 1
        if count >= consecutive:
            return start
    return None


def earliest_departure(
    records: list[dict[str, Any]],
    clean_records: Sequence[list[dict[str, Any]]],
    metric: str,
    *,
    reduce: str = "mean",
    side: Side = "below",
    rel_margin: float = 0.15,
    abs_margin: float = 0.0,
    consecutive: int = 2,
    min_step: int = 0,
) -> tuple[int, str] | None:
    """(step, module) of the earliest departure of ``metric`` from its clean band, any module."""
    clean = [monitor_series(recs, metric, reduce=reduce) for recs in clean_records]
    best: tuple[int, str] | None = None
    for module, series in monitor_series(records, metric, reduce=reduce).items():
        if not all(module in c for c in clean):
            raise ValueError(f"earliest_departure: clean runs lack {metric} for {module}")
        band = clean_band([c[module] for c in clean], rel_margin=rel_margin, abs_margin=abs_margin)
        step = departure_step(series, band, side=side, consecutive=consecutive, min_step=min_step)
        if step is not None and (best is None or step < best[0]):
            best = (step, module)
    return best
