"""Attribution: firing alerts become one incident per fault, with a family, a confidence and
the evidence (DESIGN.md 1c).

Which families fire decides the attribution:

    fa_precision evidence only            -> fa_precision
    router_instability evidence only      -> router_instability
    both mechanism families               -> combined
    symptom evidence only (loss, NaN...)  -> unattributed

Causal order: a mechanism's evidence that is explained by a change of the whole run is a
*consequence*, kept as evidence but not a cause. It is one when its alert fired (its firing
step, not its onset, except where said: a rate detector's onset can reach back into a slow
drift well before the collapse)

- at or after every update of a block collapsed at once (``control_update_entropy``: the
  differential diagnosis of DESIGN.md 1c: a biased attention backward moves only Q and K; a
  data shift, a schedule change or a phase transition moves every weight). Attention evidence
  is explained by its own block's controls only (the same layer label); router evidence by
  any block's, or
- when the other mechanism family is already a cause of the incident, with an onset at or
  after the loss damage began (a loss spike, rise or non-finite loss): the attention fault
  has damaged the run, and a router collapse that only then begins is its downstream effect
  (the onset here, so that two mechanisms that began before the damage stay ``combined``), or
- when it fired at or after the loss diverged (critical loss evidence: ``loss_diverged``, a
  non-finite loss): once the run has diverged every mechanism is disturbed, and a collapse
  that first fires then cannot be told from the divergence's effect, whatever its onset says
  (a rate detector's onset reaches back into the drift the damage started). This holds for
  the first mechanism of an incident too: a data shift that throws the loss half a nat up
  at once is followed by routers re-sharpening on the new data (an HF Mixtral: the router
  rule fired 15 to 40 steps after the loss diverged, with an onset 25 to 75 steps before the
  jump), or
- when it began (its onset) after the loss jumped (a loss alert of an abrupt detector, a
  z-score spike: ``Detector.abrupt``): a mechanism fault that writes a bias into the weights
  step after step moves the loss gradually and after the mechanism, never in one jump before
  it; a jump comes from outside (a data shift, a bad batch, a schedule change), and the
  collapse that follows is the model relearning, or
- when the other mechanism family is already a cause of the incident and this one began
  (its onset) at least ``downstream_lag`` steps (default 500) after the other family's first
  alert: a fault that has been writing into the weights that long moves the rest of the
  model, and the other mechanism's collapse can follow before the loss shows any damage (an
  FP8-strength attention fault on HF Mixtral and Qwen2-MoE: the routers collapsed 645-1,145
  steps after the FA alert, with no loss alert yet or 15 steps later). Two faults that begin
  together are alerted closer than that (the test bed's ``combined``: the FA onset 175-300
  steps after the router alert); a second, independent fault that begins that much later is
  counted as a consequence, and its evidence stays in the incident, or
- when it began (its onset) within a step of the learning-rate schedule: after the last read-out
  of the optimizer's learning rates before every group's rate moved by x2 or more, and at
  most ``schedule_lag`` steps (default 50: two QK evaluations at their default cadence)
  after the first read-out that showed it (``agent.schedule_steps``): a schedule step moves
  every weight's update at once (a cut x0.1 on the test bed drops H(Delta_2) by a third in
  one evaluation with its top direction held), and the step itself is not news, or
- at least ``consequence_lag`` steps (default 100) after the loss damage began, whatever
  else the incident holds: damage needs time to feed back into a mechanism, and a collapse
  that starts with the loss change is as likely its cause as its effect (a smaller batch
  makes the loss noisier and collapses the router at once).

A test of the arithmetic itself (``ARITHMETIC_METRICS``: the kernel audit's
``attention_backward_asymmetry``, ``remediations.kernel_audit``) is never a consequence and is
never inhibited: it compares a kernel's backward with its own negation on one call's inputs,
and no change of the run (data, schedule, phase, damage) moves it away from 0.

So a QK collapse while the model relearns after a data shift leaves the incident
``unattributed``, and a router collapse that follows the damage of an attention fault leaves
it ``fa_precision`` (``combined`` means both mechanisms started on their own). Evidence of a
family that is already a cause of the incident is a cause too.

Inhibition (Alertmanager's ``inhibit_rules``): while no incident is open and every firing
alert is mechanism evidence that began with a step of the learning-rate schedule, no incident
opens: nothing is paged and no action runs (the alerts are in the event log). A step decay's
cut is the user's own doing, not news. When other evidence fires (a loss rise, another
mechanism), the incident opens with that evidence kept as a consequence. A step shifts a
level once: an explained alert that moves a fifth beyond its level after the step is no longer
explained (``agent.schedule_steps``), and pages as a cause. The price: a fault that begins with
a step is named only after that further fall (180-305 steps after it on the test bed).

Symptom wait (Alertmanager's ``group_wait``): a new incident whose evidence is only symptoms
below ``critical`` (a loss rise or spike, a gradient-norm spike) is held ``symptom_wait`` steps
(``notify.symptom_wait_steps``, default 50: two read-outs of the mechanism monitors at their
default cadence) before it opens, so that a mechanism alert that follows names the fault in the
first page instead of an ``unattributed`` one (a smaller batch makes the gradient norm jump 45
steps before the router collapse fires). While held, nothing is paged and no action runs;
held evidence that clears is paged when it clears (opened and resolved) or stays evidence of
the incident that opens; critical symptoms (a non-finite loss, a hung run) and any mechanism
evidence open at once.

Confidence (documented heuristic, in [0, 1]): a mechanism family starts at 0.6, gains 0.1 per
further distinct firing rule of that family (at most +0.2), 0.1 when the other mechanism family
is monitored and quiet (the orthogonality check of DESIGN.md 1c), and 0.05 when symptoms
corroborate; ``combined`` takes the smaller of its two families; ``unattributed`` is 0.3 plus
0.05 per further symptom rule, at most 0.5.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from agent import samples as m
from agent.incidents import Evidence, Incident, IncidentEvent, RunContext
from agent.samples import Sample
from agent.schedule_steps import SCHEDULE_LAG, ScheduleAccount, ScheduleStep

MECHANISM_FAMILIES = ("fa_precision", "router_instability")
# Symptom evidence that the whole run changed (see the module docstring).
LOSS_METRICS = frozenset({"loss", "loss_nonfinite"})
CONTROL_METRICS = frozenset({"control_update_entropy"})
ARITHMETIC_METRICS = frozenset({m.ATTENTION_BACKWARD_ASYMMETRY})  # never a consequence
CONSEQUENCE_LAG = 100  # steps after the loss damage began from which a collapse is its effect
# Steps after the other mechanism's first alert from which a collapse that begins is its
# downstream effect (see the module docstring).
DOWNSTREAM_LAG = 500
SCHEDULE_REASON = "began with a step of the learning-rate schedule"  # (agent/schedule_steps.py)
_SEVERITY_ORDER = {"info": 0, "warning": 1, "critical": 2}


def classify(families: set[str]) -> str:
    """The fault family that a set of firing evidence families points to."""
    fa = "fa_precision" in families
    router = "router_instability" in families
    if fa and router:
        return "combined"
    if fa:
        return "fa_precision"
    if router:
        return "router_instability"
    return "unattributed"


def _family_confidence(rules: set[str], corroborated: bool, other_quiet: bool) -> float:
    conf = 0.6 + min(0.2, 0.1 * (len(rules) - 1))
    if other_quiet:
        conf += 0.1
    if corroborated:
        conf += 0.05
    return min(conf, 0.95)


def confidence(evidence: list[Evidence], monitored: set[str]) -> float:
    by_family: dict[str, set[str]] = {}
    for e in evidence:
        by_family.setdefault(e.family, set()).add(e.rule)
    family = classify(set(by_family))
    symptoms = "symptom" in by_family
    if family == "unattributed":
        return min(0.5, 0.3 + 0.05 * (len(by_family.get("symptom", ())) - 1))
    if family == "combined":
        return min(_family_confidence(by_family[f], symptoms, False) for f in MECHANISM_FAMILIES)
    other = next(f for f in MECHANISM_FAMILIES if f != family)
    return _family_confidence(by_family[family], symptoms, other in monitored)


def _causes(evidence: Any) -> set[str]:
    """The families of the evidence that is not a consequence."""
    return {e.family for e in evidence if not e.consequence}


def _systemic_onset(
    evidence: list[Evidence],
    metrics: frozenset[str],
    abrupt_only: bool = False,
    layer: str | None = None,
) -> int | None:
    """When the incident's systemic change of one kind began: the earliest onset (else firing
    step) of its symptom evidence on ``metrics`` (``abrupt_only``: from jump detectors only;
    ``layer``: only evidence labelled with that layer, or with none); None without any."""
    steps = [
        e.onset_step if e.onset_step is not None else e.fired_step
        for e in evidence
        if e.family == "symptom"
        and e.metric in metrics
        and (e.abrupt or not abrupt_only)
        and (layer is None or e.labels.get("layer", layer) == layer)
    ]
    return min(steps, default=None)


def _consequence_of(
    e: Evidence,
    evidence: list[Evidence],
    lag: int,
    causes: set[str] = frozenset(),
    downstream_lag: int | None = DOWNSTREAM_LAG,
    stepped: ScheduleStep | None = None,
) -> str | None:
    """What explains mechanism evidence ``e``, in words, when it is a consequence: a change of
    the whole run (its loss, its controls, the learning-rate schedule's step that explains it,
    ``stepped``) or the damage of the other mechanism, already a cause of the incident
    (``causes``; see the module docstring). None: ``e`` is a cause."""
    if e.family not in MECHANISM_FAMILIES or e.metric in ARITHMETIC_METRICS:
        return None
    began = e.fired_step
    # Attention evidence: the controls of its own block only (agent/probes.py measures a
    # layer's controls on the snapshots of its Q and K); another block's collapse explains
    # nothing here, or every layer of a deep model would be one more chance to write a real
    # fault off. A router has no attention block of its own: any block's controls.
    own = e.labels.get("layer") if e.family == "fa_precision" else None
    controls = _systemic_onset(evidence, CONTROL_METRICS, layer=own)
    loss = _systemic_onset(evidence, LOSS_METRICS)
    jump = _systemic_onset(evidence, LOSS_METRICS, abrupt_only=True)
    diverged = _diverged(evidence)
    onset = e.onset_step if e.onset_step is not None else began
    other = causes & (set(MECHANISM_FAMILIES) - {e.family})  # the other mechanism, a cause
    other_alerted = min(  # its first alert (of its causal evidence: not a loss alert)
        (x.fired_step for x in evidence if x.family in other and not x.consequence),
        default=None,
    )
    if controls is not None and began >= controls:
        whose = "the rest of its block's" if own is not None else "every one of a block's"
        return f"{whose} updates collapsed from step {controls}"
    if downstream_lag is not None and other_alerted is not None:
        if onset >= other_alerted + downstream_lag:
            return f"began {onset - other_alerted} steps after the {_one(other)} alert"
    if stepped is not None:
        return (
            f"{SCHEDULE_REASON} (x{stepped.ratio:.3g} between steps {stepped.before} and "
            f"{stepped.at}) and has not moved further since"
        )
    if jump is not None and onset > jump:
        return f"began after the loss jumped at step {jump}"
    if loss is not None and began >= loss + lag:
        return f"fired {began - loss} steps after the loss damage began at step {loss}"
    if loss is not None and other and onset >= loss:
        return f"began after the loss damage of the {_one(other)} fault (step {loss})"
    if diverged is not None and began >= diverged:
        return f"fired after the loss diverged at step {diverged}"
    return None


def _one(families: set[str]) -> str:
    return sorted(families)[0]


def _diverged(evidence: list[Evidence]) -> int | None:
    """When the loss diverged: the first firing step of the incident's critical loss evidence
    (a diverged or non-finite loss); None without any."""
    steps = [
        e.fired_step
        for e in evidence
        if e.family == "symptom" and e.metric in LOSS_METRICS and e.severity == "critical"
    ]
    return min(steps, default=None)


def _with_held(firing: list[Evidence], held: list[Evidence]) -> list[Evidence]:
    """``firing`` plus the held evidence of alerts that no longer fire."""
    keys = {e.key for e in firing}
    return firing + [e for e in held if e.key not in keys]


class Attributor:
    """Turns the set of firing alerts at each evaluation into incident events and actions."""

    def __init__(
        self,
        context: RunContext | None = None,
        *,
        monitored_families: set[str] | None = None,
        history: int = 50,
        consequence_lag: int = CONSEQUENCE_LAG,
        downstream_lag: int | None = DOWNSTREAM_LAG,
        symptom_wait: int = 0,
        schedule_lag: int = SCHEDULE_LAG,
    ) -> None:
        self.context = context or RunContext()
        # the learning-rate schedule's steps and what they explain (``observe``)
        self.schedule = ScheduleAccount(schedule_lag)
        self.inhibited: set[str] = set()  # rules firing on the schedule's account alone
        self.consequence_lag = consequence_lag
        self.downstream_lag = downstream_lag  # None: never by time alone
        self.symptom_wait = symptom_wait
        self.held: list[Evidence] = []  # symptom evidence held back (the symptom wait)
        self.held_since: int | None = None  # the first firing step of the held evidence
        self.monitored = set(monitored_families or MECHANISM_FAMILIES)
        self.history = history
        self.open: Incident | None = None
        self.closed: list[Incident] = []
        self._seq = 0  # per-incident event sequence
        self._count = 0  # incidents opened so far (part of the deterministic id)

    # ------------------------------------------------------------------ evaluation
    def observe(self, samples: list[Sample]) -> None:
        """Take one round's samples before ``update``: the learning rates among them tell
        where the schedule stepped (``agent.schedule_steps``)."""
        self.schedule.observe(samples)

    @property
    def schedule_lag(self) -> int:
        return self.schedule.lag

    def update(self, step: int, firing: list[Evidence]) -> list[IncidentEvent]:
        """The incident events of one evaluation, from the evidence of every firing alert."""
        self.schedule.track(step, firing)
        if self.open is None:
            held, self.held, self.held_since = self.held, [], None
            self.inhibited = set()
            if not firing:  # held symptoms that cleared are still paged, opened and resolved
                return [self._open(step, held), self._resolve(step)] if held else []
            firing = _with_held(firing, held)  # a held alert that cleared stays evidence
            self.inhibited = self._inhibited(firing)
            if self.inhibited or self._hold(step, firing):
                return []
            return [self._open(step, firing)]
        if not firing:
            return [self._resolve(step)]
        incident = self.open
        old_family, old_rules = incident.family, {e.rule for e in incident.evidence}
        self._merge(step, firing)
        new_rules = {e.rule for e in incident.evidence} - old_rules
        if incident.family != old_family:
            return [
                self._event(
                    "escalated", step, f"re-attributed from {old_family} to {incident.family}"
                )
            ]
        if new_rules:
            return [self._event("updated", step, "new evidence: " + ", ".join(sorted(new_rules)))]
        return []

    def _resolve(self, step: int) -> IncidentEvent:
        incident = self.open
        assert incident is not None
        incident.status = "resolved"
        incident.resolved_step = step
        incident.updated_step = step
        event = self._event("resolved", step, "all alerts cleared")
        self.closed = (self.closed + [incident])[-self.history :]
        self.open = None
        return event

    @property
    def holding(self) -> bool:
        """Symptom evidence fires and is held before it opens an incident (module docstring)."""
        return self.open is None and (self.held_since is not None or bool(self.inhibited))

    def _inhibited(self, firing: list[Evidence]) -> set[str]:
        """The rules of ``firing`` when all of it is mechanism evidence that began with a step
        of the learning-rate schedule (then it opens no incident: the module docstring's
        inhibition); else the empty set."""
        explained = all(
            e.family in MECHANISM_FAMILIES
            and e.metric not in ARITHMETIC_METRICS
            and self.schedule.explaining(e) is not None
            for e in firing
        )
        return {e.rule for e in firing} if explained and firing else set()

    def _hold(self, step: int, firing: list[Evidence]) -> bool:
        """Whether ``firing`` (no incident open) waits before it opens one; if so, it is
        held."""
        if self.symptom_wait <= 0 or any(
            e.family != "symptom" or e.severity == "critical" for e in firing
        ):
            return False
        since = min(e.fired_step for e in firing)
        if step >= since + self.symptom_wait:
            return False
        self.held, self.held_since = list(firing), since
        return True

    def causes(self, rule: str) -> bool:
        """Whether ``rule`` is a cause of the open incident (some of its evidence is not a
        consequence): only a cause's actions run; a consequence's remedy targets a mechanism
        that did not start the fault (a data shift's QK collapse must not roll the run back)."""
        if self.open is None:
            return rule not in self.inhibited
        evidence = [e for e in self.open.evidence if e.rule == rule]
        return not evidence or any(not e.consequence for e in evidence)

    def repeat(self, step: int) -> IncidentEvent | None:
        """A "still firing" event for the open incident (pacing says when)."""
        return self._event("repeat", step, "still firing") if self.open is not None else None

    def record_action(self, record: Any, step: int) -> IncidentEvent | None:
        """Attach an ActionRecord to the open incident and return the thread event for it."""
        if self.open is None:
            return None
        self.open.actions.append(record)
        verb = "would run" if record.dry_run else ("ran" if record.ok else "failed to run")
        return self._event("action", step, f"{verb} {record.action}: {record.detail}")

    # ------------------------------------------------------------------ internals
    def _open(self, step: int, firing: list[Evidence]) -> IncidentEvent:
        self._count += 1
        self._seq = 0
        self.open = Incident(
            id=f"{self.context.run_name}-{self._count}-s{step}",
            family="unattributed",
            severity="info",
            confidence=0.0,
            opened_step=step,
            onset_step=None,
        )
        self._merge(step, firing)
        return self._event("opened", step, "")

    def _merge(self, step: int, firing: list[Evidence]) -> None:
        incident = self.open
        assert incident is not None
        current = {e.key: e for e in incident.evidence}
        everything = [*incident.evidence, *firing]
        for e in firing:
            old = current.get(e.key)
            causes = _causes(current.values())
            # A consequence stays one while it keeps firing, unless the schedule step that
            # explained it no longer does (it kept falling: ``agent.schedule_steps``).
            lapsed = old is not None and self.schedule.has_lapsed(e)
            by_schedule = old is not None and old.consequence_of.startswith(SCHEDULE_REASON)
            if old is not None and old.consequence and not (lapsed and by_schedule):
                e = dataclasses.replace(e, consequence=True, consequence_of=old.consequence_of)
            elif (old is None or old.consequence) and e.family not in causes:
                stepped = self.schedule.explaining(e)
                why = _consequence_of(
                    e,
                    everything,
                    self.consequence_lag,
                    causes,
                    self.downstream_lag,
                    stepped,
                )
                if why is not None:
                    e = dataclasses.replace(e, consequence=True, consequence_of=why)
            current[e.key] = e
        incident.evidence = list(current.values())
        # Evidence accumulates while the incident is open, so the family can only be upgraded
        # (unattributed -> a mechanism -> combined), never downgraded.
        incident.family = classify(_causes(incident.evidence))
        incident.severity = max(
            (e.severity for e in incident.evidence), key=lambda s: _SEVERITY_ORDER.get(s, 0)
        )
        causal = [e for e in incident.evidence if not e.consequence]
        incident.confidence = round(confidence(causal, self.monitored), 4)
        relevant = [
            e
            for e in causal
            if e.onset_step is not None
            and (incident.family == "unattributed" or e.family in MECHANISM_FAMILIES)
        ]
        incident.onset_step = min((e.onset_step for e in relevant), default=incident.onset_step)
        firing_mech = {e.family for e in incident.evidence} & set(MECHANISM_FAMILIES)
        incident.quiet_families = sorted(self.monitored - firing_mech)
        suggestions: list[str] = []
        for e in incident.evidence:
            if e.suggest and e.suggest not in suggestions:
                suggestions.append(e.suggest)
        incident.suggestions = suggestions
        incident.updated_step = step

    def _event(self, kind: str, step: int, message: str) -> IncidentEvent:
        assert self.open is not None
        self._seq += 1
        snapshot = Incident.from_dict(self.open.to_dict())
        return IncidentEvent(kind, self._seq, step, snapshot, self.context, message)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {
            "open": self.open.to_dict() if self.open else None,
            "closed": [i.to_dict() for i in self.closed],
            "seq": self._seq,
            "count": self._count,
            "held": [dataclasses.asdict(e) for e in self.held],
            "schedule": self.schedule.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.open = Incident.from_dict(state["open"]) if state.get("open") else None
        self.closed = [Incident.from_dict(i) for i in state.get("closed", [])]
        self._seq = int(state.get("seq", 0))
        self._count = int(state.get("count", 0))
        self.held = [Evidence(**e) for e in state.get("held", [])]
        self.held_since = min((e.fired_step for e in self.held), default=None)
        self.schedule.load_state_dict(state.get("schedule", {}))
