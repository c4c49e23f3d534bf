"""The adaptive QK budget (``qk.budget``): the layers and heads of each evaluation sized to a
fraction of the measured step time."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from agent.agent import Agent
from agent.config import AgentConfig
from agent.discovery import find_attention
from agent.eventlog import read_events
from agent.monitor_budget import MonitorBudget
from agent.probes import QKSnapshots
from agent.testbed.runner import TestbedRun
from agent.testbed.scenarios import ScenarioConfig


def _budget(head_seconds: float, step_seconds: float = 0.04) -> MonitorBudget:
    budget = MonitorBudget(0.01, delta=25, layers=2, heads=4)
    budget.on_step(100.0)
    budget.on_step(100.0 + step_seconds)
    budget.on_job(head_seconds * 4, heads=4)
    return budget


def test_the_plan_fits_the_budget_per_evaluation():
    """1% of a 40 ms step over 25 steps: 10 ms per evaluation."""
    assert MonitorBudget(0.01, delta=25, layers=2, heads=4).plan() == (None, None)  # untimed
    assert _budget(0.0001).plan() == (2, None)  # 100 heads fit: everything
    assert _budget(0.002).plan() == (1, None)  # 5 heads: one whole layer
    assert _budget(0.004).plan() == (1, 2)  # 2.5 heads: two heads of one layer
    assert _budget(1.0).plan() == (1, 1)  # never less than one head
    slow_steps = _budget(0.004, step_seconds=0.4)  # 25 heads
    assert slow_steps.plan() == (2, None)


def test_step_and_head_times_are_exponential_means():
    budget = MonitorBudget(0.5, delta=1, layers=1, heads=1)
    for t in (0.0, 1.0, 2.0, 4.0):
        budget.on_step(t)
    assert budget.step_seconds == pytest.approx(0.8 * 1.0 + 0.2 * 2.0)
    budget.restart()
    budget.on_step(50.0)  # a rollback: the interval across it is not a step
    assert budget.step_seconds == pytest.approx(1.2)
    budget.on_job(0.3, heads=3)
    budget.on_job(0.6, heads=3)
    assert budget.head_seconds == pytest.approx(0.8 * 0.1 + 0.2 * 0.2)
    with pytest.raises(ValueError, match="qk.budget must be in"):
        MonitorBudget(0.0, delta=1, layers=1, heads=1)


def test_a_changing_window_keeps_rotating_over_every_layer():
    torch.manual_seed(0)
    cfg = ScenarioConfig.preset("clean", seed=0, steps=10, monitor_every=10**9)
    run = TestbedRun(cfg.model_copy(update={"model": cfg.model.model_copy(update={"n_layers": 3})}))
    snapshots = QKSnapshots(find_attention(run.model), delta=1, layers_per_eval=1)
    measured = []
    for step, window in enumerate([1, 1, 2, 2, 1, 3, 3]):
        snapshots.layers_per_eval = window
        measured.append(sorted(job.site.name[7] for job in snapshots.on_step(step)))
    # Each evaluation measures the plan made one step before with that step's window, which
    # starts where the previous plan ended: 0 | 1 | 2 0 | 1 2 | 0 | 1 2 0.
    assert measured == [[], ["0"], ["1"], ["0", "2"], ["1", "2"], ["0"], ["0", "1", "2"]]


def _qk_heads(path: Path) -> dict[int, set[tuple[str, str]]]:
    heads: dict[int, set[tuple[str, str]]] = {}
    for e in read_events(path):
        for step, metric, labels, _ in e.get("samples", []):
            if metric == "qk_delta2_entropy":
                heads.setdefault(step, set()).add((labels["layer"], labels["head"]))
    return heads


@pytest.mark.parametrize(("budget", "per_evaluation"), [(1e-7, 1), (1.0, 8)])
def test_the_agent_measures_what_the_budget_allows(tmp_path, budget, per_evaluation):
    """A budget no job fits: one head per evaluation, rotating over the heads of one layer at
    a time; a budget of the whole step: both layers' 4 heads."""
    torch.manual_seed(0)
    run = TestbedRun(ScenarioConfig.preset("clean", seed=0, steps=160, monitor_every=10**9))
    cfg = AgentConfig.model_validate(
        {"run_dir": tmp_path, "notify": {"console": "never"}, "qk": {"budget": budget}}
    )
    with Agent(run.model, run.optimizer, run.scheduler, cfg) as agent:
        for step in range(160):
            agent.step(step, loss=run.step())
    heads = _qk_heads(tmp_path / "events.jsonl")
    assert len(heads[25]) == 8  # the first evaluation: nothing timed yet, everything
    later = [heads[s] for s in sorted(heads) if s >= 75]
    assert later and all(len(h) == per_evaluation for h in later)
    if per_evaluation == 1:
        assert len(set().union(*later)) == len(later)  # a new head each time


def test_a_distributed_pipeline_refuses_the_budget(tmp_path):
    """Each rank would time its own share and plan its own layers: the ranks' evaluations
    would no longer match."""
    from agent.discovery import find_routers
    from agent.distributed.measurements import DistributedMeasurements
    from agent.distributed.world import World

    run = TestbedRun(ScenarioConfig.preset("clean", seed=0, steps=10, monitor_every=10**9))
    cfg = AgentConfig.model_validate({"run_dir": tmp_path, "qk": {"budget": 0.01}})
    sites, routers = find_attention(run.model), find_routers(run.model)
    hooks = sum(len(m._forward_pre_hooks) for m in run.model.modules())
    with pytest.raises(ValueError, match="qk.budget is supported in one process only"):
        DistributedMeasurements(run.model, cfg, sites, routers, world=World(0, 1))
    assert sum(len(m._forward_pre_hooks) for m in run.model.modules()) == hooks  # none added
