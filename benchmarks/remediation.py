"""Remediation on the test bed: fault runs with the default rules and actions on, against the
clean run and the unremediated (detect-only) run of the same seed.

Run: python benchmarks/remediation.py [--steps 1500] [--seeds 0 1 2] [--root out/remediation_ref]
         [--out benchmarks/results/remediation.md]

Clean and detect-only runs are recorded under --root (reused when recorded with the same
steps). Reported per run: the actions applied, steps rolled back, the
final loss (mean of the last 100 steps) against the clean run, the loss-divergence step with
and without the agent, and for router faults the routing entropy at the end against the clean
runs' band: [min, max] of the clean runs' end entropy over every clean seed recorded under
--root (at least the benchmarked seeds), widened by 15 % of the value (the rule of
agent.testbed.bands.clean_band).

--router-lr-mult M runs the router fault with the router LR multiplied by M instead of the
preset's 30 (its detect-only runs are recorded under --root as router_instability_xM_s<seed>):
the same rules against faults of other strengths.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from provenance import provenance

from agent.eventlog import read_events
from agent.testbed.bands import clean_band
from agent.testbed.scenarios import ScenarioConfig
from agent.testbed.supervised import default_agent_config, run_supervised, set_threads


def _preset(scenario: str, seed: int, steps: int, router_lr_mult: float | None) -> ScenarioConfig:
    extra = {} if router_lr_mult is None else {"router_lr_mult": router_lr_mult}
    return ScenarioConfig.preset(scenario, seed=seed, steps=steps, **extra)


def _label(scenario: str, router_lr_mult: float | None) -> str:
    return scenario if router_lr_mult is None else f"{scenario}_x{router_lr_mult:g}"


def _recorded(
    root: Path, scenario: str, seed: int, steps: int, router_lr_mult: float | None = None
) -> dict:
    folder = root / f"{_label(scenario, router_lr_mult)}_s{seed}"
    result = folder / "result.json"
    if result.exists():
        data = json.loads(result.read_text())
        if data["steps"] == steps:
            return data
    config = default_agent_config(folder, remediate=False, checkpoints={"enabled": False})
    data = run_supervised(_preset(scenario, seed, steps, router_lr_mult), config).to_dict()
    folder.mkdir(parents=True, exist_ok=True)
    result.write_text(json.dumps(data, default=str))
    return data


def _final_router_entropy(events: Path) -> dict[str, float]:
    """Mean normalized routing entropy per router over the last 4 read-outs."""
    per: dict[str, list[float]] = {}
    for e in read_events(events, kinds=("metrics",)):
        for _, metric, labels, value in e["samples"]:
            if metric == "router_entropy_norm":
                per.setdefault(labels["router"], []).append(value)
    return {k: sum(v[-4:]) / len(v[-4:]) for k, v in per.items()}


def _end_band(root: Path, seeds: list[int], steps: int) -> dict[str, tuple[float, float]]:
    """Per router: the clean band of the end entropy over the clean runs under ``root``."""
    found = {int(f.name.split("_s")[1]) for f in root.glob("clean_s*") if f.is_dir()}
    ends = []
    for seed in sorted(found | set(seeds)):  # the benchmarked seeds at least
        _recorded(root, "clean", seed, steps)  # re-run when recorded with another step count
        ends.append(_final_router_entropy(root / f"clean_s{seed}" / "events.jsonl"))
    band = {}
    for router in ends[0]:
        series = [((0,), (end[router],)) for end in ends]
        band[router] = clean_band(series).bounds[0]
    return band


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--scenarios", nargs="+", default=["fa_precision", "router_instability"])
    p.add_argument("--root", type=Path, default=Path("out/remediation_ref"))
    p.add_argument("--work", type=Path, default=Path("out/remediation"))
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--router-lr-mult", type=float, default=None, help="router fault strength")
    args = p.parse_args(argv)
    set_threads(1)
    cols = [
        "scenario",
        "seed",
        "actions applied",
        "rolled back",
        "final loss",
        "clean",
        "gap",
        "detect-only final",
        "divergence (detect-only)",
        "divergence (agent)",
        "router H end",
        "router H clean end",
        "clean band",
        "in band",
    ]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    gaps = []
    band = _end_band(args.root, args.seeds, args.steps)
    in_band_runs: list[bool] = []
    for scenario in args.scenarios:
        for seed in args.seeds:
            mult = args.router_lr_mult if scenario in ("router_instability", "combined") else None
            clean = _recorded(args.root, "clean", seed, args.steps)
            detect = _recorded(args.root, scenario, seed, args.steps, mult)
            folder = args.work / f"{_label(scenario, mult)}_s{seed}"
            shutil.rmtree(folder, ignore_errors=True)  # a fresh run: no earlier events or files
            config = default_agent_config(folder, remediate=True)
            result = run_supervised(_preset(scenario, seed, args.steps, mult), config)
            applied = [
                a["action"] + (" (relaxed)" if a.get("follow_up") else "")
                for a in result.actions
                if a.get("status") == "applied"
            ]
            gap = result.final_loss() / clean["final_loss"] - 1
            gaps.append((scenario, seed, gap))
            h_end = _final_router_entropy(folder / "events.jsonl")
            h_clean = _final_router_entropy(args.root / f"clean_s{seed}" / "events.jsonl")
            inside = all(band[r][0] <= v <= band[r][1] for r, v in h_end.items())
            if scenario in ("router_instability", "combined"):
                in_band_runs.append(inside)
            row = [
                _label(scenario, mult),
                seed,
                ", ".join(applied) or "-",
                result.rolled_back_steps,
                f"{result.final_loss():.4f}",
                f"{clean['final_loss']:.4f}",
                f"{gap:+.1%}",
                f"{detect['final_loss']:.4f}",
                detect["divergence_step"],
                result.divergence_step,
                " / ".join(f"{v:.2f}" for v in h_end.values()),
                " / ".join(f"{v:.2f}" for v in h_clean.values()),
                " / ".join(f"{lo:.2f}-{hi:.2f}" for lo, hi in band.values()),
                "yes" if inside else "no",
            ]
            lines.append("| " + " | ".join("-" if x is None else str(x) for x in row) + " |")
            print(lines[-1], flush=True)
    header = provenance()
    within = sum(1 for _, _, g in gaps if abs(g) <= 0.05)
    summary = [
        "",
        f"- final loss within 5% of the clean run: {within} of {len(gaps)} runs",
        f"- router-fault runs ending with every router's entropy in the clean band: "
        f"{sum(in_band_runs)} of {len(in_band_runs)}",
        "- router H: mean normalized routing entropy (of ln E) over the last 4 read-outs, "
        "per router (layer 0 / layer 1)",
    ]
    text = "\n".join(header + lines + summary)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
