"""A test-bed run with the agent inside its training loop (what `mechwatch demo`, the tests and
the benchmarks use to show detection, attribution and remediation on real failing runs).

The loop is the one a user writes, plus the two hooks a rollback needs: the data position
(the batch generator's state and the step counter) is saved with every checkpoint and restored
by a rollback, and the loop continues from the step ``agent.step`` returns.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from agent.agent import Agent
from agent.config import AgentConfig
from agent.eventlog import last_run, read_events
from agent.testbed.divergence import divergence_step
from agent.testbed.runner import TestbedRun
from agent.testbed.scenarios import ScenarioConfig
from remediations.attention import attention_precision
from remediations.halt import TrainingHalted
from remediations.requests import BALANCE_COEF

_NO_FP32 = {"all": False, "included": [], "excluded": []}


@dataclass
class SupervisedResult:
    scenario: str
    seed: int
    steps: int
    fault_start: int | None
    losses: list[float]  # loss at each step index of the final trajectory (after rollbacks)
    executed_steps: int  # optimizer steps actually run (rolled-back ones included)
    rolled_back_steps: int
    first_alert: dict[str, int] = field(default_factory=dict)  # family -> first firing step
    first_alert_rule: dict[str, str] = field(default_factory=dict)  # rule -> first firing step
    incidents: list[dict[str, Any]] = field(default_factory=list)
    actions: list[dict[str, Any]] = field(default_factory=list)
    halted: str | None = None
    divergence_step: int | None = None
    wall_s: float = 0.0

    @property
    def attribution(self) -> str | None:
        """Family of the first incident that a mechanism or symptom rule opened."""
        return self.incidents[0]["family"] if self.incidents else None

    @property
    def onset_step(self) -> int | None:
        return self.incidents[0]["onset_step"] if self.incidents else None

    def final_loss(self, last: int = 100) -> float:
        tail = self.losses[-last:]
        return sum(tail) / len(tail)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(
            attribution=self.attribution, onset_step=self.onset_step, final_loss=self.final_loss()
        )
        return d


def run_supervised(
    scenario: ScenarioConfig,
    agent_config: AgentConfig,
    *,
    progress: Callable[[int, float, Agent], None] | None = None,
) -> SupervisedResult:
    """Train ``scenario`` with the agent; returns what happened. The attention precision switch
    is process-wide: it is reset before and after the run."""
    attention_precision.load_state_dict(_NO_FP32)
    t0 = time.perf_counter()
    run = TestbedRun(scenario, record_monitors=False)  # the agent measures for itself

    def data_state() -> dict[str, Any]:
        return {"step_index": run.step_index, "generator": run.generator.get_state()}

    def restore_data(state: dict[str, Any], skip_batches: int) -> None:
        run.generator.set_state(state["generator"])
        run.step_index = int(state["step_index"])
        for _ in range(skip_batches):  # draw and drop the batches to skip
            run.source.batch(run.batch_size, scenario.model.seq_len, run.generator)

    agent = Agent(
        run.model,
        run.optimizer,
        run.scheduler,
        agent_config,
        data_state=data_state,
        restore_data=restore_data,
    )
    losses: dict[int, float] = {}
    executed = 0
    halted = None
    step = 0
    try:
        while step < scenario.steps and executed < 3 * scenario.steps:
            # The loop reads the agent's hyper-parameter requests (raise_balance_coef...).
            run.model.balance_coef = agent.hparams.get(BALANCE_COEF, run.model.balance_coef)
            loss = run.step()
            executed += 1
            losses[step] = float(loss)  # the loop's own logging (one sync, as users do)
            if progress is not None:
                progress(step, losses[step], agent)
            next_step = agent.step(step, loss=loss, grad_norm=run.last_grad_norm)
            if next_step != step + 1:
                assert run.step_index == next_step, (run.step_index, next_step)
                for s in [s for s in losses if s >= next_step]:
                    del losses[s]
            step = next_step
    except TrainingHalted as exc:
        halted = str(exc)
    finally:
        agent.close()
        attention_precision.load_state_dict(_NO_FP32)
    events = last_run(read_events(Path(agent_config.run_dir) / "events.jsonl"))
    ordered = [losses[s] for s in sorted(losses)]
    result = SupervisedResult(
        scenario=scenario.scenario,
        seed=scenario.seed,
        steps=scenario.steps,
        fault_start=scenario.fault_start if scenario.scenario != "clean" else None,
        losses=ordered,
        executed_steps=executed,
        rolled_back_steps=executed - len(ordered),
        halted=halted,
        divergence_step=divergence_step(ordered),
        wall_s=time.perf_counter() - t0,
    )
    _summarize_events(events, agent, result)
    return result


def _summarize_events(events: list[dict[str, Any]], agent: Agent, result: SupervisedResult) -> None:
    family_of = {r.name: r.spec.family for r in agent.ruleset}
    for e in events:
        if e["kind"] == "alert" and e["transition"].endswith("->firing"):
            rule = e["rule"]
            result.first_alert_rule.setdefault(rule, e["step"])
            result.first_alert.setdefault(family_of.get(rule, "?"), e["step"])
        elif e["kind"] == "incident" and e.get("event") == "opened":
            result.incidents.append(e["incident"])
        elif e["kind"] == "incident" and e.get("event") == "escalated" and result.incidents:
            # Keep the first incident's final attribution (escalations upgrade the family).
            if e["incident"]["id"] == result.incidents[0]["id"]:
                result.incidents[0] = e["incident"]
        elif e["kind"] == "action":
            result.actions.append(
                {
                    k: e.get(k)
                    for k in ("step", "action", "status", "detail", "dry_run", "rule", "follow_up")
                }
            )


def default_agent_config(
    run_dir: str | Path, *, remediate: bool = True, **updates: Any
) -> AgentConfig:
    """The agent configuration the demo and benchmarks use on the test bed: shipped rules,
    default cadences, checkpoints every 100 steps for rollback, pages to the event log (and
    the console or Slack when ``notify`` says so)."""
    base: dict[str, Any] = {
        "run_name": "testbed",
        "run_dir": str(run_dir),
        "checkpoints": {"enabled": True, "every": 100, "keep_last": 3, "keep_known_good": 3},
        "notify": {"console": "never"},
        "actions": {"dry_run": not remediate},
    }
    base.update(updates)
    return AgentConfig.model_validate(base)


def set_threads(n: int = 1) -> None:
    """The test bed is tiny: one intra-op thread per run is fastest on a loaded machine."""
    torch.set_num_threads(n)
