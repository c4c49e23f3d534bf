"""The outside check's HF model (benchmarks/detection_hf.py) still trains under the agent, and
its FA fault reaches the arithmetic through transformers' attention interface: the losses equal
the clean run's until the fault starts and differ after it."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import detection_hf  # noqa: E402


def test_the_fault_changes_the_run_from_its_start_and_the_agent_sees_the_model(tmp_path):
    clean = detection_hf.run("clean", 3, 12, tmp_path / "clean", fault_start=6)["losses"]
    fault = detection_hf.run("fa_floor_4", 3, 12, tmp_path / "fa", fault_start=6)["losses"]
    assert len(clean) == len(fault) == 12 and all(math.isfinite(x) for x in clean + fault)
    # The step-6 loss is computed before that step's backward: equal up to and including it.
    assert fault[:7] == clean[:7]
    assert fault[7:] != clean[7:]
    start = (tmp_path / "fa" / "events.jsonl").read_text().splitlines()[0]
    assert '"attention_layers": ["model.layers.0.self_attn"' in start
    assert '"routers": ["model.layers.0.mlp.gate"' in start
