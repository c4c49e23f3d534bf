"""The rule engine: series -> reduced values -> detectors -> a Prometheus-style alert state
machine, counted in evaluations (samples) and steps.

For each rule, ``evaluate(step, now)`` reads the points that arrived in the store since the
rule's cursors, groups them by the labels that ``reduce.over`` keeps (the alert's identity,
with the rule name), reduces the values of each group per step, feeds each reduced value to
the group's own detector, and advances the group's alert:

    inactive --condition true--> pending --held for `for`--> firing
    pending --condition false--> inactive                              ("cancelled")
    firing --condition false for more than `keep_firing_for`, and `clear` holds--> inactive
                                                                       ("resolved")

The condition is the detector's ``triggered``. One value fed is one evaluation, so a metric
logged every step and a monitor that reports every 100 steps both count `for: 3` in their own
samples; ``for: "500 steps"`` counts training steps between the pending step and now.
Exactly: an alert fires at the value where it has held ``for`` evaluations (or steps) since it
became pending (``for: 0`` fires at once), and resolves at the value where more than
``keep_firing_for`` evaluations (or steps) passed since the condition last held.

An alert holds only its lifecycle: how often its actions run and when it is paged again is
pacing's business (``remediations.pacing``), as in Prometheus, where repeats and grouping live
in Alertmanager.

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
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from agent.detectors import DetectorProtocol
from agent.incidents import Evidence
from agent.rules.detector_catalog import DetectorCatalog, default_detector_catalog
from agent.rules.reduce import reduce_values
from agent.rules.ruleset import Rule, RuleSet
from agent.rules.schema import ActionSpec
from agent.rules.templates import render_template

if TYPE_CHECKING:
    from agent.store import SeriesStore

Labels = tuple[tuple[str, str], ...]
STATE_VERSION = 1
INACTIVE, PENDING, FIRING = "inactive", "pending", "firing"


@dataclass
class Alert:
    """One rule's state for one label set. ``summary``/``suggest`` render on access."""

    rule: str
    labels: Labels
    metric: str
    family: str
    severity: str
    actions: tuple[ActionSpec, ...] = ()
    state: str = INACTIVE  # inactive | pending | firing
    value: float | None = None  # latest reduced value fed to the detector
    baseline: float | None = None  # detector's baseline after that value
    statistic: float | None = None  # detector's test statistic after that value
    direction: str | None = None  # detector's direction ("drop", "rise", ...)
    step: int | None = None  # step of the latest value
    onset_step: int | None = None  # detector's onset estimate (pending step if it has none)
    pending_step: int | None = None  # step at which the current episode became pending
    fired_step: int | None = None
    resolved_step: int | None = None
    fired_time: float | None = None  # `now` of the evaluation that fired it
    resolved_time: float | None = None
    held: int = 0  # evaluations the condition has held since the episode became pending
    false_count: int = 0  # evaluations since the condition last held, while firing
    last_true_step: int | None = None  # last step the condition held, while firing
    summary_template: str = field(default="", repr=False)
    suggest_template: str = field(default="", repr=False)

    @property
    def label_dict(self) -> dict[str, str]:
        return dict(self.labels)

    def template_values(self) -> dict[str, Any]:
        return {
            "value": self.value,
            "baseline": self.baseline,
            "statistic": self.statistic,
            "onset_step": self.onset_step,
            "fired_step": self.fired_step,
            "step": self.step,
            "rule": self.rule,
            "metric": self.metric,
            "direction": self.direction,
            "labels": self.label_dict,
        }

    @property
    def summary(self) -> str:
        return render_template(self.summary_template, self.template_values())

    @property
    def suggest(self) -> str:
        return render_template(self.suggest_template, self.template_values())

    @property
    def trend(self) -> str | None:
        """ "falling" or "rising": the detector's direction, else the value against the
        baseline; None when neither says."""
        if self.direction in ("falling", "rising"):
            return self.direction
        if self.value is None or self.baseline is None or self.value == self.baseline:
            return None
        if math.isnan(self.value) or math.isnan(self.baseline):
            return None
        return "falling" if self.value < self.baseline else "rising"

    def to_evidence(self) -> Evidence:
        """This alert as incident evidence (meant for firing alerts)."""
        return Evidence(
            rule=self.rule,
            metric=self.metric,
            labels=self.label_dict,
            family=self.family,
            severity=self.severity,
            value=math.nan if self.value is None else self.value,
            baseline=self.baseline,
            onset_step=self.onset_step,
            fired_step=self.fired_step if self.fired_step is not None else (self.step or 0),
            trend=self.trend,
            summary=self.summary,
            suggest=self.suggest,
        )


_ALERT_STATE_FIELDS = (
    "state",
    "value",
    "baseline",
    "statistic",
    "direction",
    "step",
    "onset_step",
    "pending_step",
    "fired_step",
    "resolved_step",
    "fired_time",
    "resolved_time",
    "held",
    "false_count",
    "last_true_step",
)

_FLOAT_FIELDS = frozenset({"value", "baseline", "statistic", "fired_time", "resolved_time"})


def _alert_state(alert: Alert) -> dict[str, Any]:
    """Strict-JSON state of an alert: non-finite floats become "nan", "inf", "-inf"."""
    state = {}
    for key in _ALERT_STATE_FIELDS:
        value = getattr(alert, key)
        if key in _FLOAT_FIELDS and value is not None and not math.isfinite(value):
            value = "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
        state[key] = value
    return state


@dataclass(frozen=True)
class AlertTransition:
    """An alert changed state at sample step ``step`` during ``evaluate(eval_step, time)``."""

    rule: str
    labels: Labels
    from_state: str
    to_state: str
    step: int
    eval_step: int
    time: float
    alert: Alert  # a snapshot taken right after the transition

    @property
    def kind(self) -> str:
        """pending | firing | resolved (firing -> inactive) | cancelled (pending -> inactive)."""
        if self.to_state != INACTIVE:
            return self.to_state
        return "resolved" if self.from_state == FIRING else "cancelled"


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


@dataclass
class _RuleRuntime:
    rule: Rule
    cursors: dict[Labels, int] = field(default_factory=dict)
    seen_version: int = -1
    groups: dict[Labels, _Group] = field(default_factory=dict)
    matched: dict[Labels, bool] = field(default_factory=dict)  # matcher results, cached

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
                runtime.seen_version = -1
        transitions: list[AlertTransition] = []
        for runtime in self._runtimes.values():
            version = self.store.version(runtime.rule.metric)
            if version == runtime.seen_version:
                continue  # nothing new for this metric: the common, cheap path
            runtime.seen_version = version
            errors: list[str] = []
            try:
                new, advanced = self.store.read_new(
                    runtime.rule.metric, runtime.accepts, runtime.cursors
                )
                runtime.cursors.update(advanced)
                batches = _reduce_by_group(runtime.rule, new)
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
        condition = bool(detector.triggered)
        _advance(runtime.rule, alert, condition, detector.onset_step, step, eval_step, now, out)

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
                        "alert": _alert_state(group.alert),
                    }
                    for labels, group in runtime.groups.items()
                ],
            }
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
            for key in _ALERT_STATE_FIELDS:
                value = entry["alert"][key]
                setattr(
                    group.alert,
                    key,
                    float(value) if key in _FLOAT_FIELDS and value is not None else value,
                )
            if group.alert.state not in (INACTIVE, PENDING, FIRING):
                raise ValueError(f"unknown alert state {group.alert.state!r}")
            runtime.groups[labels] = group
        return runtime


def _advance(
    rule: Rule,
    alert: Alert,
    condition: bool,
    onset: int | None,
    step: int,
    eval_step: int,
    now: float,
    out: list[AlertTransition],
) -> None:
    """One evaluation of the state machine for ``alert`` at sample ``step``."""
    if alert.state == INACTIVE:
        if not condition:
            return
        alert.state = PENDING
        alert.pending_step = step
        alert.held = 0
        alert.onset_step = onset if onset is not None else step
        alert.fired_step = alert.resolved_step = None
        alert.fired_time = alert.resolved_time = None
        _emit(alert, INACTIVE, step, eval_step, now, out)
        _maybe_fire(rule, alert, step, eval_step, now, out)
    elif alert.state == PENDING:
        if not condition:
            alert.state = INACTIVE
            _emit(alert, PENDING, step, eval_step, now, out)
            return
        alert.held += 1
        if onset is not None:
            alert.onset_step = onset
        _maybe_fire(rule, alert, step, eval_step, now, out)
    else:
        assert alert.state == FIRING, alert.state
        if onset is not None:
            alert.onset_step = onset
        if condition:
            alert.last_true_step = step
            alert.false_count = 0
            return
        alert.false_count += 1
        keep = rule.keep_firing_for
        assert alert.last_true_step is not None
        waited = alert.false_count if keep.unit == "evaluations" else step - alert.last_true_step
        if waited > keep.count and (
            rule.clear is None or rule.clear.holds(alert.value, alert.baseline)
        ):
            alert.state = INACTIVE
            alert.resolved_step = step
            alert.resolved_time = now
            _emit(alert, FIRING, step, eval_step, now, out)


def _maybe_fire(
    rule: Rule, alert: Alert, step: int, eval_step: int, now: float, out: list[AlertTransition]
) -> None:
    wait = rule.for_
    assert alert.pending_step is not None
    held = alert.held if wait.unit == "evaluations" else step - alert.pending_step
    if held < wait.count:
        return
    alert.state = FIRING
    alert.fired_step = step
    alert.fired_time = now
    alert.last_true_step = step
    alert.false_count = 0
    _emit(alert, PENDING, step, eval_step, now, out)


def _emit(
    alert: Alert, from_state: str, step: int, eval_step: int, now: float, out: list[AlertTransition]
) -> None:
    snapshot = dataclasses.replace(alert)
    out.append(
        AlertTransition(
            alert.rule, alert.labels, from_state, alert.state, step, eval_step, now, snapshot
        )
    )


def _reduce_by_group(
    rule: Rule, new: dict[Labels, list[tuple[int, float]]]
) -> dict[Labels, list[tuple[int, float]]]:
    """New points per series -> (step, reduced value) per alert group, in arrival order."""
    reduce = rule.reduce
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
        },
        sort_keys=True,
        default=str,
    )


def _pairs(labels: Labels) -> list[list[str]]:
    return [list(pair) for pair in labels]


def _labels(pairs: Iterable[Iterable[str]]) -> Labels:
    return tuple(sorted((str(k), str(v)) for k, v in pairs))


def _describe_error(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"
