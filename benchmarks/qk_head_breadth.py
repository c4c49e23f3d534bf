"""How many heads of a layer fall at once: per-head H(Delta_2) falls, from recordings.

    python benchmarks/qk_head_breadth.py --root out/hf [--out FILE]

For each recorded run under ``--root`` (``<run>/events.jsonl``) and each attention layer, every
head's fall at an evaluation: H(Delta_2) over its median of the 8 evaluations before (1.0: no
change; 0.4: fell 60%). Per run: at the first ``fa_precision`` firing (replayed through the
shipped rules), each layer's heads sorted; and the evaluation from step 300 where a layer's
heads fell most on average. A biased backward enters every head's dS; a healthy transition may
move a few heads. A measurement for choosing a rule (issue 13), not a rule.
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict
from pathlib import Path

from agent.eventlog import read_events

WINDOW = 8  # evaluations in the rolling median a fall is measured against
Heads = dict[str, dict[int, float]]  # head -> step -> H(Delta_2)


def series(events: Path) -> dict[str, Heads]:
    """layer -> head -> step -> H(Delta_2) in nats."""
    out: dict[str, Heads] = defaultdict(lambda: defaultdict(dict))
    for record in read_events(events, "metrics"):
        for step, name, labels, value in record["samples"]:
            if name == "qk_delta2_entropy":
                out[labels["layer"]][labels["head"]][step] = value
    return out


def falls(heads: Heads, step: int) -> list[float]:
    """Each head's H(step) / median(its WINDOW values before step), sorted."""
    out = []
    for values in heads.values():
        before = [values[s] for s in sorted(values) if s < step][-WINDOW:]
        if step in values and len(before) >= WINDOW // 2 and statistics.median(before) > 0:
            out.append(values[step] / statistics.median(before))
    return sorted(out)


def _short(layer: str) -> str:
    return next((p for p in layer.split(".") if p.isdigit()), layer)


def _fmt(ratios: list[float]) -> str:
    return ", ".join(f"{r:.2f}" for r in ratios)


def row(run: Path) -> str:
    from agent.replay import replay
    from remediations.registry import validate_action

    events = run / "events.jsonl"
    first = replay(events, action_validator=validate_action).first_firing().get("fa_precision")
    data = series(events)
    lowest = None  # (mean fall, step, layer, falls)
    for layer, heads in data.items():
        for step in sorted({s for values in heads.values() for s in values if s >= 300}):
            ratios = falls(heads, step)
            if ratios and (lowest is None or statistics.mean(ratios) < lowest[0]):
                lowest = (statistics.mean(ratios), step, layer, ratios)
    at_alert = "-"
    if first is not None:
        cells = []
        for layer, heads in sorted(data.items()):
            evaluated = [s for values in heads.values() for s in values if s <= first]
            cells.append(f"{_short(layer)}: {_fmt(falls(heads, max(evaluated)))}")
        at_alert = f"{first} ({'; '.join(cells)})"
    most = (
        f"{lowest[0]:.2f} at {lowest[1]} (layer {_short(lowest[2])}: {_fmt(lowest[3])})"
        if lowest
        else "-"
    )
    return f"| {run.name} | {at_alert} | {most} |"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", type=Path, nargs="+", default=[Path("out/hf")])
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    runs = sorted(d for root in args.root for d in root.iterdir() if (d / "events.jsonl").exists())
    lines = [
        "| run | first fa_precision firing (each layer's heads' falls there) "
        "| largest mean fall of a layer's heads from step 300 |",
        "|---|---|---|",
        *(row(run) for run in runs),
    ]
    print("\n".join(lines))
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
