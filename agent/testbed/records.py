"""Reading a run's metrics.jsonl back: records and per-module monitor series."""

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
    """{module name: (steps, values)} of ``metric``; per-head lists reduced by mean/min/max."""
    reducers = {"mean": lambda v: sum(v) / len(v), "min": min, "max": max}
    if reduce not in reducers:
        raise ValueError(f"reduce must be one of {sorted(reducers)}, got {reduce!r}")
    out: dict[str, tuple[list[int], list[float]]] = {}
    for rec in records:
        for module, value in rec.get("monitors", {}).get(metric, {}).items():
            steps, values = out.setdefault(module, ([], []))
            steps.append(rec["step"])
            values.append(reducers[reduce](value) if isinstance(value, list) else value)
    return out
