"""Learning-rate schedule steps: read from the optimizer, found in the samples, and a
mechanism collapse that begins with one is the schedule's consequence (agent/schedule_steps.py).
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from agent.attribution import Attributor
from agent.incidents import Evidence, RunContext
from agent.notify.render import render_text
from agent.samples import LEARNING_RATE, Sample
from agent.schedule_steps import (
    ScheduleAccount,
    ScheduleStep,
    ScheduleSteps,
    learning_rate_samples,
)


def _lr(step: int, **groups: float) -> list[Sample]:
    return [Sample.make(step, LEARNING_RATE, v, group=g) for g, v in groups.items()]


def _feed(steps: ScheduleSteps, schedule: dict[int, dict[str, float]]) -> None:
    for step, groups in sorted(schedule.items()):
        steps.observe(_lr(step, **groups))


def test_learning_rate_samples_name_each_group_and_skip_what_cannot_be_read_cheaply():
    w1, w2, w3, w4 = (torch.nn.Parameter(torch.zeros(2)) for _ in range(4))
    optimizer = torch.optim.SGD(
        [
            {"params": [w1], "name": "decay", "lr": 0.1},
            {"params": [w2], "lr": 0.02},  # unnamed: its index
            {"params": [w3], "lr": torch.tensor(0.5)},  # a CPU tensor reads without a sync
            {"params": [w4], "lr": float("nan")},
        ],
        lr=1.0,
    )
    got = {s.label_dict["group"]: s.value for s in learning_rate_samples(optimizer, 40)}
    assert got == {"decay": pytest.approx(0.1), "1": pytest.approx(0.02), "2": pytest.approx(0.5)}
    assert all(s.step == 40 and s.metric == "lr" for s in learning_rate_samples(optimizer, 40))
    assert learning_rate_samples(object(), 1) == []  # not an optimizer: nothing


def test_the_agents_own_lower_lr_is_not_part_of_the_schedule():
    from remediations.lr import LRControl

    w = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.SGD([w], lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1000, gamma=0.1)
    control = LRControl()
    scales, floors = control.plan(optimizer, [0], factor=0.2, min_lr=0.0)
    control.commit(optimizer, scheduler, scales, floors)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.02)  # what the optimizer uses
    (sample,) = learning_rate_samples(optimizer, 10)
    assert sample.value == pytest.approx(0.1)  # what the schedule says


def test_a_step_of_every_group_is_a_schedule_step_and_gradual_change_is_not():
    steps = ScheduleSteps()
    schedule = {s: {"a": 1e-3, "b": 2e-3} for s in range(0, 900, 10)}
    schedule.update({s: {"a": 0.9e-3, "b": 1.8e-3} for s in range(890, 1000, 10)})  # x0.9
    schedule.update({s: {"a": 1e-4, "b": 2e-4} for s in range(1000, 1100, 10)})  # x0.11
    schedule.update({s: {"a": 3e-4, "b": 6e-4} for s in range(1100, 1200, 10)})  # x3
    _feed(steps, schedule)
    assert steps.steps == [
        ScheduleStep(990, 1000, pytest.approx(1 / 9)),
        ScheduleStep(1090, 1100, pytest.approx(3.0)),
    ]


def test_a_doubling_is_a_step_and_just_under_it_is_not():
    steps = ScheduleSteps()
    _feed(steps, {0: {"a": 1e-3}, 10: {"a": 2e-3}, 20: {"a": 3.9e-3}, 30: {"a": 1.95e-3}})
    assert [(s.before, s.at) for s in steps.steps] == [(0, 10), (20, 30)]


def test_one_group_alone_or_groups_moving_apart_are_not_schedule_steps():
    steps = ScheduleSteps()
    _feed(steps, {0: {"other": 1e-3, "router": 1e-3}, 10: {"other": 1e-3, "router": 3e-2}})
    _feed(steps, {20: {"other": 1e-4, "router": 3e-1}})  # one cut, one raised
    _feed(steps, {30: {"other": 0.6e-4, "router": 0.6e-1}})  # both x0.2 but one only x0.6
    assert steps.steps == []


def test_a_warm_up_from_zero_and_a_cut_to_zero_are_steps_and_a_rollback_compares_afresh():
    steps = ScheduleSteps()
    _feed(steps, {0: {"a": 0.0}, 10: {"a": 1e-4}, 20: {"a": 1.5e-4}, 30: {"a": 0.0}})
    assert [(s.before, s.at, s.ratio) for s in steps.steps] == [(0, 10, math.inf), (20, 30, 0.0)]
    _feed(steps, {40: {"a": 1e-3}})
    assert len(steps.steps) == 3
    steps.observe(_lr(20, a=1e-5))  # rolled back to step 20 with another learning rate
    steps.observe(_lr(30, a=1e-5))
    assert len(steps.steps) == 3  # 1e-3 at 40 and 1e-5 at 20 are two paths, not a step


def test_state_round_trips_through_json():
    steps = ScheduleSteps()
    _feed(steps, {0: {"a": 1e-3}, 10: {"a": 1e-4}})
    again = ScheduleSteps()
    again.load_state_dict(json.loads(json.dumps(steps.state_dict())))
    assert again.steps == steps.steps and again.last == steps.last
    with pytest.raises(ValueError, match="above 1"):
        ScheduleSteps(ratio=1.0)


def _qk(onset: int, fired: int, value: float = 1.3) -> Evidence:
    return Evidence(
        rule="qk_delta2_entropy_collapse",
        metric="qk_delta2_entropy",
        labels={"layer": "blocks.0.attn"},
        family="fa_precision",
        severity="warning",
        value=value,
        baseline=2.0,
        onset_step=onset,
        fired_step=fired,
        trend="falling",
    )


def _attributor_with_cut(cut_at: int, groups: tuple[str, ...] = ("other", "router")) -> Attributor:
    att = Attributor(RunContext(run_name="r"), schedule_lag=50)
    for step in range(0, cut_at + 100, 10):
        lr = {g: (1e-3 if step < cut_at or g not in groups else 1e-4) for g in ("other", "router")}
        att.observe(_lr(step, **lr))
    return att


def _loss_rise(onset: int, fired: int) -> Evidence:
    return Evidence(
        rule="loss_rise",
        metric="loss",
        labels={},
        family="symptom",
        severity="warning",
        value=2.3,
        baseline=2.1,
        onset_step=onset,
        fired_step=fired,
    )


def test_a_qk_collapse_that_begins_with_a_schedule_step_pages_nothing_and_runs_nothing():
    att = _attributor_with_cut(900)
    assert att.update(955, [_qk(onset=925, fired=955)]) == []  # inhibited: no incident
    assert att.open is None
    assert not att.causes("qk_delta2_entropy_collapse")  # its remedies do not run
    assert att.causes("loss_rise")
    assert att.update(1200, []) == []  # it cleared: nothing to page
    assert att.causes("qk_delta2_entropy_collapse")


def test_other_evidence_opens_the_incident_with_the_schedules_collapse_as_a_consequence():
    att = _attributor_with_cut(900)
    qk = _qk(onset=925, fired=955)
    assert att.update(955, [qk]) == []
    (opened,) = att.update(1010, [qk, _loss_rise(onset=990, fired=1010)])
    assert opened.kind == "opened"
    assert opened.incident.family == "unattributed"
    (collapse,) = [e for e in opened.incident.evidence if e.rule == qk.rule]
    why = (
        "began with a step of the learning-rate schedule (x0.1 between steps 890 and 900) and "
        "has not moved further since"
    )
    assert collapse.consequence and collapse.consequence_of == why
    assert not att.causes(qk.rule)
    assert f"a consequence, not a cause: {why}" in render_text(opened)  # the page says why


# H(Delta_2) of layer 0 on the test bed after an LR cut x0.1 at step 900 (seed 132, the
# tuning seed; one value per round, 5 steps after each evaluation): healthy, the cut leaves it
# at a new level; with an FA fault that starts with the cut, it keeps falling.
HEALTHY = {955: 1.42, 980: 1.31, 1005: 1.5, 1030: 1.49, 1055: 1.48, 1080: 1.51, 1105: 1.56}
FAULTY = {955: 1.02, 980: 0.9, 1005: 0.98, 1030: 0.88, 1055: 0.95, 1080: 0.86, 1105: 0.88}
FAULTY_LATER = {1130: 0.79, 1155: 0.8}


def test_a_level_shift_stays_explained_and_a_further_fall_lapses_to_a_cause():
    healthy, faulty = _attributor_with_cut(900), _attributor_with_cut(900)
    for step, value in HEALTHY.items():
        assert healthy.update(step, [_qk(925, 955, value)]) == []
    for step, value in FAULTY.items():
        assert faulty.update(step, [_qk(925, 955, value)]) == []  # above 0.8 x 1.02
    assert faulty.schedule.levels == {"qk_delta2_entropy_collapse|layer=blocks.0.attn": (900, 1.02)}
    (opened,) = faulty.update(1130, [_qk(925, 955, FAULTY_LATER[1130])])  # under 0.816
    assert opened.incident.family == "fa_precision"
    assert not opened.incident.evidence[0].consequence
    assert faulty.causes("qk_delta2_entropy_collapse")  # its remedies run now
    assert faulty.update(1155, [_qk(925, 955, FAULTY_LATER[1155])]) == []
    assert healthy.open is None and not healthy.causes("qk_delta2_entropy_collapse")


def test_each_step_of_a_step_decay_explains_its_own_level():
    """A step decay cuts again: the alert that fires after the second cut is measured against
    its level after that cut, not after the first (where it stood higher)."""
    account = ScheduleAccount(lag=50)
    schedule = {
        s: {"a": 1e-3 if s < 900 else 1e-4 if s < 1900 else 1e-5} for s in range(0, 2100, 10)
    }
    _feed(account.steps, schedule)
    first, second = _qk(925, 955), _qk(1925, 1990)
    account.track(955, [dataclasses.replace(first, value=1.4)])
    account.track(1990, [dataclasses.replace(second, value=1.0)])  # fired after its window
    account.track(2015, [dataclasses.replace(second, value=0.95)])
    assert account.explaining(second) is not None  # 0.95 is not under 0.8 x 1.0
    account.track(2040, [dataclasses.replace(second, value=0.79)])
    assert account.explaining(second) is None


def test_a_consequence_of_the_schedule_that_lapses_escalates_the_open_incident():
    att = _attributor_with_cut(900)
    loss = _loss_rise(onset=950, fired=980)
    assert att.update(955, [_qk(925, 955, 1.02)]) == []
    (opened,) = att.update(980, [_qk(925, 955, 0.9), loss])
    assert opened.incident.family == "unattributed"
    assert att.update(1005, [_qk(925, 955, 0.98), loss]) == []
    (escalated,) = att.update(1130, [_qk(925, 955, 0.79), loss])
    assert escalated.kind == "escalated"
    assert escalated.incident.family == "fa_precision"


def test_a_rising_alert_lapses_when_it_rises_a_quarter_beyond_its_level():
    account = ScheduleAccount(lag=50)
    _feed(account.steps, {s: {"a": 1e-3 if s < 900 else 1e-4} for s in range(0, 1000, 10)})
    rising = dataclasses.replace(_qk(925, 955), trend="rising")
    for step, value in ((955, 2.0), (1000, 2.4), (1100, 2.49)):
        account.track(step, [dataclasses.replace(rising, value=value)])
        assert account.explaining(rising) is not None
    account.track(1125, [dataclasses.replace(rising, value=2.51)])  # over 2.0 / 0.8
    assert account.explaining(rising) is None
    again = ScheduleAccount(lag=50)
    again.load_state_dict(json.loads(json.dumps(account.state_dict())))
    assert again.explaining(rising) is None and again.levels == account.levels
    with pytest.raises(ValueError, match="lapse"):
        ScheduleAccount(lapse=1.0)


@pytest.mark.parametrize(
    "onset, groups",
    [
        (890, ("other", "router")),  # began before the step: a cause
        (960, ("other", "router")),  # after the step's window (900 + 50)
        (925, ("router",)),  # one group's learning rate changed: not the schedule
    ],
)
def test_a_qk_collapse_outside_a_schedule_steps_window_is_a_cause(onset, groups):
    att = _attributor_with_cut(900, groups)
    (opened,) = att.update(onset + 30, [_qk(onset=onset, fired=onset + 30)])
    assert opened.incident.family == "fa_precision"
    assert att.causes("qk_delta2_entropy_collapse")


def test_the_schedule_survives_the_attributors_state_round_trip():
    att = _attributor_with_cut(900)
    again = Attributor(RunContext(run_name="r"), schedule_lag=50)
    again.load_state_dict(json.loads(json.dumps(att.state_dict())))
    assert again.update(955, [_qk(onset=925, fired=955)]) == []
    older = {k: v for k, v in att.state_dict().items() if k != "schedule"}
    Attributor(RunContext()).load_state_dict(older)  # a state saved before it loads


def test_the_agent_logs_every_groups_learning_rate_and_finds_the_cut(tmp_path, capsys):
    from agent.agent import Agent
    from agent.config import AgentConfig
    from agent.eventlog import read_events
    from agent.replay import cli_replay, replay
    from agent.testbed.runner import TestbedRun
    from agent.testbed.scenarios import ScenarioConfig

    torch.manual_seed(0)
    scenario = ScenarioConfig.preset(
        "clean", seed=0, steps=60, monitor_every=10**9, lr_change_step=40, lr_change_mult=0.1
    )
    run = TestbedRun(scenario)
    config = AgentConfig.model_validate(
        {"run_dir": tmp_path / "run", "notify": {"console": "never"}, "qk": {"delta": 20}}
    )
    with Agent(run.model, run.optimizer, run.scheduler, config) as agent:
        for step in range(60):
            agent.step(step, loss=run.step())
        seen = [(s.before, s.at) for s in agent.attributor.schedule.steps.steps]
    # linear warm-up x6 from the read-out at 0 to the one at 10, the cut x0.1 at step 40
    assert seen == [(0, 10), (30, 40)]
    events = read_events(tmp_path / "run/events.jsonl")
    assert events[0]["schedule_lag"] == 40  # 2 x qk.delta
    rates = [
        (step, labels["group"], value)
        for e in events
        if e["kind"] == "metrics"
        for step, metric, labels, value in e["samples"]
        if metric == "lr"
    ]
    assert [s for s, g, _ in rates if g == "routers"] == list(range(0, 60, 10))
    assert {g for _, g, _ in rates} == {"other", "routers"}
    by_step = {s: v for s, g, v in rates if g == "other"}
    assert by_step[40] / by_step[30] == pytest.approx(0.42 * 0.1 / 0.32)  # warm-up x cut
    replayed = replay(tmp_path / "run/events.jsonl")  # replay finds the same steps
    assert [(before, at) for before, at, _ in replayed.schedule_steps] == seen
    assert cli_replay([str(tmp_path / "run/events.jsonl")]) == 0
    assert (
        "step      40  learning rate x0.131 (every group, since step 30)" in capsys.readouterr().out
    )
