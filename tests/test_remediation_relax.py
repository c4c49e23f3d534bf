"""lower_lr with relax_above: a cut that over-damps its mechanism is relaxed once, by half."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from torch.optim import lr_scheduler as sched

from agent.agent import Agent
from agent.config import AgentConfig
from agent.eventlog import read_events
from agent.incidents import Evidence, Incident
from agent.samples import Sample
from agent.testbed.runner import TestbedRun
from agent.testbed.scenarios import ScenarioConfig
from remediations.base import ActionContext
from remediations.lr import LowerLR, LowerLRParams
from remediations.relax import OvershootWatch, watched_series
from remediations.runner import ActionRunner

METRIC = "router_entropy_norm"


def _evidence(router: str, value: float, baseline: float | None) -> Evidence:
    return Evidence(
        rule="collapse",
        metric=METRIC,
        labels={"router": router},
        family="router_instability",
        severity="critical",
        value=value,
        baseline=baseline,
        onset_step=500,
        fired_step=550,
    )


def _incident(*evidence: Evidence) -> Incident:
    return Incident(
        id="run-1-s550",
        family="router_instability",
        severity="critical",
        confidence=0.7,
        opened_step=550,
        onset_step=500,
        evidence=list(evidence),
    )


def _readout(step: int, **values: float) -> list[Sample]:
    return [Sample.make(step, METRIC, v, router=r) for r, v in values.items()]


def _setup(base_lr: float = 0.1):
    torch.manual_seed(0)
    body = torch.nn.Parameter(torch.randn(4, 4))
    router = torch.nn.Parameter(torch.randn(3, 4))
    opt = torch.optim.SGD([{"params": [body]}, {"params": [router], "name": "router"}], lr=base_lr)
    scheduler = sched.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.01 * s))
    return opt, scheduler


def _ctx(opt, scheduler, incident=None, step=0) -> ActionContext:
    return ActionContext(step=step, optimizer=opt, scheduler=scheduler, incident=incident)


def _cut(action, opt, scheduler, incident, factor=0.1, relax_above=1.25, relax_for=3):
    params = LowerLRParams(factor=factor, groups=[1], relax_above=relax_above, relax_for=relax_for)
    return action.apply(_ctx(opt, scheduler, incident), params)


def test_watched_series_takes_evidence_with_a_baseline_and_knows_the_fault_side():
    series = watched_series(
        [
            _evidence("r0", 0.02, 0.6),  # fell
            _evidence("r1", 0.9, 0.5),  # rose
            _evidence("r2", 0.3, None),  # no learned baseline: cannot be judged
            _evidence("r3", 0.3, 0.0),  # no positive baseline: a ratio means nothing
        ]
    )
    assert [(s.labels, s.fell) for s in series] == [
        ((("router", "r0"),), True),
        ((("router", "r1"),), False),
    ]
    fell, rose = series
    assert fell.threshold(1.25) == pytest.approx(0.75) and fell.beyond(0.76, 1.25)
    assert not fell.beyond(0.74, 1.25) and not fell.beyond(math.nan, 1.25)
    assert rose.threshold(1.25) == pytest.approx(0.4) and rose.beyond(0.39, 1.25)
    assert not rose.beyond(0.41, 1.25)


def test_watch_needs_every_series_beyond_for_consecutive_readouts():
    watch = OvershootWatch(
        groups=[1],
        scale_before={1: 1.0},
        series=watched_series([_evidence("r0", 0.02, 0.6), _evidence("r1", 0.1, 0.9)]),
        ratio=1.1,
        needed=2,
    )
    # r1 never exceeds 0.99 (1.1 x 0.9): r0 alone beyond its threshold is not enough.
    assert not watch.observe(_readout(25, r0=0.9, r1=0.95)) and watch.run == 0
    assert not watch.observe(_readout(50, r0=0.9, r1=0.995)) and watch.run == 1
    assert not watch.observe(_readout(75, r0=0.5, r1=0.995)) and watch.run == 0  # streak broken
    assert not watch.observe(_readout(100, r0=0.9, r1=0.995)) and watch.run == 1
    # An evaluation without a read-out of every series gives no verdict and keeps the streak.
    assert not watch.observe(_readout(110, r0=0.9)) and watch.run == 1
    assert not watch.observe([Sample.make(110, "loss", 3.0)]) and watch.run == 1
    assert watch.observe(_readout(125, r0=0.9, r1=0.995))


def test_overshoot_relaxes_the_cut_by_half_in_log_scale_and_the_scheduler_keeps_it():
    opt, scheduler = _setup()
    action = LowerLR()
    out = _cut(action, opt, scheduler, _incident(_evidence("r0", 0.02, 0.6)))
    assert action.control.scale_for(1) == pytest.approx(0.1) and action.watching
    assert "above 0.75" in out.after["relax_if"]
    for step in range(1, 4):  # recovering, but not past 1.25 x 0.6: nothing to relax
        opt.step()
        scheduler.step()
        assert action.observe(_ctx(opt, scheduler), _readout(step, r0=0.7)) is None
    outcomes = []
    for step in range(4, 7):
        opt.step()
        scheduler.step()
        outcomes.append(action.observe(_ctx(opt, scheduler), _readout(step, r0=0.8)))
    assert outcomes[:2] == [None, None] and outcomes[2] is not None
    relaxed = outcomes[2]
    assert relaxed.before["lr_scale"] == pytest.approx([1.0, 0.1])
    assert relaxed.after["lr_scale"] == pytest.approx([1.0, math.sqrt(0.1)])
    assert "run-1-s550" in relaxed.detail and "x0.1 -> x0.316" in relaxed.detail
    assert not action.watching  # once per cut
    assert action.observe(_ctx(opt, scheduler), _readout(7, r0=0.9)) is None
    for _ in range(100):
        opt.step()
        scheduler.step()
    scheduled = 0.1 / (1.0 + 0.01 * scheduler.last_epoch)
    assert float(opt.param_groups[0]["lr"]) == pytest.approx(scheduled, rel=1e-12)
    assert float(opt.param_groups[1]["lr"]) == pytest.approx(scheduled * math.sqrt(0.1), rel=1e-12)


def test_a_second_cut_replaces_the_watch_and_relaxing_never_reaches_the_failed_scale():
    opt, scheduler = _setup()
    action = LowerLR()
    _cut(action, opt, scheduler, _incident(_evidence("r0", 0.02, 0.6)))
    # The fault came back at x0.1: cut again; only the second cut is watched.
    _cut(action, opt, scheduler, _incident(_evidence("r0", 0.05, 0.5)))
    assert len(action.watches) == 1 and action.watches[0].scale_before == {1: pytest.approx(0.1)}
    assert action.control.scale_for(1) == pytest.approx(0.01)
    results = [
        action.observe(_ctx(opt, scheduler), _readout(s, r0=0.7)) for s in range(3)
    ]  # 0.7 > 1.25 x 0.5
    assert results[-1] is not None
    assert action.control.scale_for(1) == pytest.approx(math.sqrt(0.01 * 0.1))
    assert action.control.scale_for(1) < 0.1


def test_a_metric_that_rose_relaxes_when_it_settles_far_below_its_baseline():
    opt, scheduler = _setup()
    action = LowerLR()
    _cut(action, opt, scheduler, _incident(_evidence("r0", 3.0, 1.0)), factor=0.25, relax_for=1)
    assert action.observe(_ctx(opt, scheduler), _readout(1, r0=0.9)) is None  # above 1/1.25
    assert action.observe(_ctx(opt, scheduler), _readout(2, r0=0.7)) is not None
    assert action.control.scale_for(1) == pytest.approx(0.5)


def test_no_watch_without_relax_above_or_without_usable_evidence():
    opt, scheduler = _setup()
    action = LowerLR()
    action.apply(_ctx(opt, scheduler, _incident()), LowerLRParams(factor=0.5, groups=[1]))
    assert not action.watching
    out = _cut(action, opt, scheduler, _incident(_evidence("r0", 0.3, None)))
    assert not action.watching and "not watched for overshoot" in out.detail
    dry = _ctx(opt, scheduler, _incident(_evidence("r0", 0.02, 0.6)))
    dry.dry_run = True
    action.apply(dry, LowerLRParams(factor=0.5, groups=[1], relax_above=1.25))
    assert not action.watching  # a dry run changes nothing, so there is nothing to relax


def test_watch_state_round_trips_and_a_rollback_restarts_the_count():
    opt, scheduler = _setup()
    action = LowerLR()
    _cut(action, opt, scheduler, _incident(_evidence("r0", 0.02, 0.6)), relax_for=3)
    action.observe(_ctx(opt, scheduler), _readout(1, r0=0.8))
    state = json.loads(json.dumps(action.state_dict()))
    resumed = LowerLR()
    resumed.load_state_dict(state)
    assert resumed.state_dict() == action.state_dict() and resumed.watches[0].run == 1
    resumed.reapply(_ctx(opt, scheduler))  # what the runner calls after a rollback
    assert resumed.watches[0].run == 0
    assert resumed.observe(_ctx(opt, scheduler), _readout(2, r0=0.8)) is None
    assert resumed.observe(_ctx(opt, scheduler), _readout(3, r0=0.8)) is None
    assert resumed.observe(_ctx(opt, scheduler), _readout(4, r0=0.8)) is not None
    bad = json.loads(json.dumps(state))
    bad["watches"][0]["series"] = []
    with pytest.raises(ValueError, match="relax watch"):
        LowerLR().load_state_dict(bad)


def test_runner_audits_a_follow_up_and_never_raises():
    opt, scheduler = _setup()
    audits: list[dict] = []
    incident = _incident(_evidence("r0", 0.02, 0.6))
    runner = ActionRunner(lambda: _ctx(opt, scheduler, step=600), audit=audits.append)
    assert runner.observe(_readout(0, r0=0.9)) == []  # nothing watching yet
    params = {"factor": 0.1, "groups": [1], "relax_above": 1.25, "relax_for": 1}
    assert runner.run("lower_lr", params, incident=incident).status == "applied"
    (result,) = runner.observe(_readout(600, r0=0.9))
    assert result.status == "applied" and result.record.action == "lower_lr"
    assert audits[-1]["follow_up"] is True and audits[-1]["after"]["lr_scale"][1] == pytest.approx(
        math.sqrt(0.1)
    )
    # A follow-up that fails (the optimizer went away) is reported, the loop goes on.
    assert runner.run("lower_lr", {**params, "cooldown": 0}, incident=incident).ok
    broken = ActionRunner(lambda: ActionContext(step=700), audit=audits.append)
    broken._actions = runner._actions
    (failed,) = broken.observe(_readout(700, r0=0.9))
    assert failed.status == "failed" and "needs the optimizer" in failed.record.detail


def test_agent_relaxes_an_overshooting_cut_in_a_real_loop(tmp_path: Path):
    """decide -> lower_lr -> follow-up, through Agent.step, with the event log as the record.

    The rule watches the loss (a metric every loop reports); the loop reports a loss that
    jumps (the fault), then settles far below its pre-onset level (an over-damped fix)."""
    rules = tmp_path / "jump.yaml"
    rules.write_text(
        "groups:\n  - name: g\n    rules:\n"
        "      - name: loss_jump\n        metric: loss\n"
        "        detector: {type: baseline, warmup: 4, window: 8, direction: rise, rel: 0.5,"
        " z: 3.0, min_scale: 0.1}\n"
        "        for: 1\n        keep_firing_for: 0\n        severity: warning\n"
        "        family: symptom\n"
        "        actions:\n"
        "          - lower_lr: {factor: 0.1, relax_above: 1.25, relax_for: 3}\n"
    )
    torch.manual_seed(0)
    run = TestbedRun(ScenarioConfig.preset("clean", seed=0, steps=200, monitor_every=10**9))
    cfg = AgentConfig.model_validate(
        {
            "run_dir": tmp_path / "run",
            "notify": {"console": "never", "symptom_wait_steps": 0},  # act on the symptom at once
            "rules": [rules],
            "symptoms": {"every": 5},
        }
    )
    agent = Agent(run.model, run.optimizer, scheduler=run.scheduler, config=cfg)
    for step in range(200):
        run.step()
        reported = 2.0 if step < 60 else (10.0 if step < 80 else 1.0)
        agent.step(step, loss=reported)
    agent.close()
    actions = [e for e in read_events(tmp_path / "run/events.jsonl") if e["kind"] == "action"]
    assert [(a["action"], a.get("follow_up", False)) for a in actions] == [
        ("lower_lr", False),
        ("lower_lr", True),
    ]
    cut, relaxed = actions
    assert 60 <= cut["step"] < 80 and relaxed["step"] > 80
    assert relaxed["after"]["lr_scale"][0] == pytest.approx(math.sqrt(0.1))
    assert agent.lr_scale == pytest.approx(math.sqrt(0.1))
