"""The alert lifecycle (``agent.rules.alerts``) driven directly, without a store or engine."""

from __future__ import annotations

import json
import math

import pytest

from agent.rules import load_rule_text
from agent.rules.alerts import (
    FIRING,
    INACTIVE,
    PENDING,
    Alert,
    AlertTransition,
    advance,
    alert_state,
    load_alert_state,
)
from agent.rules.templates import PLACEHOLDER_EXAMPLES

RULES = """groups:
  - name: g
    rules:
      - name: slow
        metric: loss
        detector: {type: threshold, above: 2.0}
        severity: critical
        family: fa_precision
        for: "30 steps"
        keep_firing_for: "20 steps"
"""


def _alert() -> Alert:
    return Alert(rule="slow", labels=(("layer", "3"),), metric="loss", family="f", severity="s")


def test_for_and_keep_firing_for_count_steps_between_sparse_values() -> None:
    rule = next(iter(load_rule_text(RULES, "t.yaml")))
    alert, out = _alert(), []
    # (step, condition): values every 10 steps; the onset estimate is the pending step.
    for step, condition in [(0, False), (10, True), (20, True), (30, True), (40, True)]:
        advance(rule, alert, condition, None, step, eval_step=step + 5, now=step / 10, out=out)
    assert [(t.kind, t.step, t.eval_step) for t in out] == [("pending", 10, 15), ("firing", 40, 45)]
    assert (alert.state, alert.pending_step, alert.onset_step, alert.fired_time) == (
        FIRING,
        10,
        10,
        4.0,
    )  # fired at 40: 40 - 10 = 30 steps held (at 30 only 20)
    for step, condition in [(50, False), (60, False), (70, False)]:
        advance(rule, alert, condition, None, step, eval_step=step, now=0.0, out=out)
    # last true at 40: at 60, 20 steps passed (not more than 20); at 70, 30 > 20 -> resolved.
    assert [(t.kind, t.step) for t in out[2:]] == [("resolved", 70)]
    assert (alert.state, alert.resolved_step) == (INACTIVE, 70)
    assert out[1].alert.state == FIRING and out[1].alert is not alert  # snapshots


def test_transition_kinds() -> None:
    def kind(from_state: str, to_state: str) -> str:
        return AlertTransition("r", (), from_state, to_state, 0, 0, 0.0, _alert()).kind

    assert kind(INACTIVE, PENDING) == "pending"
    assert kind(PENDING, FIRING) == "firing"
    assert kind(FIRING, INACTIVE) == "resolved"
    assert kind(PENDING, INACTIVE) == "cancelled"


def test_state_round_trip_is_strict_json_with_non_finite_floats() -> None:
    alert = _alert()
    alert.state, alert.value, alert.baseline, alert.statistic = FIRING, math.nan, math.inf, -1.5
    alert.fired_step, alert.fired_time, alert.held = 40, 12.5, 3
    saved = json.loads(json.dumps(alert_state(alert), allow_nan=False))
    assert (saved["value"], saved["baseline"], saved["statistic"]) == ("nan", "inf", -1.5)
    restored = _alert()
    load_alert_state(restored, saved)
    assert restored.state == FIRING and math.isnan(restored.value)
    assert (restored.baseline, restored.statistic, restored.fired_step) == (math.inf, -1.5, 40)
    assert (restored.fired_time, restored.held) == (12.5, 3)


def test_load_refuses_an_unknown_state() -> None:
    saved = alert_state(_alert())
    with pytest.raises(ValueError, match="unknown alert state 'burning'"):
        load_alert_state(_alert(), {**saved, "state": "burning"})
    with pytest.raises(KeyError):
        load_alert_state(_alert(), {k: v for k, v in saved.items() if k != "held"})


def test_template_values_cover_every_placeholder_the_checker_accepts() -> None:
    alert = _alert()
    alert.value, alert.step = 2.5, 7
    values = alert.template_values()
    assert set(values) == {*PLACEHOLDER_EXAMPLES, "labels"}
    assert (values["value"], values["step"], values["labels"]) == (2.5, 7, {"layer": "3"})
