"""Test-bed campaign: scenarios x seeds, then the orderings docs/testbed.md reports.

    python benchmarks/testbed_campaign.py --seeds 0 1 2 3 4 --out out/campaign

Runs every scenario preset for every seed (``--workers`` processes, one torch thread each;
runs whose summary.json exists are reused), then prints per run: wall time, ms/step, final EMA
loss, loss divergence step, loss degradation step against the clean run of the same seed, and
the first departure of H(Delta_2), H(dW_q) and the routing entropy from the clean band of the
*other* seeds' clean runs (divergence.py and bands.py hold the definitions). Extra arms:
``--variant NAME:SCENARIO:JSON`` (for example ``fa5:fa_precision:{"fa_bits":5}``).
"""

from __future__ import annotations

import argparse
import json
import os
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from agent import samples as names
from agent.testbed.bands import earliest_departure
from agent.testbed.divergence import degradation_step, divergence_step, ema
from agent.testbed.metrics_file import read_metrics
from agent.testbed.scenarios import SCENARIOS

Arm = tuple[str, str, dict[str, Any]]  # (arm name, scenario, overrides)


def _run(arm: Arm, seed: int, steps: int | None, out: str) -> str:
    import torch

    from agent.testbed.runner import run_scenario
    from agent.testbed.scenarios import ScenarioConfig

    torch.set_num_threads(1)
    name, scenario, overrides = arm
    run_dir = Path(out) / f"{name}_s{seed}"
    if not (run_dir / "summary.json").exists():
        config = ScenarioConfig.preset(scenario, seed=seed, steps=steps, **overrides)
        run_scenario(config, run_dir, plot=True)
    return str(run_dir)


def _fmt(x: object) -> str:
    if x is None:
        return "-"
    if isinstance(x, tuple):
        return f"{x[0]} ({x[1].split('.')[1]})"  # step (layer index)
    if isinstance(x, float):
        return f"{x:.3f}"
    return str(x)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    p.add_argument("--steps", type=int, default=None, help="steps per run (preset default)")
    p.add_argument(
        "--scenarios",
        nargs="+",
        default=["clean", "control", "fa_precision", "router_instability"],
        choices=SCENARIOS,
    )
    p.add_argument("--variant", action="append", default=[], help="NAME:SCENARIO:JSON")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--out", default="out/campaign")
    args = p.parse_args()

    arms: list[Arm] = [(s, s, {}) for s in args.scenarios]
    for v in args.variant:
        name, scenario, raw = v.split(":", 2)
        arms.append((name, scenario, json.loads(raw)))
    if "clean" not in [a[0] for a in arms]:
        arms.insert(0, ("clean", "clean", {}))
    jobs = [(arm, seed) for arm in arms for seed in args.seeds]
    os.makedirs(args.out, exist_ok=True)
    with ProcessPoolExecutor(max_workers=args.workers) as pool:
        dirs = list(
            pool.map(
                _run, *zip(*jobs, strict=True), [args.steps] * len(jobs), [args.out] * len(jobs)
            )
        )
    runs = {
        (arm[0], seed): (
            read_metrics(Path(d) / "metrics.jsonl"),
            json.loads((Path(d) / "summary.json").read_text()),
        )
        for (arm, seed), d in zip(jobs, dirs, strict=True)
    }

    header = (
        "arm",
        "seed",
        "wall_s",
        "ms/step",
        "final",
        "diverge",
        "degrade",
        "H(D2)_dep",
        "H(dWq)_dep",
        "H_route_dep",
        "fault_on",
    )
    print(" | ".join(header))
    for arm in arms:
        for seed in args.seeds:
            records, summary = runs[(arm[0], seed)]
            losses = [r["loss"] for r in records]
            clean_losses = [r["loss"] for r in runs[("clean", seed)][0]]
            others = [runs[("clean", s)][0] for s in args.seeds if s != seed] or [
                runs[("clean", seed)][0]
            ]
            row = (
                arm[0],
                seed,
                summary["wall_seconds"],
                summary["ms_per_step"],
                ema(losses)[-1],
                divergence_step(losses),
                degradation_step(losses, clean_losses) if arm[0] != "clean" else None,
                earliest_departure(records, others, names.QK_DELTA2_ENTROPY),
                earliest_departure(records, others, names.DWQ_ENTROPY),
                earliest_departure(records, others, names.ROUTER_ENTROPY),
                summary["fault_start"] if arm[0] != "clean" else None,
            )
            print(" | ".join(_fmt(x) for x in row), flush=True)


if __name__ == "__main__":
    main()
