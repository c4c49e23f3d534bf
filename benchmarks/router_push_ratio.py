"""How hard the routers were pushed against the rest of the model, read from recorded runs.

    python benchmarks/router_push_ratio.py [--root out/hf] [--steps 525 550] [--out FILE]
        [--entropy 500 525 550 600 700 1000 1975] [--at-fa-alert]

For each recorded run under ``--root`` (``<run>/events.jsonl``, e.g. from
``benchmarks/detection_hf.py --root``): at each of ``--steps``, the routers' push R (the median
over the routers of ``router_update_rel_norm`` at that read-out over its median of the 8
read-outs before), the same for the block's other matrices, C (``control_update_rel_norm``:
V, O and MLP updates), and R / C; and over the whole run from step 300, the largest R / C and
where. A fault in the routers moves R alone; a change of the whole model's learning rate or
batch moves both. With ``--entropy STEPS``, a second table: each run's routing entropy (the
median over the routers of ``router_entropy_norm``, a fraction of ln E) at those read-outs, and
each router's lowest value over steps 500-1000: how far the routers collapsed, to compare a run
with its clean twin. With ``--at-fa-alert``, a third: each run's first ``fa_precision`` firing
(replayed through the shipped rules) and the largest C over the QK evaluations of the 60 steps
up to it: whether the rest of the model was pushed when the FA rule fired. A measurement for
choosing a rule (issue 13), not a rule.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections import defaultdict
from pathlib import Path

from agent.eventlog import read_events

WINDOW = 8  # read-outs in the rolling median a push is measured against
ROUTER, CONTROL = "router_update_rel_norm", "control_update_rel_norm"
ENTROPY = "router_entropy_norm"


def series(events: Path) -> dict[str, dict[str, dict[int, float]]]:
    """metric -> series name -> step -> value, for the router and control update norms and
    the routing entropy."""
    out: dict[str, dict[str, dict[int, float]]] = {
        ROUTER: defaultdict(dict),
        CONTROL: defaultdict(dict),
        ENTROPY: defaultdict(dict),
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


def entropy_row(run: Path, steps: list[int]) -> str:
    """The routers' median entropy at ``steps``; each router's lowest over steps 500-1000."""
    by_router = series(run / "events.jsonl")[ENTROPY]
    cells = []
    for step in steps:
        values = [v[step] for v in by_router.values() if step in v]
        cells.append(f"{statistics.median(values):.3f}" if values else "-")
    lowest = [
        min((v for s, v in values.items() if 500 <= s <= 1000), default=math.nan)
        for _, values in sorted(by_router.items())
    ]
    return f"| {run.name} | " + " | ".join(cells) + f" | {', '.join(f'{x:.3f}' for x in lowest)} |"


def fa_alert_row(run: Path) -> str:
    """The first fa_precision firing and the controls' largest push in the 60 steps to it."""
    from agent.replay import replay
    from remediations.registry import validate_action

    first = replay(run / "events.jsonl", action_validator=validate_action).first_firing()
    step = first.get("fa_precision")
    if step is None:
        return f"| {run.name} | - | - |"
    controls = series(run / "events.jsonl")[CONTROL]
    evaluations = sorted({s for values in controls.values() for s in values})
    pushes = [c for s in evaluations if step - 60 <= s <= step and (c := push(controls, s))]
    return (
        f"| {run.name} | {step} | {max(pushes):.2f} |" if pushes else f"| {run.name} | {step} | - |"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", type=Path, default=Path("out/hf"))
    p.add_argument("--steps", type=int, nargs="+", default=[525, 550])
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--entropy", type=int, nargs="*", default=None, help="read-out steps")
    p.add_argument("--at-fa-alert", action="store_true", help="C at each run's first FA alert")
    args = p.parse_args(argv)
    runs = sorted(d for d in args.root.iterdir() if (d / "events.jsonl").exists())
    lines = [
        "| run | " + " | ".join(f"R / C = R/C at {s}" for s in args.steps) + " | largest R/C |",
        "|---" * (len(args.steps) + 2) + "|",
        *(row(run, args.steps) for run in runs),
    ]
    if args.entropy:
        lines += [
            "",
            "| run | "
            + " | ".join(f"entropy at {s}" for s in args.entropy)
            + " | each router's lowest, 500-1000 |",
            "|---" * (len(args.entropy) + 2) + "|",
            *(entropy_row(run, args.entropy) for run in runs),
        ]
    if args.at_fa_alert:
        lines += [
            "",
            "| run | first fa_precision firing | largest C in the 60 steps to it |",
            "|---|---|---|",
            *(fa_alert_row(run) for run in runs),
        ]
    print("\n".join(lines))
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
