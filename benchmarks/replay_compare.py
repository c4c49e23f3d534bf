"""Replay recorded runs through an older rule file and through the shipped packs: the router
alert each gives (and which rule), and the new attribution at the first page and at the end.

    git show f14718e:rules/router.yaml > /tmp/router_old.yaml
    python benchmarks/replay_compare.py --old /tmp/router_old.yaml --roots out/e2 out/hf3

Prints a markdown table, one row per run folder (``events.jsonl``; twins are skipped).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from agent.replay import replay
from remediations.registry import validate_action

_RULE_WORDS = {
    "routing_entropy_collapse": "ratio",
    "routing_entropy_collapse_hard_push": "hard push",
}


def row(run: Path, old: Path) -> str:
    events = run / "events.jsonl"
    before = replay(events, [old], action_validator=validate_action).first_firing()
    after = replay(events, action_validator=validate_action)
    first = after.first_firing_by_rule()
    fired = sorted((step, rule) for rule, step in first.items() if rule in _RULE_WORDS)
    alerts = ", ".join(f"{step} ({_RULE_WORDS[rule]})" for step, rule in fired) or "-"
    return (
        f"| {run} | {before.get('router_instability', '-')} | {alerts} | "
        f"{after.paged_attribution() or '-'} | {after.attribution() or '-'} |"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--old", type=Path, required=True, help="the older router rule file")
    p.add_argument("--roots", type=Path, nargs="+", required=True)
    args = p.parse_args(argv)
    runs = sorted({e.parent for root in args.roots for e in root.rglob("events.jsonl")})
    print("| run | old router rule: router alert | new: router alert (rule) | paged as | at end |")
    print("|---|---|---|---|---|")
    for run in runs:
        if "twins" in run.parts:
            continue
        print(row(run, args.old), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
