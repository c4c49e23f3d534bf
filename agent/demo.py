"""``mechwatch demo``: a test-bed run goes bad silently, the agent notices early, says why,
fixes it and pages; then a picture shows it.

Runs on CPU. Pages go to the console unless Slack is configured in the environment
(``SLACK_BOT_TOKEN`` + ``MECHWATCH_SLACK_CHANNEL``, or ``SLACK_WEBHOOK_URL``), then to Slack.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from agent.eventlog import read_events
from agent.testbed.scenarios import ScenarioConfig
from agent.testbed.supervised import (
    SupervisedResult,
    default_agent_config,
    run_supervised,
    set_threads,
)

# name -> (steps, fault start); the presets' knobs are the documented test-bed faults.
LENGTHS = {"fast": (1000, 500), "default": (1500, 500), "long": (3000, 500)}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mechwatch demo", description=__doc__.splitlines()[0])
    p.add_argument(
        "--scenario",
        choices=["fa_precision", "router_instability", "combined"],
        default="fa_precision",
    )
    p.add_argument("--seed", type=int, default=0)
    length = p.add_mutually_exclusive_group()
    length.add_argument("--fast", action="store_true", help="a shorter run")
    length.add_argument("--long", action="store_true", help="a longer run")
    p.add_argument("--steps", type=int, default=None, help="override the run length")
    p.add_argument("--fault-start", type=int, default=None, help="override the fault's step")
    p.add_argument("--no-remediation", action="store_true", help="detect and page only")
    p.add_argument(
        "--compare", action="store_true", help="also run without the agent and a clean run"
    )
    p.add_argument("--out", type=Path, default=Path("mechwatch_demo"), help="output folder")
    return p


def _progress_printer(total: int):
    start = time.perf_counter()

    def show(step: int, loss: float, agent: Any) -> None:
        if step % 25 and step != total - 1:
            return
        incident = agent.incident
        state = "watching" if incident is None else f"INCIDENT {incident.family}"
        done = int(30 * (step + 1) / total)
        bar = "#" * done + "." * (30 - done)
        elapsed = time.perf_counter() - start
        sys.stdout.write(
            f"\r[{bar}] step {step + 1:>5}/{total}  loss {loss:6.3f}  {state:<32} {elapsed:5.0f}s"
        )
        sys.stdout.flush()

    return show


def run_demo(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    set_threads(1)
    steps, fault_start = LENGTHS["fast" if args.fast else "long" if args.long else "default"]
    steps = args.steps or steps
    fault_start = args.fault_start if args.fault_start is not None else fault_start
    args.out.mkdir(parents=True, exist_ok=True)
    scenario = ScenarioConfig.preset(
        args.scenario, seed=args.seed, steps=steps, fault_start=fault_start
    )
    remediate = not args.no_remediation
    print(
        f"mechwatch demo: {args.scenario} fault switched on at step {fault_start} of {steps}, "
        f"seed {args.seed}, {'with' if remediate else 'without'} remediation"
    )
    config = default_agent_config(
        args.out / "agent",
        remediate=remediate,
        notify={"console": "auto", "event_log": None},
    )
    result = run_supervised(scenario, config, progress=_progress_printer(steps))
    print()
    baselines: dict[str, SupervisedResult] = {}
    if args.compare:
        for name, scen in (
            ("no agent", scenario),
            ("clean", ScenarioConfig.preset("clean", seed=args.seed, steps=steps)),
        ):
            print(f"running the {name} reference ...")
            ref_cfg = default_agent_config(
                args.out / name.replace(" ", "_"),
                remediate=False,
                checkpoints={"enabled": False},
            )
            baselines[name] = run_supervised(scen, ref_cfg)
    summary = _summary(result, baselines, fault_start)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    picture = plot_demo(args.out / "agent" / "events.jsonl", result, args.out / "report.png")
    _print_summary(summary)
    print(f"event log: {args.out / 'agent' / 'events.jsonl'}\npicture:   {picture}")
    return 0


def _summary(
    result: SupervisedResult, baselines: dict[str, SupervisedResult], fault_start: int
) -> dict[str, Any]:
    first_alert = min(result.first_alert.values()) if result.first_alert else None
    out: dict[str, Any] = {
        "scenario": result.scenario,
        "seed": result.seed,
        "steps": result.steps,
        "fault_start": fault_start,
        "first_alert_step": first_alert,
        "first_alert_by_family": result.first_alert,
        "onset_step": result.onset_step,
        "attribution": result.attribution,
        "actions": [a for a in result.actions if a.get("status") in ("applied", "dry_run")],
        "rolled_back_steps": result.rolled_back_steps,
        "halted": result.halted,
        "final_loss": round(result.final_loss(), 4),
        "loss_divergence_step": result.divergence_step,
        "wall_s": round(result.wall_s, 1),
    }
    if "no agent" in baselines:
        out["loss_divergence_step_without_agent"] = baselines["no agent"].divergence_step
        out["final_loss_without_agent"] = round(baselines["no agent"].final_loss(), 4)
    if "clean" in baselines:
        out["final_loss_clean"] = round(baselines["clean"].final_loss(), 4)
    return out


def _print_summary(s: dict[str, Any]) -> None:
    print("\n== summary ==")
    print(f"fault switched on at step   {s['fault_start']}")
    print(f"first alert at step         {s['first_alert_step']}  {s['first_alert_by_family']}")
    print(f"estimated onset step        {s['onset_step']}")
    print(f"attribution                 {s['attribution']}")
    for a in s["actions"]:
        mark = "(dry run) " if a.get("dry_run") else ""
        print(f"action at step {a['step']:<6}      {mark}{a['action']}: {a['detail']}")
    print(f"steps rolled back           {s['rolled_back_steps']}")
    print(f"loss divergence step        {s['loss_divergence_step']}")
    if "loss_divergence_step_without_agent" in s:
        print(f"  ... without the agent     {s['loss_divergence_step_without_agent']}")
    print(f"final loss (last 100 steps) {s['final_loss']}")
    for key, label in (
        ("final_loss_without_agent", "without the agent"),
        ("final_loss_clean", "clean run"),
    ):
        if key in s:
            print(f"  ... {label:<22}{s[key]}")
    print(f"wall time                   {s['wall_s']} s")


def plot_demo(events_path: Path, result: SupervisedResult, png: Path) -> Path:
    """Loss and the monitors on one step axis, with fault, onset, alert and action steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # One segment per trajectory: a rollback makes the steps go back, and the abandoned path
    # (the collapse that triggered it) is drawn faded next to the path the run continued on.
    segments: list[dict] = []
    last_step = None
    for e in read_events(events_path, kinds=("metrics",)):
        if last_step is None or e["step"] < last_step:
            segments.append(defaultdict(lambda: defaultdict(lambda: defaultdict(list))))
        last_step = e["step"]
        for step, metric, labels, value in e["samples"]:
            name = labels.get("layer") or labels.get("router")
            if metric in ("qk_delta2_entropy", "dwq_entropy", "router_entropy_norm"):
                segments[-1][metric][name][step].append(value)
    fig, axes = plt.subplots(4, 1, figsize=(10, 11), sharex=True)
    axes[0].plot(range(len(result.losses)), result.losses, lw=0.6, color="black")
    axes[0].set_ylabel("loss (nats)")
    panels = (
        (axes[1], "qk_delta2_entropy", "H(Delta_2), mean over heads"),
        (axes[2], "dwq_entropy", "H(dW_q), mean over heads"),
        (axes[3], "router_entropy_norm", "routing entropy / ln E"),
    )
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, metric, label in panels:
        for index, segment in enumerate(segments):
            final = index == len(segments) - 1
            for k, (name, points) in enumerate(sorted(segment[metric].items())):
                steps = sorted(points)
                values = [sum(points[t]) / len(points[t]) for t in steps]
                ax.plot(
                    steps,
                    values,
                    lw=1.0,
                    color=colors[k % len(colors)],
                    alpha=1.0 if final else 0.45,
                    ls="-" if final else "--",
                    label=name if final else None,
                )
        ax.set_ylabel(label)
        ax.legend(fontsize=7, loc="lower left")
    marks = [(result.fault_start, "fault on", "red")]
    if result.onset_step is not None:
        marks.append((result.onset_step, "onset", "orange"))
    if result.first_alert:
        marks.append((min(result.first_alert.values()), "first alert", "purple"))
    for a in result.actions:
        if a.get("status") == "applied":
            marks.append((a["step"], a["action"], "green"))
    for ax in axes:
        for step, _, color in marks:
            if step is not None:
                ax.axvline(step, color=color, ls="--", lw=0.8)
    for step, text, color in marks:
        if step is not None:
            axes[0].annotate(
                text,
                (step, 1.0),
                xycoords=("data", "axes fraction"),
                rotation=90,
                va="top",
                ha="right",
                fontsize=7,
                color=color,
            )
    axes[-1].set_xlabel("step")
    fig.suptitle(
        f"mechwatch demo: {result.scenario}, seed {result.seed} (attributed: {result.attribution})"
    )
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


def cli_demo(argv: list[str]) -> int:
    return run_demo(argv)
