"""The agent's metrics in a callback and in TensorBoard: names, per-layer means, steps."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from agent.agent import Agent
from agent.config import AgentConfig
from agent.metric_sinks import by_step, scalar_metrics
from agent.samples import Sample
from agent.testbed.runner import TestbedRun
from agent.testbed.scenarios import ScenarioConfig


def test_samples_become_per_layer_scalars_with_stable_names():
    samples = [
        Sample.make(25, "qk_delta2_entropy", 1.0, layer="blocks.0.attn", head=0),
        Sample.make(25, "qk_delta2_entropy", 3.0, layer="blocks.0.attn", head=1),
        Sample.make(25, "router_entropy_norm", 0.5, router="blocks.0.moe.gate"),
        Sample.make(24, "loss", 2.5),
        Sample.make(25, "loss", 2.4),
    ]
    metrics = scalar_metrics(samples)
    assert metrics == {
        "mechwatch/qk_delta2_entropy/blocks.0.attn": {25: 2.0},
        "mechwatch/router_entropy_norm/blocks.0.moe.gate": {25: 0.5},
        "mechwatch/loss": {24: 2.5, 25: 2.4},
    }
    assert list(by_step(metrics)) == [24, 25]


def _run(tmp_path: Path, **kw) -> tuple[Agent, list]:
    torch.manual_seed(0)
    run = TestbedRun(
        ScenarioConfig.preset("clean", seed=0, steps=60, monitor_every=10**9), record_monitors=False
    )
    seen: list = []
    cfg = AgentConfig.model_validate(
        {"run_dir": tmp_path / "run", "notify": {"console": "never"}, "qk": {"delta": 10}, **kw}
    )
    agent = Agent(run.model, run.optimizer, config=cfg, on_metrics=lambda s, m: seen.append((s, m)))
    for step in range(40):
        run.step()
        agent.step(step, loss=run.last_loss)
    agent.close()
    return agent, seen


def test_the_callback_sees_every_round_with_its_steps(tmp_path):
    _, seen = _run(tmp_path)
    loss_steps = [s for s, m in seen if "mechwatch/loss" in m]
    assert loss_steps == list(range(31))  # read every 10 steps: 31-39 not read yet
    # A QK result measured at step 20 arrives 5 steps later, with its own step.
    assert any("mechwatch/qk_delta2_entropy/blocks.0.attn" in m for s, m in seen if s == 20)
    names = set().union(*(m for _, m in seen))
    assert "mechwatch/loss" in names
    assert "mechwatch/qk_delta2_entropy/blocks.1.attn" in names
    assert "mechwatch/router_entropy_norm/blocks.0.moe.gate" in names


def test_tensorboard_gets_the_same_scalars(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, seen = _run(tmp_path, metrics={"tensorboard": "tb"})
    acc = EventAccumulator(str(tmp_path / "run" / "tb"))
    acc.Reload()
    tag = "mechwatch/qk_delta2_entropy/blocks.1.attn"
    logged = {e.step: e.value for e in acc.Scalars(tag)}
    expected = {s: m[tag] for s, m in seen if tag in m}
    assert logged.keys() == expected.keys() and len(logged) >= 2
    assert all(abs(logged[s] - expected[s]) < 1e-5 for s in logged)
