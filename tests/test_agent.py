"""The agent inside a real PyTorch training loop on the test-bed model."""

from __future__ import annotations

import json
import time
import warnings
from pathlib import Path

import pytest
import torch

from agent.agent import Agent
from agent.config import AgentConfig
from agent.config_file import load_agent_config
from agent.eventlog import read_events
from agent.rules.errors import RuleFileErrors
from agent.testbed.runner import TestbedRun
from agent.testbed.scenarios import ScenarioConfig


def _run(scenario: str = "clean", steps: int = 100, **overrides) -> TestbedRun:
    torch.manual_seed(0)
    cfg = ScenarioConfig.preset(scenario, seed=0, steps=steps, monitor_every=10**9, **overrides)
    return TestbedRun(cfg)


def _config(tmp_path: Path, **kw) -> AgentConfig:
    # Symptom-only incidents open at once here: these tests are about what happens next (the
    # wait itself: test_a_symptom_only_incident_is_paged_after_the_symptom_wait).
    base = {"run_dir": tmp_path / "run", "notify": {"console": "never", "symptom_wait_steps": 0}}
    base.update(kw)
    return AgentConfig.model_validate(base)


def test_defaults_work_with_model_and_optimizer_alone(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = _run()
    with Agent(run.model, run.optimizer) as agent:
        assert [s.name for s in agent.attention_sites] == ["blocks.0.attn", "blocks.1.attn"]
        assert [s.name for s in agent.router_sites] == ["blocks.0.moe.gate", "blocks.1.moe.gate"]
        for step in range(60):
            loss = run.step()
            assert agent.step(step, loss=loss, grad_norm=run.last_grad_norm) == step + 1
        metrics = agent.latest_metrics()
    assert metrics["loss"] == pytest.approx(float(run.last_loss), abs=0.5)
    assert metrics["grad_norm"] > 0
    assert "qk_delta2_entropy{head=3,layer=blocks.1.attn}" in metrics
    assert "router_entropy_norm{router=blocks.0.moe.gate}" in metrics
    kinds = {e["kind"] for e in read_events(tmp_path / "mechwatch_runs/run/events.jsonl")}
    assert {"start", "metrics", "stop"} <= kinds


def test_monitor_results_are_applied_at_a_deterministic_step(tmp_path):
    """A QK result measured at step t enters the rules at t + apply_lag, never earlier/later."""
    run = _run()
    cfg = _config(tmp_path, qk={"delta": 10}, scheduling={"apply_lag": 3})
    agent = Agent(run.model, run.optimizer, config=cfg)
    seen_at: dict[int, int] = {}
    for step in range(45):
        agent.step(step, loss=run.step())
        time.sleep(0.002)  # give the monitor thread every chance to finish early
        for s, _ in agent.store.series(
            "qk_delta2_entropy", (("head", "0"), ("layer", "blocks.0.attn"))
        ):
            seen_at.setdefault(s, step)
    agent.close()
    # Snapshots at 0, 10, 20, 30, 40: increments measured at 10, 20, 30 (40 is due at 43).
    assert seen_at == {10: 13, 20: 23, 30: 33, 40: 43}


def test_agent_failure_never_reaches_the_training_loop(tmp_path, monkeypatch):
    run = _run()
    # The monitor thread's path (the patch reaches this process only; the monitor process's
    # failures: tests/test_monitor_process.py).
    config = _config(tmp_path, qk={"delta": 5, "worker": "thread"})
    agent = Agent(run.model, run.optimizer, config=config)

    def broken(*args, **kwargs):
        raise RuntimeError("monitor exploded")

    monkeypatch.setattr("agent.measurements.compute_qk_samples", broken)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(30):
            agent.step(step, loss=run.step())
    agent.close()
    messages = [str(w.message) for w in caught if "monitor exploded" in str(w.message)]
    assert len(messages) == 1, messages  # reported once, then skipped
    errors = [e for e in read_events(tmp_path / "run/events.jsonl") if e["kind"] == "error"]
    assert any("monitor exploded" in e["error"] for e in errors)
    assert "loss" in agent.latest_metrics()  # the rest kept working


def test_broken_rule_file_fails_at_construction(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("groups:\n  - name: g\n    rules:\n      - name: r\n        metric: loss\n")
    run = _run(steps=1)
    with pytest.raises(RuleFileErrors, match=r"bad.yaml:4:\d+: group 'g', rule 'r'"):
        Agent(run.model, run.optimizer, config=_config(tmp_path, rules=[bad]))


def test_config_file_errors_are_located_and_paths_relative(tmp_path):
    path = tmp_path / "mechwatch.yaml"
    path.write_text("run_name: demo\nqk:\n  delta: 0\n  bogus: 1\nrun_dir: out\n")
    with pytest.raises(RuleFileErrors) as info:
        load_agent_config(path)
    text = str(info.value)
    assert f"{path}:3:10: field 'qk.delta': must be >= 1, got 0" in text
    assert f"{path}:4:3: field 'qk.bogus': unknown field" in text
    path.write_text("qk: {delta: 2.5}\nqk: {orders: [2]}\n")
    with pytest.raises(RuleFileErrors) as info:
        load_agent_config(path)
    assert f"{path}:2:1: field 'qk': duplicate key (first at line 1)" in str(info.value)
    assert f"{path}:1:13: field 'qk.delta': expected an integer, got 2.5" in str(info.value)
    path.write_text("qk: {delta: 1e1}\n")  # 1e-style numbers are numbers, not strings
    assert load_agent_config(path).qk.delta == 10
    path.write_text("run_name: demo\nrun_dir: out\nrules: [mine.yaml]\n")
    cfg = load_agent_config(path)
    assert cfg.run_dir == tmp_path / "out" and cfg.rules == [tmp_path / "mine.yaml"]


def test_config_errors_never_echo_a_slack_token(tmp_path):
    path = tmp_path / "mechwatch.yaml"
    path.write_text("notify:\n  slack:\n    bot_tokn: xoxb-123-secret\n    base_url: 5\n")
    with pytest.raises(RuleFileErrors) as info:
        load_agent_config(path)
    assert "xoxb-123-secret" not in str(info.value)
    assert "field 'notify.slack.bot_tokn': unknown field" in str(info.value)


def test_watchdog_pages_a_hung_run_from_the_rule(tmp_path):
    rules = tmp_path / "hung.yaml"
    rules.write_text(
        "groups:\n  - name: g\n    rules:\n"
        "      - name: hung_run\n        metric: seconds_since_step\n"
        "        detector: {type: threshold, above: 0.3}\n        for: 0\n"
        "        severity: critical\n        family: symptom\n"
        "        summary: 'no step for {value:.1f} s'\n"
    )
    run = _run(steps=3)
    cfg = _config(tmp_path, rules=[rules], watchdog={"check_every_s": 0.1})
    agent = Agent(run.model, run.optimizer, config=cfg)
    agent.step(0, loss=run.step())
    deadline = time.monotonic() + 5
    pages = []
    while time.monotonic() < deadline and not pages:
        time.sleep(0.1)
        pages = [e for e in read_events(tmp_path / "run/events.jsonl") if e["kind"] == "page"]
    loss = run.step()
    for step in range(1, 20):  # the run resumes: the hung incident resolves
        agent.step(step, loss=loss)
        time.sleep(0.05)
    agent.close()
    events = read_events(tmp_path / "run/events.jsonl")
    incidents = [e for e in events if e["kind"] == "incident"]
    assert [e["event"] for e in incidents] == ["opened", "resolved"], incidents
    assert incidents[0]["incident"]["evidence"][0]["rule"] == "hung_run"
    assert pages, "the hung run was not paged"


def test_state_round_trip_does_not_repage_an_open_incident(tmp_path):
    rules = tmp_path / "loss.yaml"
    rules.write_text(
        "groups:\n  - name: g\n    rules:\n"
        "      - name: always\n        metric: loss\n"
        "        detector: {type: threshold, above: 0.0}\n        for: 0\n"
        "        severity: warning\n        family: symptom\n"
    )
    run = _run(steps=30)
    cfg = _config(tmp_path, rules=[rules], symptoms={"every": 5})
    agent = Agent(run.model, run.optimizer, config=cfg)
    for step in range(11):
        agent.step(step, loss=run.step())
    state = json.loads(json.dumps(agent.state_dict()))  # JSON-serializable
    opened = agent.incident
    agent.close()
    assert opened is not None and opened.family == "unattributed"

    cfg2 = _config(tmp_path, rules=[rules], symptoms={"every": 5}, run_dir=tmp_path / "run2")
    resumed = Agent(run.model, run.optimizer, config=cfg2)
    resumed.load_state_dict(state)
    for step in range(11, 21):
        resumed.step(step, loss=run.step())
    resumed.close()
    incidents = [e for e in read_events(tmp_path / "run2/events.jsonl") if e["kind"] == "incident"]
    assert incidents == []  # no new "opened" page for the same, still firing incident
    assert resumed.incident is not None and resumed.incident.id == opened.id


def test_shipped_examples_load():
    root = Path(__file__).resolve().parent.parent / "examples"
    cfg = load_agent_config(root / "mechwatch.yaml")
    assert cfg.run_name == "example" and cfg.checkpoints.enabled
    from agent.cli import validate

    assert validate([str(root / "my_rules.yaml")]) == 0


def test_rollback_in_a_real_loop_restores_the_checkpoint_and_moves_the_step_back(tmp_path):
    rules = tmp_path / "roll.yaml"
    rules.write_text(
        "groups:\n  - name: g\n    rules:\n"
        "      - name: always\n        metric: loss\n"
        "        detector: {type: threshold, above: 0.0}\n        for: 0\n        start_step: 20\n"
        "        severity: critical\n        family: symptom\n"
        "        actions: [{rollback: {margin_steps: 5}}, {lower_lr: {factor: 0.5}}]\n"
    )
    run = _run(steps=40)

    def data_state() -> dict:
        return {"step_index": run.step_index, "generator": run.generator.get_state()}

    def restore_data(state: dict, skip: int) -> None:
        run.generator.set_state(state["generator"])
        run.step_index = int(state["step_index"])

    cfg = _config(
        tmp_path,
        rules=[rules],
        symptoms={"every": 10},
        checkpoints={"enabled": True, "every": 10, "keep_last": 5},
    )
    agent = Agent(
        run.model,
        run.optimizer,
        run.scheduler,
        cfg,
        data_state=data_state,
        restore_data=restore_data,
    )
    saved_at_10 = None
    step, moves = 0, []
    while step < 30:
        loss = run.step()
        next_step = agent.step(step, loss=loss)
        if step == 10:
            agent.checkpoints.flush()
            saved_at_10 = {k: v.clone() for k, v in run.model.state_dict().items()}
        if next_step != step + 1:
            moves.append((step, next_step))
            restored = {k: v.clone() for k, v in run.model.state_dict().items()}
        step = next_step
    agent.close()
    # The alert fired at step 20 (onset 20); the newest checkpoint at or before 20 - 5 is
    # step 10: the loop continues at 11 with the weights saved after step 10.
    assert moves == [(20, 11)]
    assert all(torch.equal(restored[k], saved_at_10[k]) for k in saved_at_10)
    actions = [e for e in read_events(tmp_path / "run/events.jsonl") if e["kind"] == "action"]
    # The action after the rollback runs at the restored step (its cooldown clock too).
    assert [(a["action"], a["status"], a["step"]) for a in actions] == [
        ("rollback", "applied", 20),
        ("lower_lr", "applied", 10),
    ]


def _loss_rule_agent(tmp_path: Path, steps: int) -> tuple[TestbedRun, Agent]:
    """An agent whose one rule fires while the reported loss is above 5 and then lowers the
    LR (x0.5, cooldown 30 steps); the loss is whatever the test reports."""
    rules = tmp_path / "jump.yaml"
    rules.write_text(
        "groups:\n  - name: g\n    rules:\n"
        "      - name: high\n        metric: loss\n"
        "        detector: {type: threshold, above: 5.0}\n        for: 0\n"
        "        severity: warning\n        family: symptom\n"
        "        actions: [{lower_lr: {factor: 0.5, cooldown: 30}}]\n"
    )
    run = _run(steps=steps)
    cfg = _config(tmp_path, rules=[rules], symptoms={"every": 5})
    return run, Agent(run.model, run.optimizer, run.scheduler, cfg)


def _action_steps(tmp_path: Path) -> list[tuple[int, str]]:
    events = read_events(tmp_path / "run/events.jsonl")
    return [(a["step"], a["status"]) for a in events if a["kind"] == "action"]


def test_a_rules_actions_run_again_each_cooldown_while_it_keeps_firing(tmp_path):
    """lower_lr runs for the first incident; the fault returns within the cooldown: the request
    waits and runs when the cooldown is over; the fault stays: it runs again a cooldown later
    (a fix that did not hold is applied again)."""
    run, agent = _loss_rule_agent(tmp_path, steps=80)
    for step in range(80):
        run.step()
        agent.step(step, loss=10.0 if 10 <= step < 15 or step >= 20 else 1.0)
    standing = agent.pacing.standing()
    agent.close()
    actions = _action_steps(tmp_path)
    assert actions == [(10, "applied"), (20, "skipped"), (40, "applied"), (70, "applied")]
    assert agent.lr_scale == pytest.approx(0.125)
    assert [r.action for r in standing] == ["lower_lr"]  # the rule still fires


def test_a_standing_request_is_dropped_when_the_rule_stops_firing(tmp_path):
    run, agent = _loss_rule_agent(tmp_path, steps=60)
    for step in range(25):
        run.step()
        agent.step(step, loss=10.0 if 10 <= step < 15 or 20 <= step < 25 else 1.0)
    state = json.loads(json.dumps(agent.state_dict()))
    assert [e["request"]["action"] for e in state["pacing"]["episodes"]] == ["lower_lr"]
    for step in range(25, 60):  # the fault is gone before the cooldown ends
        run.step()
        agent.step(step, loss=1.0)
    agent.close()
    actions = _action_steps(tmp_path)
    assert actions == [(10, "applied"), (20, "skipped")]
    assert agent.lr_scale == pytest.approx(0.5)


def test_after_a_rollback_the_cooldown_clock_counts_only_steps_run(tmp_path):
    """The actions of the round that rolled back, and the standing ones later, see the restored
    step: lower_lr (cooldown 15) runs at the restored step 10 and next at 25, 15 steps run
    later (counting the abandoned steps 11-20 twice would make it 20)."""
    rules = tmp_path / "roll.yaml"
    rules.write_text(
        "groups:\n  - name: g\n    rules:\n"
        "      - name: always\n        metric: loss\n"
        "        detector: {type: threshold, above: 0.0}\n        for: 0\n        start_step: 20\n"
        "        severity: critical\n        family: symptom\n"
        "        actions: [{rollback: {margin_steps: 5, cooldown: 100}},"
        " {lower_lr: {factor: 0.5, cooldown: 15}}]\n"
    )
    run = _run(steps=40)
    cfg = _config(
        tmp_path,
        rules=[rules],
        symptoms={"every": 5},
        checkpoints={"enabled": True, "every": 10, "keep_last": 5},
    )
    agent = Agent(run.model, run.optimizer, run.scheduler, cfg)
    step = 0
    while step < 35:
        loss = run.step()
        step = agent.step(step, loss=loss)
    agent.close()
    actions = [e for e in read_events(tmp_path / "run/events.jsonl") if e["kind"] == "action"]
    assert [(a["action"], a["status"], a["step"]) for a in actions] == [
        ("rollback", "applied", 20),
        ("lower_lr", "applied", 10),
        ("lower_lr", "applied", 25),
    ]
    assert agent.lr_scale == pytest.approx(0.25)
