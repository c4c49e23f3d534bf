"""Reading a test-bed run's metrics.jsonl back: records and per-module monitor series."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl file; a bad line raises ValueError naming it."""
    records = []
    with Path(path).open() as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not a JSON record: {e.msg}") from e
    return records


def monitor_series(
    records: list[dict[str, Any]], metric: str, *, reduce: str = "mean"
) -> dict[str, tuple[list[int], list[float]]]:
    """{module name: (steps, values)} of ``metric`` from the records' ``samples``: the module is
    the sample's ``layer`` or ``router`` label; per-head values are reduced by mean/min/max."""
    reducers = {"mean": lambda v: sum(v) / len(v), "min": min, "max": max}
    if reduce not in reducers:
        raise ValueError(f"reduce must be one of {sorted(reducers)}, got {reduce!r}")
    grouped: dict[str, dict[int, list[float]]] = {}
    for rec in records:
        for step, name, labels, value in rec.get("samples", []):
            if name != metric:
                continue
            module = labels.get("layer", labels.get("router", ""))
            grouped.setdefault(module, {}).setdefault(step, []).append(value)
    out: dict[str, tuple[list[int], list[float]]] = {}
    for module, by_step in grouped.items():
        steps = sorted(by_step)
        out[module] = (steps, [reducers[reduce](by_step[s]) for s in steps])
    return out
