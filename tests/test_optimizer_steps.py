"""Steps a GradScaler skipped (fp16 overflow): their inf gradient norms are not a fault of the
run and page nothing; a scaler that skips most steps is paged (``optimizer_steps_skipped``)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from symptom_agent import symptoms_only

from agent.agent import Agent
from agent.eventlog import read_events
from agent.optimizer_steps import OptimizerSteps


def test_a_torch_optimizer_is_trusted_and_a_missing_step_is_seen():
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    steps = OptimizerSteps(optimizer)
    assert steps.trusted
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    assert steps.skipped() is False
    assert steps.skipped() is True  # no optimizer step since the previous call
    optimizer.step()
    optimizer.step()  # two steps between two calls: not skipped
    assert steps.skipped() is False
    steps.close()
    optimizer.step()
    assert steps.skipped() is True  # the hook is gone


def test_an_optimizer_torch_does_not_hook_is_unknown():
    class Wrapper:  # a wrapper that never ran torch.optim.Optimizer.__init__
        def step(self) -> None:
            pass

        def register_step_post_hook(self, hook):  # pragma: no cover - must not be called
            raise AssertionError("registered on an optimizer whose hooks may never run")

    steps = OptimizerSteps(Wrapper())  # type: ignore[arg-type]
    assert not steps.trusted and steps.skipped() is None


def test_a_wrapper_holding_a_torch_optimizer_is_counted_on_it():
    """accelerate's AcceleratedOptimizer: its own step is not hooked; the scaler steps (or
    skips) the inner optimizer, whose hooks count."""
    model = torch.nn.Linear(3, 2)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)

    class Accelerated:
        def __init__(self, optimizer: torch.optim.Optimizer) -> None:
            self.optimizer = optimizer

        def step(self, skip: bool = False) -> None:
            if not skip:
                self.optimizer.step()

    wrapper = Accelerated(inner)
    steps = OptimizerSteps(wrapper)  # type: ignore[arg-type]
    assert steps.trusted
    wrapper.step()
    assert steps.skipped() is False
    wrapper.step(skip=True)
    assert steps.skipped() is True


def _run(tmp_path: Path, overflow: set[int], steps: int) -> tuple[Agent, list[float]]:
    """A small fp16-style loop with a CPU GradScaler; at the ``overflow`` steps one gradient is
    all inf (the scaler skips the optimizer step). The agent gets the loss only."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    current = {"step": -1}
    model[0].weight.register_hook(
        lambda g: torch.full_like(g, math.inf) if current["step"] in overflow else g
    )
    config = symptoms_only(tmp_path / "run", 10, symptom_wait_steps=0)
    agent = Agent(model, optimizer, config=config)
    norms = []
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        current["step"] = step
        x = torch.randn(16, 6, generator=g)
        loss = (model(x) - x.sum(-1, keepdim=True)).pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        grads = [p.grad for p in model.parameters()]
        norms.append(float(torch.linalg.vector_norm(torch.stack([x.norm() for x in grads]))))
        agent.step(step, loss=loss.detach())  # before zero_grad: the agent's own grad norm
        optimizer.zero_grad(set_to_none=True)
    agent.close()
    return agent, norms


def test_isolated_skipped_steps_page_nothing_and_are_counted(tmp_path):
    agent, norms = _run(tmp_path, overflow={30, 50}, steps=80)
    assert math.isinf(norms[30]) and math.isinf(norms[50])  # the fault is real
    grad = dict(agent.store.series("grad_norm"))
    assert sorted(grad) == [0, 10, 20, 40, 60, 70]  # 30 and 50 left out
    assert all(math.isfinite(v) and v > 0 for v in grad.values())
    share = dict(agent.store.series("optimizer_skipped_share"))
    assert share == {s: (0.1 if s in (30, 50) else 0.0) for s in range(0, 80, 10)}
    events = read_events(tmp_path / "run/events.jsonl")
    assert [e for e in events if e["kind"] in ("alert", "incident")] == []


def test_a_scaler_that_skips_most_steps_is_paged(tmp_path):
    agent, _ = _run(tmp_path, overflow=set(range(105, 150)), steps=150)
    share = dict(agent.store.series("optimizer_skipped_share"))
    assert share[100] == 0.0 and share[110] == pytest.approx(0.6) and share[120] == 1.0
    events = read_events(tmp_path / "run/events.jsonl")
    opened = [e for e in events if e["kind"] == "incident" and e["event"] == "opened"]
    assert len(opened) == 1 and opened[0]["step"] == 130  # pending at 110, firing at 130
    evidence = [x["rule"] for x in opened[0]["incident"]["evidence"]]
    assert evidence == ["optimizer_steps_skipped"]
    assert opened[0]["incident"]["severity"] == "critical"
