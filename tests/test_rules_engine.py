"""The rule engine: lifecycle, reduction, matching, broken rules, state round trip."""

from __future__ import annotations

import json
import math

import pytest
from pydantic import BaseModel, ConfigDict

from agent.detectors import DETECTORS, build_detector
from agent.rules import DetectorCatalog, RuleEngine, load_rule_text
from agent.samples import Sample
from agent.store import SeriesStore


class LevelDetector:
    """Fake detector: triggered while value > level; raises on ``raise_on``; records values."""

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid")
        level: float = 0.0
        raise_on: float | None = None

    def __init__(self, params: dict) -> None:
        self.params = self.Params.model_validate(params)
        self.fed: list[tuple[int, float]] = []
        self.run_start: int | None = None

    def update(self, step: int, value: float) -> LevelDetector:
        if value == self.params.raise_on:
            raise RuntimeError(f"boom at step {step}")
        self.fed.append((step, value))
        if value > self.params.level:
            self.run_start = step if self.run_start is None else self.run_start
        else:
            self.run_start = None
        return self

    triggered = property(lambda self: self.run_start is not None)
    onset_step = property(lambda self: self.run_start)
    baseline = property(lambda self: self.params.level)
    statistic = property(lambda self: self.fed[-1][1] if self.fed else None)
    direction = property(lambda self: "rising" if self.triggered else None)
    ready = True

    def reset(self) -> None:
        self.run_start = None

    def state_dict(self) -> dict:
        return {"fed": self.fed, "run_start": self.run_start}

    def load_state_dict(self, state: dict) -> None:
        self.fed = [tuple(p) for p in state["fed"]]
        self.run_start = state["run_start"]


def build(type_name: str, params: dict):
    return LevelDetector(params) if type_name == "level" else build_detector(type_name, params)


CATALOG = DetectorCatalog(types={"level": LevelDetector, **DETECTORS}, build=build)


def make_rules(body: str) -> str:
    return "groups:\n  - name: g\n    rules:\n" + body


def rule_text(name: str, metric: str, detector: str, **fields: str) -> str:
    lines = [
        f"      - name: {name}",
        f"        metric: {metric}",
        f"        detector: {detector}",
        "        severity: critical",
        "        family: fa_precision",
    ]
    lines += [f"        {key.rstrip('_')}: {value}" for key, value in fields.items()]
    return "\n".join(lines) + "\n"


def engine_for(*rules: str, store: SeriesStore | None = None) -> tuple[RuleEngine, SeriesStore]:
    ruleset = load_rule_text(make_rules("".join(rules)), "t.yaml", detectors=CATALOG)
    store = store or SeriesStore()
    return RuleEngine(ruleset, store), store


# (step, value, expected state after it, transition kind or None)
LIFECYCLE = [
    (0, 1.0, "inactive", None),
    (1, 3.0, "pending", "pending"),
    (2, 1.5, "inactive", "cancelled"),  # condition stopped before `for`
    (3, 3.0, "pending", "pending"),
    (4, 3.0, "pending", None),  # held 1 of 2
    (5, 3.0, "firing", "firing"),  # held 2 = for
    (6, 1.5, "firing", None),  # 1 false evaluation: not more than keep_firing_for
    (7, 1.5, "firing", None),  # 2 > keep_firing_for, but clear (below 1.0) does not hold
    (8, 3.0, "firing", None),  # condition back: the count starts over
    (9, 0.5, "firing", None),
    (10, 0.5, "inactive", "resolved"),  # 2 > 1 and value < 1.0
    (11, 3.0, "pending", "pending"),
    (12, 3.0, "pending", None),
    (13, 3.0, "firing", "firing"),  # the rule's cooldown paces its actions, not the alert
    (14, 3.0, "firing", None),
]


def test_lifecycle_with_for_keep_firing_for_and_clear():
    engine, store = engine_for(
        rule_text(
            "hot",
            "loss",
            "{type: threshold, above: 2.0}",
            for_="2",
            keep_firing_for="1",
            clear="{below: 1.0}",
            cooldown="4",
            summary='"{rule} {value:.1f} onset {onset_step} fired {fired_step} '
            'base {baseline:.2f}"',
        )
    )
    seen = []
    for step, value, state, kind in LIFECYCLE:
        store.append(Sample.make(step, "loss", value))
        transitions = engine.evaluate(step, now=100.0 + step)
        assert [t.kind for t in transitions] == ([kind] if kind else []), step
        (alert,) = engine.alerts()
        assert alert.state == state, step
        seen += transitions
    firing = [t for t in seen if t.kind == "firing"]
    assert [(t.step, t.alert.fired_step, t.alert.onset_step) for t in firing] == [
        (5, 5, 3),
        (13, 13, 11),
    ]
    resolved = next(t for t in seen if t.kind == "resolved")
    assert (resolved.alert.resolved_step, resolved.alert.resolved_time) == (10, 110.0)
    assert resolved.from_state == "firing" and resolved.to_state == "inactive"
    assert firing[0].alert.summary == "hot 3.0 onset 3 fired 5 base n/a"
    assert firing[0].alert.fired_time == 105.0 and firing[0].eval_step == 5


def test_for_and_keep_firing_for_in_steps_for_a_sparse_monitor():
    engine, store = engine_for(
        rule_text(
            "sparse",
            "qk_delta2_entropy",
            "{type: threshold, below: 1.0}",
            for_='"20 steps"',
            keep_firing_for='"10 steps"',
        )
    )
    values = {0: 2.0, 10: 2.0, 20: 2.0, 30: 0.5, 40: 0.5, 50: 0.5, 60: 2.0, 70: 2.0}
    kinds = {}
    for step in range(0, 80):  # evaluated every step, data every 10 steps
        if step in values:
            store.append(Sample.make(step, "qk_delta2_entropy", values[step]))
        for t in engine.evaluate(step, float(step)):
            kinds[t.step] = t.kind
    # pending at 30, fires at 50 (50 - 30 >= 20), resolves at 70 (70 - 50 > 10, not at 60)
    assert kinds == {30: "pending", 50: "firing", 70: "resolved"}


def test_for_counts_samples_of_each_series_not_evaluate_calls():
    engine, store = engine_for(
        rule_text("loss_hot", "loss", "{type: threshold, above: 2.0}", for_="2"),
        rule_text("entropy_low", "router_entropy", "{type: threshold, below: 1.0}", for_="2"),
    )
    fired = {}
    for step in range(60):
        batch = [Sample.make(step, "loss", 3.0 if step >= 5 else 1.0)]
        if step % 10 == 0:
            batch.append(
                Sample.make(step, "router_entropy", 0.5 if step >= 20 else 2.0, router="r")
            )
        store.extend(batch)
        for t in engine.evaluate(step, float(step)):
            if t.kind == "firing":
                fired[t.rule] = t.step
    assert fired == {"loss_hot": 7, "entropy_low": 40}  # 3rd sample of each series


@pytest.mark.parametrize(
    ("reduce", "expected"),
    [
        ("{op: min, over: [head]}", {"a": 1.0, "b": 10.0}),
        ("{op: max, over: [head]}", {"a": 4.0, "b": 40.0}),
        ("{op: mean, over: [head]}", {"a": 2.5, "b": 25.0}),
        ("{op: median, over: [head]}", {"a": 2.5, "b": 25.0}),
        ("{op: sum, over: [head]}", {"a": 10.0, "b": 100.0}),
        ("{op: quantile, q: 0.25, over: [head]}", {"a": 1.75, "b": 17.5}),
        ("{op: quantile, q: 1.0, over: [head]}", {"a": 4.0, "b": 40.0}),
    ],
)
def test_reduce_ops_per_group(reduce, expected):
    engine, store = engine_for(
        rule_text("r", "qk_delta2_entropy", "{type: level, level: 1000}", reduce=reduce)
    )
    store.extend(
        Sample.make(10, "qk_delta2_entropy", scale * h, layer=layer, head=h)
        for layer, scale in (("a", 1.0), ("b", 10.0))
        for h in (4, 2, 1, 3)
    )
    engine.evaluate(10, 0.0)
    got = {a.label_dict["layer"]: a.value for a in engine.alerts()}
    assert got == pytest.approx(expected)
    assert all(a.labels == (("layer", a.label_dict["layer"]),) for a in engine.alerts())


def test_reduce_over_all_labels_nan_propagation_and_no_reduce():
    engine, store = engine_for(
        rule_text("all", "m", "{type: level, level: 1000}", reduce="{op: max}"),
        rule_text("each", "m", "{type: level, level: 1000}"),
    )
    store.extend(Sample.make(1, "m", v, layer=f"l{i}") for i, v in enumerate([1.0, 5.0]))
    store.extend(Sample.make(2, "m", v, layer=f"l{i}") for i, v in enumerate([1.0, math.nan]))
    engine.evaluate(2, 0.0)
    (whole,) = [a for a in engine.alerts() if a.rule == "all"]
    assert whole.labels == () and math.isnan(whole.value)
    detector = engine.detector("all")
    assert detector.fed[0] == (1, 5.0) and math.isnan(detector.fed[1][1])
    each = {a.label_dict["layer"]: a.value for a in engine.alerts() if a.rule == "each"}
    assert each["l0"] == 1.0 and math.isnan(each["l1"])


def test_label_matching_glob_regex_and_missing_label():
    engine, store = engine_for(
        rule_text("glob", "m", "{type: level, level: 1000}", match='{layer: "*.attn"}'),
        rule_text("regex", "m", "{type: level, level: 1000}", match='{layer: "~l[12]\\\\..*"}'),
    )
    store.extend(
        [
            Sample.make(1, "m", 1.0, layer="l1.attn"),
            Sample.make(1, "m", 2.0, layer="l2.mlp"),
            Sample.make(1, "m", 3.0, layer="l3.attn"),
            Sample.make(1, "m", 4.0, router="l1.attn"),  # no layer label: never matches
        ]
    )
    engine.evaluate(1, 0.0)
    by_rule = {}
    for a in engine.alerts():
        by_rule.setdefault(a.rule, set()).add(a.label_dict["layer"])
    assert by_rule == {"glob": {"l1.attn", "l3.attn"}, "regex": {"l1.attn", "l2.mlp"}}


def test_a_broken_rule_is_reported_once_and_the_others_keep_running():
    engine, store = engine_for(
        rule_text("broken", "loss", "{type: level, level: 2.0, raise_on: 13.0}"),
        rule_text("healthy", "loss", "{type: threshold, above: 2.0}"),
    )
    kinds = []
    for step, value in enumerate([1.0, 13.0, 3.0, 13.0, 13.0, 1.0]):
        store.append(Sample.make(step, "loss", value))
        kinds += [(t.rule, t.kind, t.step) for t in engine.evaluate(step, 0.0)]
        problems = engine.take_problems()
        if step == 1:
            assert [(p.rule, p.error, p.step) for p in problems] == [
                ("broken", "RuntimeError: boom at step 1", 1)
            ]
        else:
            assert problems == [], step
        if step == 4:
            health = engine.health["broken"]
            assert not health.ok and health.error_count == 3 and health.last_error_step == 4
            assert health.last_error == "RuntimeError: boom at step 4"
    assert ("healthy", "firing", 1) in kinds and ("healthy", "resolved", 5) in kinds
    assert ("broken", "firing", 2) in kinds  # the value after the bad one is still evaluated
    assert engine.health["broken"].ok and engine.health["healthy"].ok  # step 5 was clean


def test_a_detector_that_cannot_be_built_marks_the_rule_unhealthy():
    def failing_build(type_name: str, params: dict):
        if params.get("level") == 7.0:
            raise ValueError("no detector for you")
        return LevelDetector(params)

    catalog = DetectorCatalog(types={"level": LevelDetector}, build=failing_build)
    ruleset = load_rule_text(
        make_rules(
            rule_text("bad", "loss", "{type: level, level: 7.0}")
            + rule_text("good", "loss", "{type: level, level: 2.0}")
        ),
        detectors=catalog,
    )
    store = SeriesStore()
    engine = RuleEngine(ruleset, store)
    store.append(Sample.make(0, "loss", 5.0))
    assert [t.rule for t in engine.evaluate(0, 0.0)] == ["good", "good"]  # pending, firing
    assert [p.error for p in engine.take_problems()] == ["ValueError: no detector for you"]


def test_state_round_trip_keeps_a_firing_alert_firing_without_a_new_page():
    rule = rule_text(
        "hot", "loss", "{type: level, level: 2.0}", for_="1", keep_firing_for="1", cooldown="10"
    )
    engine, store = engine_for(rule)
    for step, value in enumerate([1.0, 3.0, 3.0, 3.0]):
        store.append(Sample.make(step, "loss", value))
        engine.evaluate(step, 0.0)
    (alert,) = engine.firing()
    assert (alert.fired_step, alert.onset_step) == (2, 1)
    state = json.loads(json.dumps(engine.state_dict(), allow_nan=False))

    # Same process, same store: cursors continue, nothing is re-read.
    same, _ = engine_for(rule, store=store)
    same.load_state_dict(state)
    assert same.evaluate(4, 0.0) == []
    (restored,) = same.firing()
    assert (restored.fired_step, restored.onset_step, restored.held) == (2, 1, 1)
    assert same.detector("hot").fed == [(0, 1.0), (1, 3.0), (2, 3.0), (3, 3.0)]

    # A restarted run: a fresh store, new samples only.
    restarted, new_store = engine_for(rule)
    restarted.load_state_dict(state)
    kinds = []
    for step, value in [(4, 3.0), (5, 1.0), (6, 1.0)]:
        new_store.append(Sample.make(step, "loss", value))
        kinds += [(t.kind, t.step) for t in restarted.evaluate(step, 0.0)]
    assert kinds == [("resolved", 6)]
    assert restarted.alerts()[0].resolved_step == 6


def test_state_of_a_changed_rule_is_dropped():
    engine, store = engine_for(rule_text("hot", "loss", "{type: level, level: 2.0}"))
    store.append(Sample.make(0, "loss", 3.0))
    engine.evaluate(0, 0.0)
    state = engine.state_dict()
    changed, _ = engine_for(rule_text("hot", "loss", "{type: level, level: 5.0}"), store=store)
    changed.load_state_dict(state)
    assert changed.alerts() == []
    with pytest.raises(ValueError, match="rule engine state has version 99, expected 1"):
        changed.load_state_dict({"version": 99})


def test_points_fed_once_disabled_rules_skipped_and_evidence():
    engine, store = engine_for(
        rule_text(
            "hot",
            "loss",
            "{type: level, level: 2.0}",
            summary='"{metric} at {value:.2f} on {labels[rank]} since {onset_step}"',
            suggest='"lower the LR ({labels[missing]})"',
            actions="[page, {rollback: {margin_steps: 100}}]",
        ),
        rule_text("off", "loss", "{type: level, level: 0.0}", enabled="false"),
    )
    store.extend([Sample.make(3, "loss", 2.5, rank=0), Sample.make(3, "loss", 2.7, rank=0)])
    engine.evaluate(3, 0.0)
    store.append(Sample.make(3, "loss", 9.0, rank=0))  # a later point at the same step is fed
    engine.evaluate(3, 0.0)
    engine.evaluate(3, 0.0)  # ... once
    (alert,) = engine.alerts()
    assert engine.detector("hot", alert.labels).fed == [(3, 2.7), (3, 9.0)]
    evidence = alert.to_evidence()
    assert (evidence.rule, evidence.family, evidence.labels) == (
        "hot",
        "fa_precision",
        {"rank": "0"},
    )
    assert (evidence.value, evidence.baseline, evidence.fired_step, evidence.trend) == (
        9.0,
        2.0,
        3,
        "rising",
    )
    assert evidence.summary == "loss at 9.00 on 0 since 3"
    assert evidence.suggest == "lower the LR (n/a)"
    assert evidence.abrupt is False  # a level, not a jump detector (Detector.abrupt)
    assert [str(a) for a in alert.actions] == ["page", "rollback(margin_steps=100)"]
    assert "off" not in {a.rule for a in engine.alerts()}


def test_real_baseline_detector_onset_through_the_engine():
    engine, store = engine_for(
        rule_text(
            "collapse",
            "qk_delta2_entropy",
            "{type: baseline, warmup: 4, direction: drop, rel: 0.5}",
            reduce="{op: mean, over: [head]}",
            for_="1",
            summary='"{labels[layer]} fell to {value:.2f} '
            '(baseline {baseline:.2f}, onset {onset_step})"',
        )
    )
    series = [2.0, 2.1, 1.9, 2.0, 1.4, 0.8, 0.7, 0.6]
    fired = None
    for i, v in enumerate(series):
        step = 10 * i
        store.extend(
            Sample.make(step, "qk_delta2_entropy", v + d, layer="l0", head=h)
            for h, d in ((0, -0.1), (1, 0.1))
        )
        for t in engine.evaluate(step, 0.0):
            if t.kind == "firing":
                fired = t.alert
    assert fired is not None and fired.fired_step == 60
    assert fired.summary == "l0 fell to 0.70 (baseline 2.00, onset 40)"


def test_state_with_nan_values_is_strict_json():
    engine, store = engine_for(rule_text("hot", "loss", "{type: threshold, above: 2.0}"))
    store.append(Sample.make(0, "loss", math.inf))  # +inf is above 2: fires
    store.append(Sample.make(1, "loss", math.nan))  # NaN: neither above nor below
    engine.evaluate(1, 0.0)
    text = json.dumps(engine.state_dict(), allow_nan=False)
    restored, _ = engine_for(rule_text("hot", "loss", "{type: threshold, above: 2.0}"), store=store)
    restored.load_state_dict(json.loads(text))
    (alert,) = restored.alerts()
    assert alert.state == "inactive" and alert.resolved_step == 1 and math.isnan(alert.value)
    assert alert.summary.startswith("loss = nan")


def test_evidence_of_a_jump_detector_says_abrupt():
    """The z-score detector fires on jumps and tracks slow drifts: its evidence on the loss
    tells attribution that the run changed from outside (agent/attribution.py)."""
    engine, store = engine_for(
        rule_text("spike", "loss", "{type: ewma, warmup: 5, z: 4.0, direction: rising}")
    )
    for step, value in enumerate([2.0, 2.1, 1.9, 2.05, 1.95, 2.0, 9.0]):
        store.append(Sample.make(step, "loss", value))
        engine.evaluate(step, 0.0)
    (alert,) = engine.alerts()
    assert alert.state == "firing" and alert.to_evidence().abrupt is True


REQUIRES = (
    "        reduce: {op: mean, over: [head]}\n"
    "        requires:\n"
    "          metric: push\n"
    "          detector: {type: level, level: 1.0}\n"
    "          within: 2\n"
)


def _feed(store: SeriesStore, engine: RuleEngine, step: int, values: dict) -> list:
    for (metric, layer, head), value in values.items():
        labels = {"layer": layer} if head is None else {"layer": layer, "head": head}
        store.append(Sample.make(step, metric, value, **labels))
    return engine.evaluate(step, 0.0)


def test_requires_holds_only_within_its_window_and_for_agreeing_labels():
    """The rule (per layer, mean over heads) fires only while 'push' of the same layer (a
    series without the head label) triggered at most 2 steps before; 'push' opens no alert."""
    engine, store = engine_for(rule_text("hot", "x", "{type: level, level: 2.0}") + REQUIRES)
    pushes = {0: 0.0, 1: 5.0, 2: 0.0, 3: 0.0, 4: 0.0, 5: 0.0}  # layer a pushed at step 1 only
    fired = []
    for step in range(6):
        x = 3.0 if step >= 2 else 0.0  # the rule's own detector triggers from step 2 on
        values = {("x", layer, h): x for layer in "ab" for h in "01"}
        values |= {("push", "a", None): pushes[step], ("push", "b", None): 0.0}
        transitions = _feed(store, engine, step, values)
        fired += [
            (t.kind, t.step, dict(t.alert.labels)) for t in transitions if t.kind != "pending"
        ]
    # Layer a: pushed at 1, so the condition holds at 2 and 3 (within 2 steps) and not at 4.
    assert fired == [
        ("firing", 2, {"layer": "a"}),
        ("resolved", 4, {"layer": "a"}),
    ]
    assert {a.rule for a in engine.alerts()} == {"hot"}  # the second signal has no alert


def _saved_and_restarted(rule: str, step0: dict) -> tuple[dict, RuleEngine, SeriesStore]:
    """Feed ``step0`` at step 0, save the state (strict JSON) and load it into a new engine."""
    engine, store = engine_for(rule)
    _feed(store, engine, 0, step0)
    state = json.loads(json.dumps(engine.state_dict(), allow_nan=False))
    restarted, new_store = engine_for(rule)
    restarted.load_state_dict(state)
    return state, restarted, new_store


def test_requires_state_round_trip_keeps_the_second_signal():
    rule = rule_text("hot", "x", "{type: level, level: 2.0}") + REQUIRES
    state, restarted, new_store = _saved_and_restarted(
        rule, {("x", "a", "0"): 0.0, ("push", "a", None): 5.0}
    )
    kinds = [(t.kind, t.step) for t in _feed(new_store, restarted, 1, {("x", "a", "0"): 3.0})]
    assert kinds == [
        ("pending", 1),
        ("firing", 1),
    ]  # the push of step 0 came through the saved state
    changed = rule.replace("within: 2", "within: 0")
    fresh, fresh_store = engine_for(changed)
    fresh.load_state_dict(state)  # another second signal: its state starts over
    assert _feed(fresh_store, fresh, 1, {("x", "a", "0"): 3.0}) == []


def test_requires_forgets_the_second_signal_of_an_abandoned_future():
    """After a rollback (steps go back), a push measured on the abandoned path no longer
    counts: the collapse at step 3 of the new path needs a push of its own."""
    engine, store = engine_for(rule_text("hot", "x", "{type: level, level: 2.0}") + REQUIRES)
    _feed(store, engine, 2, {("x", "a", "0"): 0.0, ("push", "a", None): 5.0})  # abandoned
    _feed(store, engine, 1, {("x", "a", "0"): 0.0, ("push", "a", None): 0.0})  # rolled back
    assert _feed(store, engine, 3, {("x", "a", "0"): 3.0, ("push", "a", None): 0.0}) == []
    pushed = _feed(store, engine, 4, {("x", "a", "0"): 3.0, ("push", "a", None): 5.0})
    assert [t.kind for t in pushed] == ["pending", "firing"]


REQUIRES_ACROSS_LAYERS = REQUIRES.replace(
    "          within: 2\n",
    "          within: 2\n          reduce: {op: median, over: [layer]}\n",
)


def test_requires_with_its_own_reduce_holds_for_every_alert_only_when_most_are_pushed():
    """``requires.reduce`` over the layers: one second signal, the median push of layers a, b
    and c. One layer pushed alone (step 1) does not count for any alert, even its own; two of
    three pushed (step 3) count for every layer's alert, also the one not pushed."""
    engine, store = engine_for(
        rule_text("hot", "x", "{type: level, level: 2.0}") + REQUIRES_ACROSS_LAYERS
    )
    pushed = {1: {"a"}, 3: {"a", "b"}}
    fired = []
    for step in range(5):
        values = {("x", layer, "0"): 3.0 if step >= 1 else 0.0 for layer in "abc"}
        values |= {("push", layer, None): 0.0 for layer in "abc"}
        values |= {("push", layer, None): 5.0 for layer in pushed.get(step, ())}
        transitions = _feed(store, engine, step, values)
        fired += [
            (t.step, dict(t.alert.labels)["layer"]) for t in transitions if t.kind == "firing"
        ]
    assert fired == [(3, "a"), (3, "b"), (3, "c")]


def test_requires_reduce_is_part_of_the_saved_state_fingerprint_only_when_set():
    """Adding ``requires.reduce`` (an optional key) keeps the states saved before it existed;
    setting it starts the second signal over."""
    rule = rule_text("hot", "x", "{type: level, level: 2.0}") + REQUIRES
    engine, store = engine_for(rule)
    _feed(store, engine, 0, {("x", "a", "0"): 0.0, ("push", "a", None): 5.0})
    state = json.loads(json.dumps(engine.state_dict(), allow_nan=False))
    # The fingerprint of a state saved before the key existed: the second signal's metric,
    # detector and window, nothing else.
    saved = json.loads(state["rules"]["hot"]["fingerprint"])["requires"]
    assert sorted(saved) == ["detector", "metric", "within"]
    same, same_store = engine_for(rule)
    same.load_state_dict(state)
    assert [t.kind for t in _feed(same_store, same, 1, {("x", "a", "0"): 3.0})] == [
        "pending",
        "firing",
    ]
    across, across_store = engine_for(
        rule_text("hot", "x", "{type: level, level: 2.0}") + REQUIRES_ACROSS_LAYERS
    )
    across.load_state_dict(state)
    assert _feed(across_store, across, 1, {("x", "a", "0"): 3.0}) == []


SIGNAL_LIST = (
    "        reduce: {op: mean, over: [head]}\n"
    "        requires:\n"
    "          - metric: held\n"
    "            detector: {type: level, level: 1.0}\n"
    "            within: 2\n"
    "            every: true\n"
    "          - metric: push\n"
    "            detector: {type: level, level: 1.0}\n"
    "            within: 0\n"
    "        unless:\n"
    "          metric: veto\n"
    "          detector: {type: level, level: 1.0}\n"
    "          within: 1\n"
)


def test_a_list_of_signals_every_and_unless_each_decide_the_condition():
    """``requires`` as a list: each must hold; ``every``: 'held' triggered at each of its
    evaluations of the last 2 steps; ``unless``: 'veto' (a series of its own label, agreeing
    with every alert) triggered in the last step blocks it."""
    engine, store = engine_for(rule_text("hot", "x", "{type: level, level: 2.0}") + SIGNAL_LIST)
    fired = []
    for step in range(9):
        store.append(Sample.make(step, "veto", 5.0 if step == 5 else 0.0, group="g"))
        values = {
            ("x", "a", "0"): 3.0,
            ("held", "a", None): 0.0 if step == 1 else 5.0,
            ("push", "a", None): 0.0 if step == 7 else 5.0,
        }
        fired += [
            (t.kind, t.step) for t in _feed(store, engine, step, values) if t.kind != "pending"
        ]
    # 0: 'held' triggered at its only evaluation; 1-3: its miss at 1 lies within 2 steps; 4:
    # held since 2; 5, 6: vetoed (the veto of step 5, within 1 step); 7: no push; 8: all hold.
    assert fired == [
        ("firing", 0),
        ("resolved", 1),
        ("firing", 4),
        ("resolved", 5),
        ("firing", 8),
    ]


def test_signal_lists_round_trip_and_old_single_signal_states_still_load():
    """The state keeps each second signal (a miss of an ``every`` signal included); a state
    saved before lists existed (one ``requires`` under "condition") loads into the same rule."""
    rule = rule_text("hot", "x", "{type: level, level: 2.0}") + SIGNAL_LIST
    _, restarted, new_store = _saved_and_restarted(
        rule, {("x", "a", "0"): 0.0, ("held", "a", None): 0.0}
    )
    step1 = {("x", "a", "0"): 3.0, ("held", "a", None): 5.0, ("push", "a", None): 5.0}
    assert _feed(new_store, restarted, 1, step1) == []  # the miss at 0 came through the state
    step3 = {**step1, ("x", "a", "0"): 3.0}
    assert [t.kind for t in _feed(new_store, restarted, 3, step3)] == ["pending", "firing"]

    single = rule_text("hot", "x", "{type: level, level: 2.0}") + REQUIRES
    old, old_store = engine_for(single)
    _feed(old_store, old, 0, {("x", "a", "0"): 0.0, ("push", "a", None): 5.0})
    saved = json.loads(json.dumps(old.state_dict()))
    entry = saved["rules"]["hot"]
    entry["condition"] = entry.pop("conditions")[0]  # as saved before 2026-12-07
    for group in entry["condition"]["groups"]:
        del group["missed"]
    loaded, loaded_store = engine_for(single)
    loaded.load_state_dict(saved)
    assert [t.kind for t in _feed(loaded_store, loaded, 1, {("x", "a", "0"): 3.0})] == [
        "pending",
        "firing",
    ]
