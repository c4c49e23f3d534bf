"""How hard each layer's QK update was pushed against its block's other weights, from recordings.

    python benchmarks/qk_push_ratio.py --root out/hf [--out FILE]

For each recorded run under ``--root`` (``<run>/events.jsonl``, e.g. from
``benchmarks/detection_hf.py --root`` or ``benchmarks/detection.py record``) and each attention
layer, at every QK evaluation from step 300: the QK push Q (the median over the layer's heads
of ``qk_delta2_frobenius`` over its median of the 8 evaluations before), the controls' push C
(the same for ``control_update_rel_norm``: V, O and MLP updates of the same block) and Q / C.
A biased attention backward pushes Q and K alone, step after step, so their update grows
against the rest of the block; a change of the whole model's learning rate moves both. Per run:
the first ``fa_precision`` firing (replayed through the shipped rules) with the largest Q / C
of any layer in the 60 steps up to it, and the largest Q / C anywhere in the run. A measurement
for choosing a rule (issue 13), not a rule.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

from router_push_ratio import push  # the same rolling-median push, on attention

from agent.eventlog import read_events

QK, CONTROL = "qk_delta2_frobenius", "control_update_rel_norm"
Series = dict[str, dict[str, dict[int, float]]]  # layer -> series name -> step -> value


def series(events: Path) -> dict[str, Series]:
    """metric -> layer -> series (head or param) -> step -> value."""
    out: dict[str, Series] = {
        name: defaultdict(lambda: defaultdict(dict)) for name in (QK, CONTROL)
    }
    for record in read_events(events, "metrics"):
        for step, name, labels, value in record["samples"]:
            if name in out:
                key = json.dumps(labels, sort_keys=True)
                out[name][labels["layer"]][key][step] = value
    return out


def ratios(data: dict[str, Series]) -> list[tuple[float, int, str, float, float]]:
    """(Q / C, step, layer, Q, C) at every evaluation from step 300 of every layer."""
    out = []
    for layer, heads in data[QK].items():
        controls = data[CONTROL].get(layer, {})
        steps = sorted({s for values in heads.values() for s in values if s >= 300})
        for step in steps:
            q, c = push(heads, step), push(controls, step)
            if q and c:
                out.append((q / c, step, layer, q, c))
    return out


def row(run: Path) -> str:
    from agent.replay import replay
    from remediations.registry import validate_action

    events = run / "events.jsonl"
    first = replay(events, action_validator=validate_action).first_firing().get("fa_precision")
    every = ratios(series(events))
    worst = max(every, default=None)
    most = f"{worst[0]:.2f} at {worst[1]} ({worst[2]}: {worst[3]:.2f} / {worst[4]:.2f})"
    if first is None:
        return f"| {run.name} | - | - | {most if worst else '-'} |"
    near = [r for r in every if first - 60 <= r[1] <= first]
    top = max(near, default=None)
    at = f"{top[0]:.2f} at {top[1]} ({top[2]}: {top[3]:.2f} / {top[4]:.2f})" if top else "-"
    return f"| {run.name} | {first} | {at} | {most if worst else '-'} |"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", type=Path, nargs="+", default=[Path("out/hf")])
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    runs = sorted(d for root in args.root for d in root.iterdir() if (d / "events.jsonl").exists())
    lines = [
        "| run | first fa_precision firing | largest Q / C in the 60 steps to it "
        "(layer: Q / C) | largest Q / C from step 300 |",
        "|---|---|---|---|",
        *(row(run) for run in runs),
    ]
    print("\n".join(lines))
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
