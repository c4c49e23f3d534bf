"""The rule engine: series -> reduced values -> detectors -> a Prometheus-style alert state
machine, counted in evaluations (samples) and steps.

For each rule, ``evaluate(step, now)`` reads the points that arrived in the store since the
rule's cursors, groups them by the labels that ``reduce.over`` keeps (the alert's identity, with
the rule name), reduces the values of each group per step, feeds each reduced value to the
group's own detector, and advances the group's alert through its lifecycle (inactive -> pending
-> firing -> inactive; ``agent.rules.alerts`` has the state machine and its exact timing). The
condition is the detector's ``triggered``; for a rule with ``requires``, also each second
signal's detector triggered within its ``within`` steps before that point (with ``every``: at
each of its evaluations there), for labels that agree; for a rule with ``unless``, none of those
signals did (a second signal reads its own metric with the rule's match and reduce, just before
the rule's own, and opens no alert of its own). One value fed is one evaluation, so a metric
logged every step and a monitor that reports every 100 steps both count ``for: 3`` in their own
samples; ``for: "500 steps"`` counts training steps between the pending step and now.

Reading: every point is fed once (the store's cursors), in arrival order: steps that go
backwards (after a rollback) are fed, and so is a later point at a step already fed (the
watchdog's ``seconds_since_step`` while a run hangs at one step). Producers should
``store.extend`` all series of one step at once, so that a reduction sees all of them.

Errors: a rule whose detector raises (or whose data cannot be read) is marked unhealthy with
its last error and the offending value is skipped; the other rules keep running. ``health``
reflects the latest evaluation that had new data for the rule (healthy again after a clean
one). ``take_problems()`` reports each rule once per kind of error (exception class), so a
rule that fails on every other value is reported once, not every evaluation.

Time is passed in (``now``), never read from a clock here.
"""

from __future__ import annotations

import dataclasses
import json
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from agent.detectors import DetectorProtocol
from agent.rules.alerts import (
    FIRING,
    Alert,
    AlertTransition,
    Labels,
    advance,
    alert_state,
    load_alert_state,
)
from agent.rules.detector_catalog import DetectorCatalog, default_detector_catalog
from agent.rules.reduce import reduce_values
from agent.rules.ruleset import Rule, RuleSet

if TYPE_CHECKING:
    from agent.rules.schema import ReduceSpec, RequiresSpec
    from agent.store import SeriesStore

__all__ = ["Alert", "AlertTransition", "RuleEngine", "RuleHealth", "RuleProblem"]

STATE_VERSION = 1


@dataclass
class RuleHealth:
    ok: bool = True
    last_error: str | None = None
    error_count: int = 0  # errors ever seen
    last_error_step: int | None = None  # eval step of the last error


@dataclass(frozen=True)
class RuleProblem:
    """A rule that just turned unhealthy."""

    rule: str
    error: str
    step: int


@dataclass
class _Group:
    detector: DetectorProtocol
    alert: Alert
    last_fed_step: int | None = None


# Steps at which a second signal triggered (and, for ``every``, did not), kept per group (the
# newest; enough for any batch of points read at once at the agent's cadences).
_TRIGGERED_KEPT = 64


@dataclass
class _ConditionGroup:
    """One group of a rule's second signal (``requires`` or ``unless``): its detector and at
    which of its evaluations it triggered or not."""

    detector: DetectorProtocol
    triggered: deque[int] = field(default_factory=lambda: deque(maxlen=_TRIGGERED_KEPT))
    missed: deque[int] = field(default_factory=lambda: deque(maxlen=_TRIGGERED_KEPT))

    def held(self, step: int, within: int, every: bool) -> bool:
        """Triggered at an evaluation within ``within`` steps up to ``step``; with ``every``,
        also at each of them (none missed)."""
        if not any(0 <= step - t <= within for t in self.triggered):
            return False
        return not every or not any(0 <= step - t <= within for t in self.missed)

    def forget_from(self, step: int) -> None:
        """A rollback to ``step``: the evaluations from there on were an abandoned future."""
        for steps in (self.triggered, self.missed):
            while steps and steps[-1] >= step:
                steps.pop()


@dataclass
class _Condition:
    """One second signal of a rule: its spec, whether it vetoes (``unless``), its cursors and
    groups, read like the rule's own."""

    spec: RequiresSpec
    veto: bool
    cursors: dict[Labels, int] = field(default_factory=dict)
    groups: dict[Labels, _ConditionGroup] = field(default_factory=dict)

    def held(self, labels: Labels, step: int) -> bool:
        """Its signal held at ``step`` in a group whose labels agree with ``labels`` (on the
        names both carry)."""
        mine = dict(labels)
        return any(
            group.held(step, self.spec.within, self.spec.every)
            for other, group in self.groups.items()
            if all(mine.get(k, v) == v for k, v in other)
        )


@dataclass
class _RuleRuntime:
    rule: Rule
    cursors: dict[Labels, int] = field(default_factory=dict)
    seen_version: int = -1
    groups: dict[Labels, _Group] = field(default_factory=dict)
    matched: dict[Labels, bool] = field(default_factory=dict)  # matcher results, cached
    # The second signals (``requires``, then ``unless``), in the rule's order.
    conditions: list[_Condition] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.conditions:
            self.conditions = [_Condition(s, veto) for s, veto in self.rule.second_signals]

    def accepts(self, labels: Labels) -> bool:
        hit = self.matched.get(labels)
        if hit is None:
            hit = self.matched[labels] = self.rule.matcher.matches(labels)
        return hit


class RuleEngine:
    """Evaluates a RuleSet against a SeriesStore (see the module docstring)."""

    def __init__(
        self, ruleset: RuleSet, store: SeriesStore, *, detectors: DetectorCatalog | None = None
    ) -> None:
        self.ruleset = ruleset
        self.store = store
        self._catalog = detectors or ruleset.detectors or default_detector_catalog()
        self._runtimes = {r.name: _RuleRuntime(r) for r in ruleset if r.enabled}
        self._health = {r.name: RuleHealth() for r in ruleset}
        self._problems: list[RuleProblem] = []
        self._reported: set[tuple[str, str]] = set()  # (rule, exception class) already reported
        self._store_epoch = store.epoch

    # ----- evaluation -----

    def evaluate(self, step: int, now: float) -> list[AlertTransition]:
        """Consume new points, update detectors and alerts; return the state changes."""
        if self.store.epoch != self._store_epoch:  # the store was replaced: start reading over
            self._store_epoch = self.store.epoch
            for runtime in self._runtimes.values():
                runtime.cursors.clear()
                for condition in runtime.conditions:
                    condition.cursors.clear()
                runtime.seen_version = -1
        transitions: list[AlertTransition] = []
        for runtime in self._runtimes.values():
            version = self.store.version(runtime.rule.metric)
            if version == runtime.seen_version:
                continue  # nothing new for this metric: the common, cheap path
            runtime.seen_version = version
            errors: list[str] = []
            for condition in runtime.conditions:
                self._read_condition(runtime, condition, errors)
            try:
                new, advanced = self.store.read_new(
                    runtime.rule.metric, runtime.accepts, runtime.cursors
                )
                runtime.cursors.update(advanced)
                batches = _reduce_by_group(runtime.rule.reduce, new)
            except Exception as e:  # bad data must not stop the other rules
                errors.append(_describe_error(e))
                batches = {}
            for group_labels, points in batches.items():
                for point_step, value in points:
                    try:
                        self._feed(runtime, group_labels, point_step, value, step, now, transitions)
                    except Exception as e:
                        errors.append(_describe_error(e))
            if batches or errors:
                self._record_health(runtime.rule.name, errors, step)
        return transitions

    def _feed(
        self,
        runtime: _RuleRuntime,
        group_labels: Labels,
        step: int,
        value: float,
        eval_step: int,
        now: float,
        out: list[AlertTransition],
    ) -> None:
        if step < runtime.rule.spec.start_step:
            return  # the rule does not look at the early phase
        group = runtime.groups.get(group_labels)
        if group is None:
            group = runtime.groups[group_labels] = self._new_group(runtime.rule, group_labels)
        detector = group.detector
        detector.update(step, value)
        group.last_fed_step = step
        alert = group.alert
        alert.value = value
        alert.step = step
        alert.baseline = detector.baseline
        alert.statistic = detector.statistic
        alert.direction = detector.direction
        condition = bool(detector.triggered) and all(
            c.held(group_labels, step) != c.veto for c in runtime.conditions
        )
        advance(runtime.rule, alert, condition, detector.onset_step, step, eval_step, now, out)

    def _read_condition(
        self, runtime: _RuleRuntime, condition: _Condition, errors: list[str]
    ) -> None:
        """Feed one second signal of the rule everything new, per group."""
        spec = condition.spec
        try:
            new, advanced = self.store.read_new(spec.metric, runtime.accepts, condition.cursors)
            condition.cursors.update(advanced)
            reduce = spec.reduce if spec.reduce is not None else runtime.rule.reduce
            batches = _reduce_by_group(reduce, new)
        except Exception as e:
            errors.append(_describe_error(e))
            return
        for group_labels, points in batches.items():
            group = condition.groups.get(group_labels)
            if group is None:
                detector = self._catalog.build(spec.detector.type, spec.detector.params)
                group = condition.groups[group_labels] = _ConditionGroup(detector)
            for point_step, value in points:
                if point_step < runtime.rule.spec.start_step:
                    continue
                group.forget_from(point_step)
                try:
                    triggered = group.detector.update(point_step, value).triggered
                except Exception as e:
                    errors.append(_describe_error(e))
                    continue
                (group.triggered if triggered else group.missed).append(point_step)

    def _new_group(self, rule: Rule, group_labels: Labels) -> _Group:
        detector = self._catalog.build(rule.detector.type, rule.detector.params)
        alert = Alert(
            rule=rule.name,
            labels=group_labels,
            metric=rule.metric,
            family=rule.family,
            severity=rule.severity,
            actions=rule.actions,
            summary_template=rule.spec.summary,
            suggest_template=rule.spec.suggest,
            abrupt=bool(getattr(detector, "abrupt", False)),
        )
        return _Group(detector, alert)

    def _record_health(self, rule: str, errors: list[str], step: int) -> None:
        health = self._health[rule]
        if not errors:
            health.ok = True
            return
        kind = errors[-1].split(":", 1)[0]  # the exception class
        if (rule, kind) not in self._reported:
            self._reported.add((rule, kind))
            self._problems.append(RuleProblem(rule, errors[-1], step))
        health.ok = False
        health.last_error = errors[-1]
        health.error_count += len(errors)
        health.last_error_step = step

    # ----- queries -----

    @property
    def health(self) -> dict[str, RuleHealth]:
        return {name: dataclasses.replace(h) for name, h in self._health.items()}

    def take_problems(self) -> list[RuleProblem]:
        """Rules that turned unhealthy since the last call (each reported once)."""
        problems, self._problems = self._problems, []
        return problems

    def alerts(self, state: str | None = None) -> list[Alert]:
        """Live alert objects (all, or those in ``state``), in rule order."""
        return [
            group.alert
            for runtime in self._runtimes.values()
            for group in runtime.groups.values()
            if state is None or group.alert.state == state
        ]

    def firing(self) -> list[Alert]:
        return self.alerts(FIRING)

    def alert(self, rule: str, labels: Iterable[tuple[str, str]] = ()) -> Alert | None:
        runtime = self._runtimes.get(rule)
        group = runtime.groups.get(tuple(sorted(labels))) if runtime else None
        return group.alert if group else None

    def detector(
        self, rule: str, labels: Iterable[tuple[str, str]] = ()
    ) -> DetectorProtocol | None:
        """The detector behind one alert (for inspection and plots)."""
        runtime = self._runtimes.get(rule)
        group = runtime.groups.get(tuple(sorted(labels))) if runtime else None
        return group.detector if group else None

    # ----- persistence -----

    def state_dict(self) -> dict[str, Any]:
        """JSON-serializable: cursors, detector states and alert states of every rule."""
        rules = {}
        for name, runtime in self._runtimes.items():
            rules[name] = {
                "fingerprint": _fingerprint(runtime.rule),
                "cursors": [[_pairs(labels), n] for labels, n in runtime.cursors.items()],
                "groups": [
                    {
                        "labels": _pairs(labels),
                        "last_fed_step": group.last_fed_step,
                        "detector": group.detector.state_dict(),
                        "alert": alert_state(group.alert),
                    }
                    for labels, group in runtime.groups.items()
                ],
            }
            if runtime.conditions:
                rules[name]["conditions"] = [_condition_state(c) for c in runtime.conditions]
        return {"version": STATE_VERSION, "store_epoch": self._store_epoch, "rules": rules}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()``. A firing alert stays firing without a new transition.
        Rules that are gone are ignored; a rule whose metric, match, reduce or detector
        changed starts fresh; a rule whose saved state cannot be restored starts fresh and
        is reported through ``take_problems()``."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(
                f"rule engine state has version {state.get('version')!r}, expected {STATE_VERSION}"
            )
        same_store = state.get("store_epoch") == self.store.epoch
        for name, runtime in self._runtimes.items():
            saved = state.get("rules", {}).get(name)
            fresh = _RuleRuntime(runtime.rule)
            if saved is not None and saved.get("fingerprint") == _fingerprint(runtime.rule):
                try:
                    fresh = self._restore_runtime(runtime.rule, saved, same_store)
                except Exception as e:
                    self._problems.append(
                        RuleProblem(name, f"cannot restore state: {_describe_error(e)}", -1)
                    )
                    fresh = _RuleRuntime(runtime.rule)
            self._runtimes[name] = fresh
        self._store_epoch = self.store.epoch

    def _restore_runtime(self, rule: Rule, saved: dict[str, Any], same_store: bool) -> _RuleRuntime:
        runtime = _RuleRuntime(rule)
        if same_store:
            runtime.cursors = {_labels(pairs): int(n) for pairs, n in saved["cursors"]}
        for entry in saved["groups"]:
            labels = _labels(entry["labels"])
            group = self._new_group(rule, labels)
            group.detector.load_state_dict(entry["detector"])
            group.last_fed_step = entry["last_fed_step"]
            load_alert_state(group.alert, entry["alert"])
            runtime.groups[labels] = group
        # states saved before 2026-12-07 hold the one ``requires`` signal under "condition"
        old = [saved["condition"]] if "condition" in saved else []
        saved_conditions = saved.get("conditions", old)
        for condition, state in zip(runtime.conditions, saved_conditions, strict=False):
            spec = condition.spec
            if same_store:
                condition.cursors = {_labels(pairs): int(n) for pairs, n in state["cursors"]}
            for entry in state["groups"]:
                detector = self._catalog.build(spec.detector.type, spec.detector.params)
                detector.load_state_dict(entry["detector"])
                group = _ConditionGroup(detector)
                group.triggered.extend(int(t) for t in entry["triggered"])
                group.missed.extend(int(t) for t in entry.get("missed", ()))
                condition.groups[_labels(entry["labels"])] = group
        return runtime


def _condition_state(condition: _Condition) -> dict[str, Any]:
    return {
        "cursors": [[_pairs(labels), n] for labels, n in condition.cursors.items()],
        "groups": [
            {
                "labels": _pairs(labels),
                "detector": group.detector.state_dict(),
                "triggered": list(group.triggered),
                "missed": list(group.missed),
            }
            for labels, group in condition.groups.items()
        ],
    }


def _reduce_by_group(
    reduce: ReduceSpec | None, new: dict[Labels, list[tuple[int, float]]]
) -> dict[Labels, list[tuple[int, float]]]:
    """New points per series -> (step, reduced value) per alert group, in arrival order."""
    over = None if reduce is None or reduce.over is None else frozenset(reduce.over)
    by_group: dict[Labels, dict[int, list[float]]] = {}
    for labels, points in new.items():
        if reduce is None:
            group_labels = labels
        elif over is None:
            group_labels = ()
        else:
            group_labels = tuple(pair for pair in labels if pair[0] not in over)
        by_step = by_group.setdefault(group_labels, {})
        for step, value in points:
            by_step.setdefault(step, []).append(value)
    result: dict[Labels, list[tuple[int, float]]] = {}
    for group_labels, by_step in by_group.items():
        if reduce is None:  # one series per group; a step logged twice keeps the last value
            result[group_labels] = [(step, values[-1]) for step, values in by_step.items()]
        else:
            result[group_labels] = [
                (step, reduce_values(reduce.op, values, reduce.q))
                for step, values in by_step.items()
            ]
    return result


def _fingerprint(rule: Rule) -> str:
    """What a rule's saved detector state depends on."""
    return json.dumps(
        {
            "metric": rule.metric,
            "match": rule.matcher.as_mapping(),
            "reduce": None if rule.reduce is None else rule.reduce.model_dump(),
            "detector": {"type": rule.detector.type, **rule.detector.params},
            **_signals_fingerprint(rule),
        },
        sort_keys=True,
        default=str,
    )


def _signals_fingerprint(rule: Rule) -> dict[str, Any]:
    """The second signals' part: absent without them; one ``requires`` mapping as before
    (fingerprints saved before lists, ``unless`` and ``every`` existed stay valid)."""
    out: dict[str, Any] = {}
    for key, specs in (("requires", rule.spec.requires), ("unless", rule.spec.unless)):
        if isinstance(specs, list):
            out[key] = [_signal_fingerprint(spec) for spec in specs]
        elif specs is not None:
            out[key] = _signal_fingerprint(specs)
    return out


def _signal_fingerprint(spec: RequiresSpec) -> dict[str, Any]:
    """One second signal; ``reduce`` and ``every`` only when set (so a state saved before
    they existed stays valid)."""
    unset = {name for name in ("reduce", "every") if not getattr(spec, name)}
    return spec.model_dump(mode="json", exclude=unset or None)


def _pairs(labels: Labels) -> list[list[str]]:
    return [list(pair) for pair in labels]


def _labels(pairs: Iterable[Iterable[str]]) -> Labels:
    return tuple(sorted((str(k), str(v)) for k, v in pairs))


def _describe_error(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"
