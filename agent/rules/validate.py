"""Command-line checks of rule files: ``mechwatch validate`` and ``mechwatch rules``.

Both take rule files or directories and default to the shipped packs. They return an exit
code instead of exiting, so the ``mechwatch`` entry point (and tests) can call them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from agent.rules.detector_catalog import DetectorCatalog
from agent.rules.errors import RuleFileErrors
from agent.rules.loader import ActionValidator, default_rule_files, load_rule_files
from agent.rules.ruleset import RuleSet


def _parse_and_load(
    prog: str,
    description: str,
    argv: list[str],
    action_validator: ActionValidator | None,
    detectors: DetectorCatalog | None,
) -> RuleSet | int:
    """The rule set the command line names, or the exit code after printing why not."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument(
        "paths", nargs="*", help="rule files or directories (default: the shipped rule packs)"
    )
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help or a usage error; argparse already printed it
        return int(e.code or 0)
    paths = args.paths or [str(p) for p in default_rule_files()]
    if not paths:
        print("no rule files given and none shipped in mechwatch_rules", file=sys.stderr)
        return 1
    try:
        ruleset = load_rule_files(paths, action_validator, detectors=detectors)
    except RuleFileErrors as e:
        for error in e.errors:
            print(error, file=sys.stderr)
        return 1
    for warning in ruleset.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    return ruleset


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def cli_validate(
    argv: list[str],
    *,
    action_validator: ActionValidator | None = None,
    detectors: DetectorCatalog | None = None,
) -> int:
    """Check rule files; print every error (one per line, to stderr) and return 1 if any,
    else print a one-line OK summary and return 0. Warnings are printed but do not fail."""
    description = "Check mechwatch rule files."
    ruleset = _parse_and_load("mechwatch validate", description, argv, action_validator, detectors)
    if isinstance(ruleset, int):
        return ruleset
    summary = (
        f"OK: {_plural(len(ruleset), 'rule')} in {_plural(len(ruleset.groups), 'group')} "
        f"from {_plural(len(ruleset.files), 'file')}"
    )
    if ruleset.warnings:
        summary += f", {_plural(len(ruleset.warnings), 'warning')}"
    print(summary)
    return 0


def cli_list(
    argv: list[str],
    *,
    action_validator: ActionValidator | None = None,
    detectors: DetectorCatalog | None = None,
) -> int:
    """List loaded rules as a table: file, group, rule, metric, detector, family, severity,
    actions. Returns 1 (after printing the errors) when the files do not load."""
    description = "List mechwatch rules."
    ruleset = _parse_and_load("mechwatch rules", description, argv, action_validator, detectors)
    if isinstance(ruleset, int):
        return ruleset
    header = ("FILE", "GROUP", "RULE", "METRIC", "DETECTOR", "FAMILY", "SEVERITY", "ACTIONS")
    rows = [header]
    for rule in ruleset:
        rows.append(
            (
                Path(rule.path).name,
                rule.group,
                rule.name if rule.enabled else f"{rule.name} (disabled)",
                rule.metric,
                str(rule.detector),
                rule.family,
                rule.severity,
                ", ".join(str(a) for a in rule.actions) or "-",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header) - 1)]
    for row in rows:
        cells = [cell.ljust(width) for cell, width in zip(row[:-1], widths, strict=True)]
        print("  ".join([*cells, row[-1]]).rstrip())
    return 0
