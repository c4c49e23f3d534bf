"""``mechwatch test FILE...``: rule unit tests, run through the live decision path.

Each test feeds its input series (``agent.rules.unit_test_file`` has the format) through the
same round as the agent and replay, ``agent.decisions.decide``: series store -> rule engine
(detectors, alert lifecycle) -> attribution -> pacing. One decision round per step at which any
series has a value, in step order, with every series that has a value at that step (a ``_``
leaves its series out of that round; a step where all are missing has no round). A round's
step is the samples' step, and ``now`` is the step in seconds (no clock is read).

After each round the runner records the alerts pending or firing, the open incident and what
pacing decided about the firing rules' actions. Actions are not run: each action pacing admits
(``run``) is reported to pacing as run successfully, as the agent would after applying it, so
cooldowns and caps take effect; a rollback does not move the step back. Repeat pages are off.

Expectations: ``alerts_at`` and ``incidents_at`` at step s are compared with the state after the
last round at or before s (the state holds between rounds); ``actions_at`` with the decisions
of the round at exactly s (none when there is no round at s). A rule that fails while a test
runs (its detector raises) fails the test too.

A failing expectation prints where it is, the test, the step, the rule (or "incident"), what
was expected and what the engine produced; the command exits 1 when a test fails or a file
does not load (its errors located as ``file:line:col``), else 0.
"""

from __future__ import annotations

import argparse
import importlib.resources
import re
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.attribution import Attributor
from agent.decisions import decide
from agent.incidents import Incident, RunContext
from agent.rules.detector_catalog import DetectorCatalog
from agent.rules.engine import RuleEngine
from agent.rules.errors import RuleFileErrors
from agent.rules.loader import RULES_PACKAGE, ActionValidator, is_rule_test_file
from agent.rules.ruleset import RuleSet
from agent.rules.series_notation import Labels, format_series
from agent.rules.unit_test_file import (
    ExpectedAction,
    ExpectedAlert,
    ExpectedIncident,
    RuleTest,
    load_test_file,
)
from agent.samples import Sample
from agent.store import SeriesStore
from remediations.pacing import LimitsOf, Pacing

NONE = "(none)"


@dataclass(frozen=True)
class Failure:
    """One expectation that did not hold."""

    where: str  # file:line:col of the expectation's step
    test: str
    step: int
    subject: str  # "rule NAME" or "incident"
    expected: list[str]
    got: list[str]

    def render(self) -> str:
        head = f"{self.where}: FAILED test '{self.test}', step {self.step}, {self.subject}"
        return "\n".join([head, *_column("expected:", self.expected), *_column("got:", self.got)])


def _column(title: str, items: list[str]) -> list[str]:
    lines = items or [NONE]
    return [f"  {title:<10}{lines[0]}", *(f"  {'':<10}{line}" for line in lines[1:])]


@dataclass
class _Round:
    """What one decision round left behind."""

    step: int
    alerts: list[tuple[str, Labels, str, int | None]]  # (rule, labels, state, onset step)
    incident: Incident | None
    decisions: list[tuple[str, str, str]]  # (rule, action, verdict) of pacing's admissions


@dataclass
class TestOutcome:
    name: str
    failures: list[Failure] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.failures


# ----------------------------------------------------------------------------- running


def run_rule_test(test: RuleTest, ruleset: RuleSet, limits_of: LimitsOf) -> TestOutcome:
    """Feed one test's series through the decision round; compare every expectation."""
    outcome = TestOutcome(test.name)
    rounds = _simulate(test, ruleset, limits_of, outcome)
    for at in test.alerts_at:
        got = _state_at(rounds, at.step)
        alerts = got.alerts if got is not None else []
        outcome.failures += _compare_alerts(at.where, test.name, at.step, at.expected, alerts)
    for at in test.incidents_at:
        got = _state_at(rounds, at.step)
        incident = got.incident if got is not None else None
        failure = _compare_incident(at.where, test.name, at.step, at.expected, incident)
        outcome.failures += [failure] if failure is not None else []
    for at in test.actions_at:
        got = next((r for r in rounds if r.step == at.step), None)
        outcome.failures += _compare_actions(at.where, test.name, at.step, at.expected, got)
    outcome.failures.sort(key=lambda f: f.step)  # stable: alerts, incident, actions per step
    return outcome


def _simulate(
    test: RuleTest, ruleset: RuleSet, limits_of: LimitsOf, outcome: TestOutcome
) -> list[_Round]:
    by_step: dict[int, list[Sample]] = {}
    for series in test.series:
        for i, value in enumerate(series.values):
            if value is not None:
                sample = Sample(i * test.interval, series.metric, value, series.labels)
                by_step.setdefault(sample.step, []).append(sample)
    engine = RuleEngine(ruleset, SeriesStore())
    context = RunContext(run_name="test", host="test", rank=0, job_id=None)
    attributor = Attributor(context, monitored_families=set(test.monitored))
    pacing = Pacing(
        limits_of,
        rule_cooldowns={r.name: r.cooldown for r in ruleset},
        repeat_every_steps=None,
        repeat_every_s=None,
    )
    rounds: list[_Round] = []
    for step in sorted(by_step):
        decisions = decide(engine, attributor, pacing, step, by_step[step], float(step))
        for problem in decisions.problems:
            outcome.failures.append(
                Failure(
                    test.where,
                    test.name,
                    step,
                    f"rule {problem.rule}",
                    ["no error"],
                    [problem.error],
                )
            )
        for admission in decisions.admissions:
            if admission.verdict == "run":
                pacing.ran(admission, ok=True)
        alerts = [
            (a.rule, a.labels, a.state, a.onset_step)
            for a in engine.alerts()
            if a.state != "inactive"
        ]
        verdicts = [(a.request.rule, a.request.action, a.verdict) for a in decisions.admissions]
        open_incident = attributor.open
        snapshot = Incident.from_dict(open_incident.to_dict()) if open_incident else None
        rounds.append(_Round(step, alerts, snapshot, verdicts))
    return rounds


def _state_at(rounds: Sequence[_Round], step: int) -> _Round | None:
    """The last round at or before ``step``."""
    before = [r for r in rounds if r.step <= step]
    return before[-1] if before else None


# ----------------------------------------------------------------------------- comparing


def _compare_alerts(
    where: str,
    test: str,
    step: int,
    expected: list[ExpectedAlert],
    got: list[tuple[str, Labels, str, int | None]],
) -> list[Failure]:
    failures = []
    for rule in _rules_in([e.rule for e in expected], [g[0] for g in got]):
        want = [e for e in expected if e.rule == rule]
        have = [g for g in got if g[0] == rule]
        with_onset = any(e.onset_step is not None for e in want)

        def matches(e: ExpectedAlert, g: tuple[str, Labels, str, int | None]) -> bool:
            same = (tuple(sorted(e.labels.items())), e.state) == (g[1], g[2])
            return same and (e.onset_step is None or e.onset_step == g[3])

        if not _same(want, have, matches):
            failures.append(
                Failure(
                    where,
                    test,
                    step,
                    f"rule {rule}",
                    [_alert_text(e.rule, e.labels, e.state, e.onset_step) for e in want],
                    [_alert_text(g[0], g[1], g[2], g[3] if with_onset else None) for g in have],
                )
            )
    return failures


def _alert_text(rule: str, labels: Labels | dict[str, str], state: str, onset: int | None) -> str:
    return f"{format_series(rule, labels)} {state}" + (
        f", onset {onset}" if onset is not None else ""
    )


def _compare_incident(
    where: str, test: str, step: int, expected: ExpectedIncident | None, got: Incident | None
) -> Failure | None:
    if expected is None and got is None:
        return None
    if expected is None or got is None:
        want = [_incident_text(expected, None)] if expected is not None else ["no open incident"]
        have = [_incident_text(expected, got)] if got is not None else ["no open incident"]
        return Failure(where, test, step, "incident", want, have)
    if _incident_fields(expected, got) == _incident_fields(expected, None):
        return None
    return Failure(
        where,
        test,
        step,
        "incident",
        [_incident_text(expected, None)],
        [_incident_text(expected, got)],
    )


def _incident_fields(expected: ExpectedIncident | None, got: Incident | None) -> dict[str, Any]:
    """The fields the expectation names: its own values (``got`` None) or the incident's."""
    named = ["family", "onset_step", "severity", "evidence", "consequences"]
    if expected is not None:
        named = [n for n in named if n == "family" or getattr(expected, n) is not None]
    if got is None:
        assert expected is not None
        values = {n: getattr(expected, n) for n in named}
        for key in ("evidence", "consequences"):
            if key in values:
                values[key] = sorted(set(values[key]))
        return values
    actual = {
        "family": got.family,
        "onset_step": got.onset_step,
        "severity": got.severity,
        "evidence": sorted({e.rule for e in got.evidence}),
        "consequences": sorted({e.rule for e in got.evidence if e.consequence}),
    }
    return {n: actual[n] for n in named}


def _incident_text(expected: ExpectedIncident | None, got: Incident | None) -> str:
    values = _incident_fields(expected, got)
    return ", ".join(f"{k} {v}" for k, v in values.items())


def _compare_actions(
    where: str, test: str, step: int, expected: list[ExpectedAction], got: _Round | None
) -> list[Failure]:
    """``got``: the round at exactly ``step`` (None: there is none, so nothing was decided)."""
    decided = got.decisions if got is not None else []
    failures = []
    for rule in _rules_in([e.rule for e in expected], [d[0] for d in decided]):
        want = [(e.action, e.verdict) for e in expected if e.rule == rule]
        have = [(d[1], d[2]) for d in decided if d[0] == rule]
        if not _same(want, have, lambda e, g: e == g):
            lines = [f"action {a}: {v}" for a, v in have]
            if got is None:
                lines = ["(no round at this step: no series has a value here)"]
            expected_lines = [f"action {a}: {v}" for a, v in want]
            failures.append(Failure(where, test, step, f"rule {rule}", expected_lines, lines))
    return failures


def _rules_in(*names: Iterable[str]) -> list[str]:
    """Rule names in first-seen order."""
    return list(dict.fromkeys(n for group in names for n in group))


def _same(want: list[Any], have: list[Any], matches: Callable[[Any, Any], bool]) -> bool:
    """Every expected item matches its own item of ``have``, and nothing is left over."""
    left = list(have)
    for item in want:
        hit = next((g for g in left if matches(item, g)), None)
        if hit is None:
            return False
        left.remove(hit)
    return not left


# ----------------------------------------------------------------------------- the command


def shipped_test_files() -> list[Path]:
    """The shipped packs' tests: ``*_test.yaml`` in the installed ``mechwatch_rules``."""
    root = importlib.resources.files(RULES_PACKAGE)
    return sorted(Path(str(e)) for e in root.iterdir() if is_rule_test_file(e.name))


def cli_test(
    argv: list[str],
    *,
    limits_of: LimitsOf,
    action_validator: ActionValidator | None = None,
    detectors: DetectorCatalog | None = None,
) -> int:
    """Run test files; print failures and a summary. Returns 0 when every test passed."""
    parser = argparse.ArgumentParser(
        prog="mechwatch test",
        description="Run rule unit tests (test files in the format of docs/rules.md).",
    )
    parser.add_argument(
        "files", nargs="*", type=Path, help="test files (default: the shipped packs' tests)"
    )
    parser.add_argument("--run", default=None, help="only tests whose name matches this regex")
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    try:
        selected = re.compile(args.run) if args.run else None
    except re.error as e:
        print(
            f"mechwatch test: --run {args.run!r} is not a regular expression: {e}", file=sys.stderr
        )
        return 2
    files = args.files or shipped_test_files()
    ran = failed = broken = 0
    for path in files:
        try:
            loaded = load_test_file(path, action_validator, detectors=detectors)
        except RuleFileErrors as e:
            broken += 1
            for error in e.errors:
                print(error, file=sys.stderr)
            continue
        tests = [t for t in loaded.tests if selected is None or selected.search(t.name)]
        outcomes = [run_rule_test(t, loaded.ruleset, limits_of) for t in tests]
        bad = [o for o in outcomes if not o.passed]
        for outcome in bad:
            for failure in outcome.failures:
                print(failure.render())
        ran, failed = ran + len(outcomes), failed + len(bad)
        total = _plural(len(outcomes), "test")
        print(f"{path}: {len(bad)} of {total} failed" if bad else f"{path}: {total} passed")
    if failed or broken:
        parts = [f"{failed} of {_plural(ran, 'test')} failed"] if ran else []
        parts += [f"{_plural(broken, 'file')} did not load"] if broken else []
        print(f"FAILED: {', '.join(parts)}")
        return 1
    print(f"SUCCESS: {_plural(ran, 'test')} passed in {_plural(len(files), 'file')}")
    return 0


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"
