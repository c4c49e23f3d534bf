"""benchmarks/qk_twin_separation.py: the oracle reads each layer's head-mean H(Delta_2) from an
event log and measures how far the deepest layer lies below the clean twin's, from the fault."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import qk_twin_separation as oracle  # noqa: E402


def _log(path: Path, values: dict[tuple[int, str, str], float]) -> Path:
    """An event log with one metrics record per step: (step, layer, head) -> H(Delta_2)."""
    steps = sorted({step for step, _, _ in values})
    with path.open("w") as f:
        f.write(json.dumps({"kind": "start", "step": -1, "format": 1}) + "\n")
        for step in steps:
            samples = [
                [s, "qk_delta2_entropy", {"layer": layer, "head": head}, v]
                for (s, layer, head), v in values.items()
                if s == step
            ]
            samples.append([step, "qk_delta2_frobenius", {"layer": "L0", "head": "0"}, 9.0])
            f.write(json.dumps({"kind": "metrics", "step": step, "samples": samples}) + "\n")
    return path


def test_head_means_average_the_heads_of_each_layer_and_ignore_other_metrics(
    tmp_path: Path,
) -> None:
    log = _log(
        tmp_path / "events.jsonl",
        {(25, "L0", "0"): 1.0, (25, "L0", "1"): 2.0, (25, "L1", "0"): 3.0, (50, "L0", "0"): 0.5},
    )
    means = oracle.head_means(log)
    assert means == {"L0": {25: 1.5, 50: 0.5}, "L1": {25: 3.0}}


def test_below_twin_takes_the_deepest_layer_from_the_start_on_shared_steps() -> None:
    run = {"L0": {25: 1.0, 50: 0.8, 75: 0.5}, "L1": {25: 2.0, 50: 1.0, 75: 2.1}}
    twin = {"L0": {25: 1.0, 50: 1.0}, "L1": {25: 2.0, 50: 2.0, 75: 2.0}}
    gaps = oracle.below_twin(run, twin, start=50)
    # step 25 is before the start; at 50 L1 lies 1.0 below (L0 0.2); at 75 only L1 is shared
    assert list(gaps) == [50, 75]
    assert gaps[50] == pytest.approx(1.0)
    assert gaps[75] == pytest.approx(-0.1)  # above the twin: a negative gap
