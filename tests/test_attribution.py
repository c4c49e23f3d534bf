"""Attribution: which families fire decides the incident; one incident per fault."""

from __future__ import annotations

import dataclasses
import json

import pytest

from agent.attribution import Attributor, classify, confidence
from agent.incidents import Evidence, RunContext


def _alert(
    rule: str, family: str, onset: int | None = 100, layer: str = "l0", fired: int = 200
) -> Evidence:
    return Evidence(
        rule=rule,
        metric="m",
        labels={"layer": layer},
        family=family,
        severity="critical" if family != "symptom" else "warning",
        value=0.1,
        baseline=2.0,
        onset_step=onset,
        fired_step=fired,
        suggest=f"fix {rule}",
    )


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
    fa = [_alert("a", "fa_precision")]
    assert confidence(fa, {"fa_precision", "router_instability"}) == pytest.approx(0.7)
    assert confidence(fa, {"fa_precision"}) == pytest.approx(0.6)  # router not monitored
    two = fa + [_alert("b", "fa_precision"), _alert("s", "symptom")]
    assert confidence(two, {"fa_precision", "router_instability"}) == pytest.approx(0.85)
    assert confidence([_alert("s", "symptom")], set()) == pytest.approx(0.3)
    both = fa + [_alert("r", "router_instability")]
    assert confidence(both, {"fa_precision", "router_instability"}) == pytest.approx(0.6)


def test_one_incident_upgraded_then_resolved_with_thread_events():
    att = Attributor(RunContext(run_name="r"))
    assert att.update(10, []) == []
    sym = _alert("loss_spike", "symptom", onset=None)
    events = att.update(20, [sym])
    assert [e.kind for e in events] == ["opened"]
    assert events[0].incident.family == "unattributed"
    fa = _alert("qk", "fa_precision", onset=5)
    events = att.update(30, [sym, fa])
    assert [e.kind for e in events] == ["escalated"]
    inc = events[0].incident
    assert inc.family == "fa_precision" and inc.onset_step == 5
    assert inc.quiet_families == ["router_instability"]
    assert inc.suggestions == ["fix loss_spike", "fix qk"]
    assert att.update(40, [sym, fa]) == []  # nothing new: nothing to say
    # A second layer of the same rule is evidence, not a new page.
    assert att.update(50, [fa, _alert("qk", "fa_precision", layer="l1")]) == []
    events = att.update(60, [fa, _alert("router", "router_instability", onset=3)])
    assert [e.kind for e in events] == ["escalated"]
    assert events[0].incident.family == "combined"
    assert events[0].incident.onset_step == 3
    repeat = att.repeat(200)  # pacing says when (remediations.pacing)
    assert repeat is not None and repeat.kind == "repeat" and repeat.message == "still firing"
    events = att.update(210, [])
    assert [e.kind for e in events] == ["resolved"]
    assert events[0].incident.resolved_step == 210
    ids = {att.closed[0].id}
    assert events[0].seq == 5
    assert att.repeat(220) is None  # nothing open
    # A new fault is a new incident with its own id.
    events = att.update(300, [fa])
    assert events[0].kind == "opened" and events[0].incident.id not in ids
    assert events[0].seq == 1


def test_state_round_trip_keeps_open_incident_without_repage():
    att = Attributor(RunContext(run_name="r"))
    fa = _alert("qk", "fa_precision")
    att.update(20, [fa])
    state = att.state_dict()
    other = Attributor(RunContext(run_name="r"))
    other.load_state_dict(state)
    assert other.update(30, [fa]) == []
    assert other.open is not None and other.open.id == att.open.id


def _loss(rule: str, onset: int) -> Evidence:
    """Loss evidence; a ``loss_spike`` comes from a jump detector (``Detector.abrupt``)."""
    return Evidence(
        rule=rule,
        metric="loss",
        labels={},
        family="symptom",
        severity="warning",
        value=3.0,
        baseline=2.0,
        onset_step=onset,
        fired_step=onset + 20,
        abrupt=rule == "loss_spike",
    )


def test_a_collapse_after_the_loss_damage_is_a_consequence_not_combined():
    att = Attributor(RunContext(run_name="r"))
    fa = _alert("qk", "fa_precision", onset=500, fired=550)
    att.update(550, [fa])
    att.update(900, [fa, _loss("loss_rise", onset=850)])  # the fault damaged the loss
    # The router's rate detector dates its onset back to a slow drift (600); it fired at 975.
    router = _alert("router", "router_instability", onset=600, layer="g0", fired=975)
    events = att.update(1000, [fa, _loss("loss_rise", onset=850), router])
    inc = att.open
    assert inc.family == "fa_precision" and [e.kind for e in events] == ["updated"]
    consequence = {e.rule: e.consequence for e in inc.evidence}
    assert consequence == {"qk": False, "loss_rise": False, "router": True}
    assert inc.onset_step == 500
    # The consequence stays one while it keeps firing.
    assert att.update(1100, [fa, router]) == [] and att.open.family == "fa_precision"


def test_the_other_mechanism_after_the_loss_damage_of_an_open_incident_is_a_consequence():
    """An attention fault's incident is open and the loss damage began at 656; the router
    collapse fires 94 steps later (inside ``consequence_lag``): still the fault's downstream
    effect, not ``combined`` (the bigger model's FA fault, evaluation seed 101)."""
    att = Attributor(RunContext(run_name="r"))
    fa = _alert("qk", "fa_precision", onset=625, fired=650)
    att.update(655, [fa])
    att.update(670, [fa, _loss("loss_rise", onset=656)])
    router = _alert("router", "router_instability", onset=750, layer="g0", fired=750)
    att.update(750, [fa, _loss("loss_rise", onset=656), router])
    assert att.open.family == "fa_precision"
    assert {e.rule: e.consequence for e in att.open.evidence}["router"] is True
    # Without an open mechanism cause the lag still applies (the small batch: below).
    fresh = Attributor(RunContext(run_name="r"))
    fresh.update(670, [_loss("loss_rise", onset=656)])
    fresh.update(750, [_loss("loss_rise", onset=656), router])
    assert fresh.open.family == "router_instability"


def _diverged(fired: int, onset: int) -> Evidence:
    """``loss_diverged``: critical loss evidence (the EMA half a nat above its best)."""
    return dataclasses.replace(_loss("loss_diverged", onset), severity="critical", fired_step=fired)


def test_the_other_mechanism_that_first_fires_after_the_divergence_is_a_consequence():
    """The bigger model's FA fault (held-out seed 102): QK fired at 655, the loss rise at 670
    (onset 656), the loss diverged at 729; the router collapse fired at 750 with an onset (640)
    before the loss damage began, so neither the onset nor the lag calls it a consequence:
    that it fired after the divergence does."""
    fa = _alert("qk", "fa_precision", onset=600, fired=655)
    router = _alert("router", "router_instability", onset=640, layer="g0", fired=750)
    rise = dataclasses.replace(_loss("loss_rise", onset=656), fired_step=670)
    att = Attributor(RunContext(run_name="r"))
    att.update(655, [fa])
    att.update(670, [fa, rise])
    att.update(730, [fa, rise, _diverged(729, 700)])
    events = att.update(750, [fa, rise, _diverged(729, 700), router])
    assert att.open.family == "fa_precision" and [e.kind for e in events] == ["updated"]
    assert {e.rule: e.consequence for e in att.open.evidence} == {
        "qk": False,
        "loss_rise": False,
        "loss_diverged": False,
        "router": True,
    }
    # Fired before the divergence: a second cause (combined), as without the divergence.
    early = dataclasses.replace(router, fired_step=725)
    before = Attributor(RunContext(run_name="r"))
    before.update(655, [fa])
    before.update(670, [fa, rise])
    before.update(725, [fa, rise, early])
    assert before.open.family == "combined"


def test_a_first_mechanism_that_only_fires_after_the_divergence_is_a_consequence():
    """An HF Mixtral's data shift (seed 7, benchmarks/results/detection_hf.md): the loss rose
    and jumped at 1000 and diverged at 1010 (half a nat above its best); a router's entropy
    collapse fired at 1050 with an onset (975) before the jump, so neither the jump's onset
    rule nor the 100-step lag writes it off, and the benign shift ended router_instability.
    Fired after the divergence, it cannot be told from the divergence's effect."""
    rise = dataclasses.replace(_loss("loss_rise", onset=1000), fired_step=1000)
    diverged = _diverged(1010, 1000)
    router = _alert("router", "router_instability", onset=975, layer="g0", fired=1050)
    att = Attributor(RunContext(run_name="r"), symptom_wait=0)
    att.update(1010, [rise, diverged])
    att.update(1050, [rise, diverged, router])
    assert att.open.family == "unattributed"
    assert {e.rule: e.consequence for e in att.open.evidence}["router"] is True
    # The same collapse fired before the divergence: a cause, as before.
    early = dataclasses.replace(router, fired_step=1005)
    before = Attributor(RunContext(run_name="r"), symptom_wait=0)
    before.update(1000, [rise])
    before.update(1005, [rise, early])
    before.update(1010, [rise, diverged, early])
    assert before.open.family == "router_instability"


def test_two_mechanisms_that_began_before_any_loss_damage_are_combined():
    att = Attributor(RunContext(run_name="r"))
    fa = _alert("qk", "fa_precision", onset=500, fired=550)
    router = _alert("router", "router_instability", onset=520, layer="g0", fired=575)
    att.update(550, [fa])
    events = att.update(575, [fa, router, _loss("loss_rise", onset=560)])
    assert [e.kind for e in events] == ["escalated"] and att.open.family == "combined"


def test_the_other_mechanism_long_after_the_first_alert_is_downstream_without_loss_damage():
    """An FP8-strength attention fault (HF Mixtral seed 14, benchmarks/results/detection_hf.md):
    the QK alert at 580, the routers collapse from 1,225 with no loss alert at all: the
    fault's downstream effect (``downstream_lag``), not a second fault."""
    fa = _alert("qk", "fa_precision", onset=525, fired=580)
    router = _alert("router", "router_instability", onset=1225, layer="g0", fired=1225)
    att = Attributor(RunContext(run_name="r"))
    att.update(580, [fa])
    assert att.update(1225, [fa, router])[0].kind == "updated"
    assert att.open.family == "fa_precision"
    assert {e.rule: e.consequence for e in att.open.evidence}["router"] is True
    assert att.causes("router") is False  # its remedy does not run
    off = Attributor(RunContext(run_name="r"), downstream_lag=None)
    off.update(580, [fa])
    off.update(1225, [fa, router])
    assert off.open.family == "combined"


def test_a_second_mechanism_that_begins_within_the_downstream_lag_is_combined():
    """The test bed's ``combined`` (both faults at 500): the router alerted at 525, the QK
    collapse began 300 steps later (tuning seed 1): two causes."""
    router = _alert("router", "router_instability", onset=525, layer="g0", fired=525)
    fa = _alert("qk", "fa_precision", onset=825, fired=875)
    att = Attributor(RunContext(run_name="r"))
    att.update(525, [router])
    assert att.update(875, [router, fa])[0].kind == "escalated"
    assert att.open.family == "combined"


def _controls(onset: int) -> Evidence:
    return dataclasses.replace(
        _loss("block_update_collapse", onset),
        metric="control_update_entropy",
        labels={"layer": "l0"},
    )


def test_a_qk_collapse_with_the_whole_block_after_a_loss_jump_stays_unattributed():
    att = Attributor(RunContext(run_name="r"))
    att.update(910, [_loss("loss_spike", onset=900)])  # a data shift: the loss jumps first
    qk = _alert("qk", "fa_precision", 925, fired=930)
    shift = [_loss("loss_spike", onset=900), _controls(925), qk]
    events = att.update(950, shift)
    assert att.open.family == "unattributed" and [e.kind for e in events] == ["updated"]
    assert att.open.quiet_families == ["router_instability"]


def _controls_of(layer: str, onset: int) -> Evidence:
    return dataclasses.replace(_controls(onset), labels={"layer": layer})


@pytest.mark.parametrize(
    "controls_layer, family, expected",
    [
        ("l0", "fa_precision", "unattributed"),  # its own block moved: healthy change
        ("l1", "fa_precision", "fa_precision"),  # another block's: explains nothing here
        ("l1", "router_instability", "unattributed"),  # a router has no block: any block's
    ],
)
def test_attention_evidence_is_explained_by_its_own_blocks_controls_only(
    controls_layer, family, expected
):
    """A QK collapse of layer l0 after the controls of l1 collapsed is a cause: in a model of
    many layers, any block's control collapsing would otherwise write off a real fault."""
    att = Attributor(RunContext(run_name="r"))
    controls = _controls_of(controls_layer, 900)
    att.update(910, [controls])
    mech = _alert("mech", family, onset=925, fired=930, layer="l0")
    att.update(930, [controls, mech])
    assert att.open.family == expected
    why = {e.rule: e.consequence_of for e in att.open.evidence}["mech"]
    assert (why == "") == (expected != "unattributed")
    if why:
        whose = "the rest of its block's" if family == "fa_precision" else "every one of a block's"
        assert why == f"{whose} updates collapsed from step 900"


def test_a_collapse_that_begins_with_a_gradual_loss_change_is_still_a_cause():
    """A smaller batch makes the loss noisier and collapses the router at once: no
    consequence before the loss damage had ``consequence_lag`` steps to feed back."""
    router = _alert("router", "router_instability", 525, fired=550)
    att = Attributor(RunContext(run_name="r"))
    att.update(510, [_loss("loss_rise", onset=500)])
    att.update(550, [_loss("loss_rise", onset=500), router])
    assert att.open.family == "router_instability"
    strict = Attributor(RunContext(run_name="r"), consequence_lag=0)
    strict.update(510, [_loss("loss_rise", onset=500)])
    strict.update(550, [_loss("loss_rise", onset=500), router])
    assert strict.open.family == "unattributed"


@pytest.mark.parametrize("family", ["fa_precision", "router_instability"])
def test_a_collapse_that_begins_after_the_loss_jumped_is_a_consequence(family):
    """A data shift jumps the loss at 900; the model relearns and a mechanism collapses from
    925 on, before the block's controls fire (evaluation seed 100): no fa_precision, no
    router_instability, even though the jump is well inside ``consequence_lag``."""
    att = Attributor(RunContext(run_name="r"))
    jump = [_loss("loss_rise", onset=900), _loss("loss_spike", onset=900)]
    att.update(910, jump)
    mech = _alert("mech", family, onset=925, fired=930)
    events = att.update(930, [*jump, mech])
    assert att.open.family == "unattributed" and [e.kind for e in events] == ["updated"]
    assert {e.rule: e.consequence for e in att.open.evidence}["mech"] is True
    # The same collapse after a gradual rise of the loss is a cause (see above) ...
    gradual = Attributor(RunContext(run_name="r"))
    gradual.update(910, jump[:1])
    gradual.update(930, [jump[0], mech])
    assert gradual.open.family == family
    # ... and so is one that began with the jump or before it.
    for onset in (900, 875):
        early = Attributor(RunContext(run_name="r"))
        early.update(910, jump)
        early.update(930, [*jump, dataclasses.replace(mech, onset_step=onset)])
        assert early.open.family == family, onset


def test_a_mechanism_cause_stays_a_cause_when_the_loss_jumps_later():
    att = Attributor(RunContext(run_name="r"))
    qk = _alert("qk", "fa_precision", onset=600, fired=650)
    att.update(650, [qk])
    att.update(1200, [qk, _loss("loss_spike", onset=1180)])  # the damaged run spikes
    qk_later = _alert("qk", "fa_precision", onset=1190, fired=1210, layer="l1")
    att.update(1210, [qk, _loss("loss_spike", onset=1180), qk_later])
    assert att.open.family == "fa_precision"
    assert all(not e.consequence for e in att.open.evidence if e.rule == "qk")


def test_symptoms_are_held_for_the_wait_so_a_following_mechanism_names_the_first_page():
    """A smaller batch: the gradient norm jumps at 505, the router collapse fires at 550."""
    att = Attributor(RunContext(run_name="r"), symptom_wait=50)
    grad = dataclasses.replace(_loss("grad_norm_spike", 485), metric="grad_norm", fired_step=505)
    assert att.update(505, [grad]) == [] and att.holding and att.open is None
    assert att.update(525, [grad]) == []
    router = _alert("router", "router_instability", 525, fired=550)
    (event,) = att.update(550, [grad, router])
    assert event.kind == "opened" and event.incident.family == "router_instability"
    assert not att.holding


def test_held_symptoms_open_after_the_wait_and_are_forgotten_when_they_clear():
    att = Attributor(RunContext(run_name="r"), symptom_wait=50)
    rise = _loss("loss_rise", 880)  # fired at 900
    assert att.update(900, [rise]) == [] and att.update(949, [rise]) == []
    (event,) = att.update(950, [rise])
    assert event.kind == "opened" and event.incident.family == "unattributed"
    assert event.incident.opened_step == 950
    # A symptom that clears while held is still paged: opened and resolved when it clears.
    other = Attributor(RunContext(run_name="r"), symptom_wait=50)
    other.update(900, [rise])
    events = other.update(925, [])
    assert [e.kind for e in events] == ["opened", "resolved"] and not other.holding
    assert [e.rule for e in events[0].incident.evidence] == ["loss_rise"]
    # One that clears while another holds on stays evidence of the incident that opens.
    spike = dataclasses.replace(_loss("loss_spike", 1000), fired_step=1010)
    assert other.update(1010, [spike]) == [] and other.held_since == 1010
    grad = dataclasses.replace(_loss("grad_norm_spike", 1015), metric="grad_norm")
    assert other.update(1035, [grad]) == [] and other.held_since == 1010
    # The hold survives a restart.
    restored = Attributor(RunContext(run_name="r"), symptom_wait=50)
    restored.load_state_dict(json.loads(json.dumps(other.state_dict())))
    assert restored.holding and restored.held_since == 1010
    (opened,) = restored.update(1060, [grad])
    assert opened.kind == "opened" and opened.incident.opened_step == 1060
    assert {e.rule for e in opened.incident.evidence} == {"loss_spike", "grad_norm_spike"}


def test_critical_symptoms_and_mechanisms_open_at_once():
    nan = dataclasses.replace(_loss("loss_nonfinite", 700), severity="critical")
    att = Attributor(RunContext(run_name="r"), symptom_wait=50)
    assert [e.kind for e in att.update(720, [nan])] == ["opened"]
    qk = Attributor(RunContext(run_name="r"), symptom_wait=50)
    assert [e.kind for e in qk.update(650, [_alert("qk", "fa_precision", 600, fired=650)])] == [
        "opened"
    ]
    assert Attributor(RunContext(run_name="r")).update(900, [_loss("loss_rise", 880)])  # wait 0
