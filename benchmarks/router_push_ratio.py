"""How hard the routers were pushed against the rest of the model, read from recorded runs.

    python benchmarks/router_push_ratio.py [--root out/hf] [--steps 525 550] [--out FILE]

For each recorded run under ``--root`` (``<run>/events.jsonl``, e.g. from
``benchmarks/detection_hf.py --root``): at each of ``--steps``, the routers' push R (the median
over the routers of ``router_update_rel_norm`` at that read-out over its median of the 8
read-outs before), the same for the block's other matrices, C (``control_update_rel_norm``:
V, O and MLP updates), and R / C; and over the whole run from step 300, the largest R / C and
where. A fault in the routers moves R alone; a change of the whole model's learning rate or
batch moves both. A measurement for choosing a rule (issue 13), not a rule.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

from agent.eventlog import read_events

WINDOW = 8  # read-outs in the rolling median a push is measured against
ROUTER, CONTROL = "router_update_rel_norm", "control_update_rel_norm"


def series(events: Path) -> dict[str, dict[str, dict[int, float]]]:
    """metric -> series name -> step -> value, for the router and control update norms."""
    out: dict[str, dict[str, dict[int, float]]] = {
        ROUTER: defaultdict(dict),
        CONTROL: defaultdict(dict),
    }
    for record in read_events(events, "metrics"):
        for step, name, labels, value in record["samples"]:
            if name in out:
                out[name][json.dumps(labels, sort_keys=True)][step] = value
    return out


def push(by_name: dict[str, dict[int, float]], step: int) -> float | None:
    """The median over the series of value(step) / median(the WINDOW values before step)."""
    ratios = []
    for values in by_name.values():
        before = [values[s] for s in sorted(values) if s < step][-WINDOW:]
        if step in values and len(before) >= WINDOW // 2 and statistics.median(before) > 0:
            ratios.append(values[step] / statistics.median(before))
    return statistics.median(ratios) if ratios else None


def row(run: Path, steps: list[int]) -> str:
    data = series(run / "events.jsonl")
    cells = []
    for step in steps:
        r, c = push(data[ROUTER], step), push(data[CONTROL], step)
        cells.append(f"{r:.2f} / {c:.2f} = {r / c:.2f}" if r and c else "-")
    read_outs = sorted({s for values in data[ROUTER].values() for s in values if s >= 300})
    worst = max(
        (
            (r / c, s)
            for s in read_outs
            if (r := push(data[ROUTER], s)) and (c := push(data[CONTROL], s))
        ),
        default=None,
    )
    most = f"{worst[0]:.2f} at {worst[1]}" if worst else "-"
    return f"| {run.name} | " + " | ".join(cells) + f" | {most} |"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", type=Path, default=Path("out/hf"))
    p.add_argument("--steps", type=int, nargs="+", default=[525, 550])
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    runs = sorted(d for d in args.root.iterdir() if (d / "events.jsonl").exists())
    lines = [
        "| run | " + " | ".join(f"R / C = R/C at {s}" for s in args.steps) + " | largest R/C |",
        "|---" * (len(args.steps) + 2) + "|",
        *(row(run, args.steps) for run in runs),
    ]
    print("\n".join(lines))
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
