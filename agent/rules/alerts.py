"""One rule's alert for one label set: what it holds, its lifecycle, and its saved state.

The lifecycle is Prometheus', counted in evaluations (values fed to the rule's detector) or
in training steps; ``advance`` runs it once per value fed:

    inactive --condition true--> pending --held for `for`--> firing
    pending --condition false--> inactive                              ("cancelled")
    firing --condition false for more than `keep_firing_for`, and `clear` holds--> inactive
                                                                       ("resolved")

Exactly: an alert fires at the value where it has held ``for`` evaluations (or steps) since
it became pending (``for: 0`` fires at once), and resolves at the value where more than
``keep_firing_for`` evaluations (or steps) passed since the condition last held. Each change
of state is appended to the caller's list as an ``AlertTransition`` with a snapshot of the
alert.

An alert holds only its lifecycle: how often its actions run and when it is paged again is
pacing's business (``remediations.pacing``), as in Prometheus, where repeats and grouping live
in Alertmanager. Time is passed in (``now``), never read from a clock here.

``alert_state`` / ``load_alert_state``: the lifecycle fields as strict JSON (non-finite floats
as the strings "nan", "inf", "-inf") and back; the rule engine saves them with its state.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from agent.incidents import Evidence
from agent.rules.schema import ActionSpec
from agent.rules.templates import LABELS_PLACEHOLDER, PLACEHOLDER_EXAMPLES, render_template

if TYPE_CHECKING:
    from agent.rules.ruleset import Rule

Labels = tuple[tuple[str, str], ...]  # sorted (key, value) pairs: the alert's identity
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
    abrupt: bool = False  # the rule's detector fires on jumps only (Detector.abrupt)
    summary_template: str = field(default="", repr=False)
    suggest_template: str = field(default="", repr=False)

    @property
    def label_dict(self) -> dict[str, str]:
        return dict(self.labels)

    def template_values(self) -> dict[str, Any]:
        """What a summary or suggest template can name (``agent.rules.templates``): the
        alert's fields of those names, and its labels."""
        values = {name: getattr(self, name) for name in PLACEHOLDER_EXAMPLES}
        values[LABELS_PLACEHOLDER] = self.label_dict
        return values

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
            abrupt=self.abrupt,
            summary=self.summary,
            suggest=self.suggest,
        )


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


# ----- the lifecycle -----


def advance(
    rule: Rule,
    alert: Alert,
    condition: bool,
    onset: int | None,
    step: int,
    eval_step: int,
    now: float,
    out: list[AlertTransition],
) -> None:
    """One evaluation of the state machine for ``alert`` at sample ``step``: ``condition`` is
    the detector's verdict, ``onset`` its onset estimate (None: it has none)."""
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


# ----- saved state -----

_STATE_FIELDS = (
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


def alert_state(alert: Alert) -> dict[str, Any]:
    """Strict-JSON state of an alert: non-finite floats become "nan", "inf", "-inf"."""
    state = {}
    for key in _STATE_FIELDS:
        value = getattr(alert, key)
        if key in _FLOAT_FIELDS and value is not None and not math.isfinite(value):
            value = "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
        state[key] = value
    return state


def load_alert_state(alert: Alert, state: Mapping[str, Any]) -> None:
    """Restore what ``alert_state`` returned into ``alert`` (a firing alert stays firing).
    Raises KeyError for a missing field and ValueError for an unknown state."""
    for key in _STATE_FIELDS:
        value = state[key]
        setattr(alert, key, float(value) if key in _FLOAT_FIELDS and value is not None else value)
    if alert.state not in (INACTIVE, PENDING, FIRING):
        raise ValueError(f"unknown alert state {alert.state!r}")
