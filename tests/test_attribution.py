"""Attribution: which families fire decides the incident; one incident per fault."""

from __future__ import annotations

import pytest

from agent.attribution import Attributor, FiringAlert, classify, confidence
from agent.incidents import Evidence, RunContext


def _alert(rule: str, family: str, onset: int | None = 100, layer: str = "l0", actions=()):
    ev = Evidence(
        rule=rule,
        metric="m",
        labels={"layer": layer},
        family=family,
        severity="critical" if family != "symptom" else "warning",
        value=0.1,
        baseline=2.0,
        onset_step=onset,
        fired_step=200,
        suggest=f"fix {rule}",
    )
    return FiringAlert(ev, tuple(actions))


@pytest.mark.parametrize(
    "families, expected",
    [
        ({"fa_precision"}, "fa_precision"),
        ({"router_instability"}, "router_instability"),
        ({"fa_precision", "router_instability"}, "combined"),
        ({"fa_precision", "router_instability", "symptom"}, "combined"),
        ({"fa_precision", "symptom"}, "fa_precision"),
        ({"symptom"}, "unattributed"),
        (set(), "unattributed"),
    ],
)
def test_classify(families, expected):
    assert classify(families) == expected


def test_confidence_rules():
    fa = [_alert("a", "fa_precision").evidence]
    assert confidence(fa, {"fa_precision", "router_instability"}) == pytest.approx(0.7)
    assert confidence(fa, {"fa_precision"}) == pytest.approx(0.6)  # router not monitored
    two = fa + [_alert("b", "fa_precision").evidence, _alert("s", "symptom").evidence]
    assert confidence(two, {"fa_precision", "router_instability"}) == pytest.approx(0.85)
    assert confidence([_alert("s", "symptom").evidence], set()) == pytest.approx(0.3)
    both = fa + [_alert("r", "router_instability").evidence]
    assert confidence(both, {"fa_precision", "router_instability"}) == pytest.approx(0.6)


def test_one_incident_upgraded_then_resolved_with_thread_events():
    att = Attributor(RunContext(run_name="r"), repeat_every_steps=100)
    assert att.update(10, []).events == []
    sym = _alert("loss_spike", "symptom", onset=None, actions=[("page", {})])
    up = att.update(20, [sym])
    assert [e.kind for e in up.events] == ["opened"]
    assert up.events[0].incident.family == "unattributed"
    assert [(r.action, r.rule) for r in up.action_requests] == [("page", "loss_spike")]
    fa = _alert("qk", "fa_precision", onset=5, actions=[("attention_fp32_backward", {})])
    up = att.update(30, [sym, fa])
    assert [e.kind for e in up.events] == ["escalated"]
    inc = up.events[0].incident
    assert inc.family == "fa_precision" and inc.onset_step == 5
    assert inc.quiet_families == ["router_instability"]
    assert inc.suggestions == ["fix loss_spike", "fix qk"]
    assert [r.action for r in up.action_requests] == ["attention_fp32_backward"]
    # The same rule and action are not requested twice for one incident.
    assert att.update(40, [sym, fa]).action_requests == []
    # A second layer of the same rule is evidence, not a new page.
    assert att.update(50, [fa, _alert("qk", "fa_precision", layer="l1")]).events == []
    up = att.update(60, [fa, _alert("router", "router_instability", onset=3)])
    assert [e.kind for e in up.events] == ["escalated"]
    assert up.events[0].incident.family == "combined"
    assert up.events[0].incident.onset_step == 3
    up = att.update(200, [fa])
    assert [e.kind for e in up.events] == ["repeat"]
    up = att.update(210, [])
    assert [e.kind for e in up.events] == ["resolved"]
    assert up.events[0].incident.resolved_step == 210
    ids = {att.closed[0].id}
    assert [e.seq for e in [up.events[0]]] == [5]
    # A new fault is a new incident with its own id.
    up = att.update(300, [fa])
    assert up.events[0].kind == "opened" and up.events[0].incident.id not in ids
    assert up.events[0].seq == 1


def test_state_round_trip_keeps_open_incident_without_repage():
    att = Attributor(RunContext(run_name="r"))
    fa = _alert("qk", "fa_precision", actions=[("rollback", {"margin_steps": 10})])
    att.update(20, [fa])
    state = att.state_dict()
    other = Attributor(RunContext(run_name="r"))
    other.load_state_dict(state)
    up = other.update(30, [fa])
    assert up.events == [] and up.action_requests == []
    assert other.open is not None and other.open.id == att.open.id
