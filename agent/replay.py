"""Replay a recorded run's measurements through rule files: what would have fired, when, and
which incidents would have opened. ``mechwatch replay RUN_DIR/events.jsonl --rules my.yaml``.

The agent writes every evaluation's samples to its event log (``metrics`` records, one per
decision round, in order). Feeding them again through ``agent.decisions.decide`` reproduces
the live decisions exactly for any rule set (the measurements do not depend on the rules,
unless actions changed the run): the way to tune a rule on yesterday's run before shipping it.
Replay runs no actions; incidents are paged again as by an agent with the default ``notify``
settings.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.attribution import MECHANISM_FAMILIES, Attributor
from agent.decisions import decide
from agent.eventlog import last_run, read_events
from agent.incidents import RunContext
from agent.notify.config import NotifyConfig
from agent.rules.engine import RuleEngine
from agent.rules.loader import default_rule_files, load_rule_files
from agent.samples import Sample
from agent.schedule_steps import SCHEDULE_LAG
from agent.store import SeriesStore
from remediations.pacing import Pacing, PacingLimits


@dataclass
class ReplayResult:
    alerts: list[dict[str, Any]] = field(default_factory=list)  # firing / resolved transitions
    incidents: list[dict[str, Any]] = field(default_factory=list)  # incident events
    evaluations: int = 0
    # the learning-rate schedule's steps seen in the recorded ``lr`` samples (before, at, ratio)
    schedule_steps: list[tuple[int, int, float]] = field(default_factory=list)

    def first_firing(self) -> dict[str, int]:
        """family -> step of the first evaluation at which a rule of that family fired."""
        return self._first_firing("family")

    def first_firing_by_rule(self) -> dict[str, int]:
        """rule -> step of the first evaluation at which it fired."""
        return self._first_firing("rule")

    def _first_firing(self, key: str) -> dict[str, int]:
        out: dict[str, int] = {}
        for a in self.alerts:
            if a["to"] == "firing":
                out.setdefault(a[key], a["step"])
        return out

    def attribution(self, at_step: int | None = None) -> str | None:
        """Family of the first incident, as it stood when it last changed (escalations) up to
        and including ``at_step`` (None: the end of the run; a step before the incident opened:
        None)."""
        if not self.incidents:
            return None
        first = self.incidents[0]["incident"]["id"]
        family = None
        for e in self.incidents:
            if at_step is not None and e["step"] > at_step:
                break
            if e["incident"]["id"] == first:
                family = e["incident"]["family"]
        return family

    def paged_attribution(self) -> str | None:
        """Family of the first incident when it opened (what its first page said)."""
        return self.incidents[0]["incident"]["family"] if self.incidents else None


def replay(
    events_path: str | Path,
    rule_paths: Sequence[str | Path] | None = None,
    *,
    action_validator: Any | None = None,
) -> ReplayResult:
    """Run the recorded samples of ``events_path`` through ``rule_paths`` (default: shipped).

    The log is append-only: a run directory used again (a job restarted from scratch, or
    resumed) holds every agent start in turn. Only the last run is replayed, from its ``start``
    record on (as ``mechwatch report`` reads it): feeding the earlier runs' samples through the
    same detectors would mix two runs into one series and fire on the jump between them."""
    events = last_run(read_events(Path(events_path)))
    paths = list(rule_paths) if rule_paths is not None else default_rule_files()
    ruleset = load_rule_files(paths, action_validator=action_validator)
    engine = RuleEngine(ruleset, SeriesStore())
    start = next((e for e in events if e["kind"] == "start"), {})
    monitored = set()
    if start.get("attention_layers"):
        monitored.add(MECHANISM_FAMILIES[0])
    if start.get("routers"):
        monitored.add(MECHANISM_FAMILIES[1])
    notify = NotifyConfig()  # the symptom wait and repeat page of the default settings
    attributor = Attributor(
        RunContext(run_name=start.get("run", "replay")),
        monitored_families=monitored,
        symptom_wait=notify.symptom_wait_steps,
        schedule_lag=int(start.get("schedule_lag", SCHEDULE_LAG)),
    )
    pacing = Pacing(
        lambda request: (PacingLimits(), False),  # never asked: replay admits no actions
        repeat_every_steps=notify.repeat_every_steps,
        repeat_every_s=notify.repeat_every_s,
    )
    result = ReplayResult()
    for e in events:
        if e["kind"] != "metrics":
            continue
        samples = [
            Sample.make(s, metric, value, **labels) for s, metric, labels, value in e["samples"]
        ]
        now = float(e.get("time", 0.0))
        decisions = decide(engine, attributor, pacing, e["step"], samples, now, act=False)
        result.evaluations += 1
        for t in decisions.transitions:
            if t.kind in ("firing", "resolved"):
                result.alerts.append(
                    {
                        "step": e["step"],
                        "rule": t.rule,
                        "family": t.alert.family,
                        "labels": dict(t.labels),
                        "to": t.kind,
                        "value": t.alert.value,
                        "baseline": t.alert.baseline,
                        "onset_step": t.alert.onset_step,
                    }
                )
        for event in decisions.events:
            result.incidents.append(
                {"step": event.step, "event": event.kind, "incident": event.incident.to_dict()}
            )
    result.schedule_steps = [(s.before, s.at, s.ratio) for s in attributor.schedule.steps.steps]
    return result


def cli_replay(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="mechwatch replay", description="replay a recorded run through rule files"
    )
    parser.add_argument("events", type=Path, help="a run's events.jsonl")
    parser.add_argument("--rules", type=Path, nargs="+", default=None, help="rule files")
    args = parser.parse_args(argv)
    if not args.events.exists():
        print(f"mechwatch replay: {args.events}: no such file", file=sys.stderr)
        return 2
    result = replay(args.events, args.rules)
    print(f"{result.evaluations} evaluations replayed")
    for before, at, ratio in result.schedule_steps:
        print(f"step {at:>7}  learning rate x{ratio:.3g} (every group, since step {before})")
    for a in result.alerts:
        labels = ",".join(f"{k}={v}" for k, v in a["labels"].items())
        print(f"step {a['step']:>7}  {a['to']:<8} {a['rule']}{{{labels}}}  value={a['value']:.4g}")
    for i in result.incidents:
        inc = i["incident"]
        print(
            f"step {i['step']:>7}  incident {i['event']:<9} {inc['id']}: {inc['family']} "
            f"(confidence {inc['confidence']:.2f}, onset {inc['onset_step']})"
        )
    return 0
