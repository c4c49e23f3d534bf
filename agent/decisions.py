"""One decision round, shared by the live agent and by replay: new samples in, alert
transitions, incident events and paced action admissions out. Deterministic: it depends only on
the samples, the step, ``now`` and the rules, never on a clock read here or on thread timing.

    samples -> series store -> rule engine (detectors, alert lifecycle)
            -> attribution (incidents and their events)
            -> pacing (the repeat page; which actions of the firing rules that are causes of
               the incident, not consequences, run now)

The caller runs the admitted actions (``remediations.runner``) and tells pacing what came of
them (``Pacing.ran``); replay runs none.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from agent.attribution import Attributor
from agent.incidents import IncidentEvent
from agent.rules.engine import AlertTransition, RuleEngine, RuleProblem
from agent.samples import Sample
from remediations.pacing import Admission, Pacing

PAGED_KINDS = frozenset({"opened", "updated", "escalated", "repeat"})  # restart the repeat clock


@dataclass
class Decisions:
    transitions: list[AlertTransition] = field(default_factory=list)
    problems: list[RuleProblem] = field(default_factory=list)
    events: list[IncidentEvent] = field(default_factory=list)
    admissions: list[Admission] = field(default_factory=list)


def decide(
    engine: RuleEngine,
    attributor: Attributor,
    pacing: Pacing,
    step: int,
    samples: list[Sample],
    now: float,
    *,
    act: bool = True,
) -> Decisions:
    """Feed ``samples`` (all of one evaluation) to the rules, attribute what fires, pace.
    ``act=False`` (a round off the training thread: the watchdog) admits no actions; the
    next round on the training thread does, if their rules still fire."""
    engine.store.extend(samples)
    attributor.observe(samples)  # the learning-rate schedule's steps
    out = Decisions(transitions=engine.evaluate(step, now), problems=engine.take_problems())
    pacing.advance(step)
    if not out.transitions and attributor.open is None and not attributor.holding:
        return out
    firing = engine.firing()
    out.events = attributor.update(step, [a.to_evidence() for a in firing])
    incident = attributor.open
    if incident is not None and not any(e.kind in PAGED_KINDS for e in out.events):
        if pacing.repeat_due(incident.id, now):
            repeat = attributor.repeat(step)
            out.events += [repeat] if repeat is not None else []
    for event in out.events:
        if event.kind == "resolved":
            pacing.closed(event.incident.id)
        elif event.kind in PAGED_KINDS:
            pacing.paged(event.incident.id, now)
    if not act or attributor.holding:  # held symptoms run nothing yet (agent/attribution.py)
        return out
    # Only the causes' actions: a consequence's remedy targets the wrong mechanism.
    requests = [
        (a.rule, [(s.name, s.params) for s in a.actions])
        for a in firing
        if attributor.causes(a.rule)
    ]
    out.admissions = pacing.round(step, requests, incident.id if incident is not None else None)
    return out


def alert_fields(t: AlertTransition) -> dict[str, Any]:
    """The event-log fields of one alert transition (an ``alert`` record)."""
    return {
        "rule": t.rule,
        "labels": dict(t.labels),
        "transition": f"{t.from_state}->{t.to_state}",
        "value": t.alert.value,
        "baseline": t.alert.baseline,
        "onset_step": t.alert.onset_step,
    }
