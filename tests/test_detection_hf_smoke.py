"""The outside check's HF model (benchmarks/detection_hf.py) still trains under the agent, and
its FA fault reaches the arithmetic through transformers' attention interface: the losses equal
the clean run's until the fault starts and differ after it."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

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


@pytest.mark.parametrize(
    "scenario, before, after",
    [
        ("batch_x2", (16, 64), (32, 64)),
        ("seq_len_x4", (16, 16), (16, 64)),
        ("mixture_step", (16, 64), (16, 64)),
        ("clean", (16, 64), (16, 64)),
    ],
)
def test_the_benign_steps_change_the_batches_at_the_shift_step(scenario, before, after):
    """(batch, length) of the token ids just before and at SHIFT_STEP; the mixture's share of
    the other language's rows moves from about a quarter to about three quarters."""
    data, other = (detection_hf.HiddenMarkovLanguage(s) for s in (5, 1005))
    mixer = torch.Generator().manual_seed(2005)
    step = detection_hf.SHIFT_STEP

    def ids(at: int) -> torch.Tensor:
        return detection_hf._batch(scenario, at, data, other, mixer)

    assert tuple(ids(step - 1).shape) == before and tuple(ids(step).shape) == after
    if scenario != "mixture_step":
        return
    # Which language wrote a row: the other language's emissions are its own tokens.
    own = (data.emit.sum(0) > 0) & (other.emit.sum(0) == 0)  # (VOCAB,) tokens only data emits
    alien = (other.emit.sum(0) > 0) & (data.emit.sum(0) == 0)

    def share(at: int) -> float:
        rows = [ids(at) for _ in range(40)]
        hits = [(alien[r].sum(1) > own[r].sum(1)).float().mean() for r in rows]
        return float(sum(hits) / len(hits))

    assert 0.12 < share(step - 1) < 0.38 and 0.62 < share(step) < 0.88


def test_the_dense_llama_trains_under_the_agent_without_a_router(tmp_path):
    """``--model llama``: 4 layers of 8 query heads over 4 KV heads, no router; the fault
    reaches its arithmetic too, and a router fault is refused by name."""
    clean = detection_hf.run("clean", 3, 8, tmp_path / "clean", fault_start=4, model_name="llama")
    fault = detection_hf.run(
        "fa_floor_4", 3, 8, tmp_path / "fa", fault_start=4, model_name="llama"
    )["losses"]
    assert fault[:5] == clean["losses"][:5] and fault[5:] != clean["losses"][5:]
    start = (tmp_path / "fa" / "events.jsonl").read_text().splitlines()[0]
    assert '"model.layers.3.self_attn"' in start and '"routers": []' in start
    with pytest.raises(ValueError, match="router_x30_nobal.*dense"):
        detection_hf.run("router_x30_nobal", 3, 2, tmp_path / "r", model_name="llama")


def _audits(run_dir: Path) -> dict[int, float]:
    from agent.eventlog import read_events

    return {
        step: value
        for e in read_events(run_dir / "events.jsonl", "metrics")
        for step, name, _, value in e["samples"]
        if name == "attention_backward_asymmetry"
    }


def test_the_kernel_audit_reaches_the_hf_models_own_kernel(tmp_path):
    """install_hf_attention(audit_any_implementation=True) puts the benchmark's custom kernel
    behind the switch's dispatcher: the agent audits it (armed at step 0, measured at step 1):
    exactly 0 before the fault, above 1e-4 with the floor fault on from step 0."""
    detection_hf.run("clean", 3, 3, tmp_path / "clean", fault_start=6)
    detection_hf.run("fa_floor_4", 3, 3, tmp_path / "fa", fault_start=0)
    start = (tmp_path / "fa" / "events.jsonl").read_text().splitlines()[0]
    assert '"kernel_audit": "on"' in start
    assert _audits(tmp_path / "clean") == {1: 0.0}
    assert _audits(tmp_path / "fa")[1] > 1e-4
