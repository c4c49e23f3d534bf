"""One decision round, shared by the live agent and by replay: new samples in, alert
transitions, incident events and action requests out. Deterministic: it depends only on the
samples, the step and the rules, never on a clock or on thread timing."""

from __future__ import annotations

from dataclasses import dataclass, field

from agent.attribution import ActionRequest, Attributor, FiringAlert
from agent.incidents import IncidentEvent
from agent.rules.engine import AlertTransition, RuleEngine, RuleProblem
from agent.samples import Sample


@dataclass
class Decisions:
    transitions: list[AlertTransition] = field(default_factory=list)
    problems: list[RuleProblem] = field(default_factory=list)
    events: list[IncidentEvent] = field(default_factory=list)
    action_requests: list[ActionRequest] = field(default_factory=list)


def decide(
    engine: RuleEngine, attributor: Attributor, step: int, samples: list[Sample], now: float
) -> Decisions:
    """Feed ``samples`` (all of one evaluation) to the rules and attribute what fires."""
    engine.store.extend(samples)
    out = Decisions(transitions=engine.evaluate(step, now), problems=engine.take_problems())
    if not out.transitions and attributor.open is None:
        return out
    firing = [
        FiringAlert(a.to_evidence(), tuple((s.name, dict(s.params)) for s in a.actions))
        for a in engine.firing()
    ]
    update = attributor.update(step, firing)
    out.events, out.action_requests = update.events, update.action_requests
    return out
