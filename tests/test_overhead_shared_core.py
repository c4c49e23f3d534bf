"""benchmarks/overhead_shared_core.py: the bare and the agent run at once, pinned to their own
cores (swapped every round), and the table's ratios are those of the rounds."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import overhead_shared_core as shared_core  # noqa: E402


def _row(i: int, bare: float, agent: float, bare_train: float, agent_train: float) -> dict:
    return {
        "round": i,
        "bare_core": i % 2,
        "agent_core": 1 - i % 2,
        "bare_wall_s": bare,
        "agent_wall_s": agent,
        "bare_train_step_s": bare_train,
        "agent_train_step_s": agent_train,
        "agent_step_s": 0.5,
        "monitor_cpu_s": 2.0,
    }


def test_the_table_gives_every_round_and_the_median_ratios() -> None:
    rows = [_row(0, 100.0, 103.0, 90.0, 91.8), _row(1, 100.0, 101.0, 90.0, 90.9)]
    rows.append(_row(2, 50.0, 51.0, 40.0, 40.0))
    text = "\n".join(shared_core.table(rows, 1000, "agent"))
    assert "| 0 | 100.00 (0) | 103.00 (1) | +3.00% | +2.00% | 0.500 ms | 2.000 ms |" in text
    assert "| 1 | 100.00 (1) | 101.00 (0) | +1.00% | +1.00% |" in text
    # whole run: +3%, +1%, +2% -> median +2%; training steps: +2%, +1%, 0% -> +1%
    assert "whole run +2.00% [+1.00%..+3.00%], training steps +1.00% [+0.00%..+2.00%]" in text
    # the agent on core 1 in rounds 0 and 2 (+3%, +2%: median 2.5%), on core 0 in round 1 (+1%)
    assert "core 0: +1.00%; core 1: +3.00%, +2.00%." in text and "medians (a" in text
    assert text.endswith("cancels): +1.75%.")


def test_the_training_process_cpu_ratio_is_given_per_round_and_by_core() -> None:
    rows = [_row(0, 100.0, 103.0, 90.0, 91.8), _row(1, 100.0, 101.0, 90.0, 90.9)]
    rows.append(_row(2, 50.0, 51.0, 40.0, 40.0))
    for r, (bare, agent) in zip(rows, [(80.0, 80.4), (80.0, 80.8), (40.0, 40.0)], strict=True):
        r["bare_process_cpu_s"], r["agent_process_cpu_s"] = bare, agent
    text = "\n".join(shared_core.table(rows, 1000, "agent"))
    assert "| 2.000 ms | 80.00 / 80.40 | +0.50% |" in text
    assert "the training process's CPU time +0.50% [+0.00%..+1.00%]." in text
    # the agent on core 1 in rounds 0 and 2 (+0.5%, 0%: median 0.25%), on core 0 (+1%): 0.625%
    assert text.endswith(
        "core 0: +1.00%; core 1: +0.50%, +0.00%. Mean of the two cores' "
        "medians (a difference between the cores cancels): +0.63%."
    )


@pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs CPU affinity and 2 cores",
)
def test_two_short_rounds_run_pinned_and_swap_cores(tmp_path) -> None:
    out = tmp_path / "shared.md"
    assert shared_core.main(["--rounds", "2", "--steps", "3", "--out", str(out)]) == 0
    rows = json.loads(out.with_suffix(".json").read_text())
    assert [r["round"] for r in rows] == [0, 1]
    assert rows[0]["bare_core"] == rows[1]["agent_core"] != rows[0]["agent_core"]
    assert all(r["bare_wall_s"] > 0 and r["agent_wall_s"] > 0 for r in rows)
    assert all(r["agent_step_s"] > 0 for r in rows)  # the agent ran in the agent process
    assert all(0 < r["bare_process_cpu_s"] and 0 < r["agent_process_cpu_s"] for r in rows)
    assert "Median over 2 rounds" in out.read_text()
