"""``mechwatch demo``: a test-bed run goes bad silently, the agent notices early, says why,
fixes it and pages; then a picture and a report (``mechwatch report``) show it.

Runs on CPU. Pages go to the console unless Slack is configured in the environment
(``SLACK_BOT_TOKEN`` + ``MECHWATCH_SLACK_CHANNEL``, or ``SLACK_WEBHOOK_URL``), then to Slack.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from agent.notify.action_text import action_sentence
from agent.notify.console import STATUS_LINE
from agent.report.build import build_report
from agent.report.figures import draw_path
from agent.report.markers import Mark, draw_marks, title_above
from agent.report.timeline import read_timeline
from agent.testbed.scenarios import ScenarioConfig
from agent.testbed.supervised import (
    SupervisedResult,
    default_agent_config,
    run_supervised,
    set_threads,
)

# name -> (steps, fault start); the presets' knobs are the documented test-bed faults.
LENGTHS = {"fast": (1500, 500), "default": (2000, 500), "long": (3000, 500)}
# The demo's FA fault: floor (biased) rounding of dS to 7 explicit mantissa bits, bf16's width,
# so a fault a real bf16 attention backward could produce. Since 2026-12-07 the kernel audit
# pages it at its first audit after switch-on (seed 0: step 501, rolled back to the checkpoint
# of step 400); the H(Delta_2) rules alone alerted ~500 steps after switch-on on the tuning
# seeds (0, 1), 15-47 steps before the first loss detector, and the unwatched loss diverged
# 500-900 steps after that alert (benchmarks/results/detection.md, "where the silent phase
# is"). Stronger faults (fewer bits) are quicker and louder.
DEMO_FA_BITS = 7


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
    p.add_argument(
        "--fa-bits",
        type=int,
        default=None,
        help=f"mantissa bits of the FA fault (fa_precision: {DEMO_FA_BITS}, bf16's width)",
    )
    p.add_argument("--no-remediation", action="store_true", help="detect and page only")
    p.add_argument(
        "--compare", action="store_true", help="also run without the agent and a clean run"
    )
    p.add_argument("--out", type=Path, default=Path("mechwatch_demo"), help="output folder")
    return p


def _progress_printer(total: int):
    """The progress bar, drawn through the console's status line: a page printed meanwhile
    (on the dispatcher's thread) ends the bar's line first and redraws it below the page."""
    start = time.perf_counter()

    def show(step: int, loss: float, agent: Any) -> None:
        if step % 25 and step != total - 1:
            return
        incident = agent.incident
        state = "watching" if incident is None else f"INCIDENT {incident.family}"
        done = int(30 * (step + 1) / total)
        bar = "#" * done + "." * (30 - done)
        elapsed = time.perf_counter() - start
        STATUS_LINE.show(
            f"[{bar}] step {step + 1:>5}/{total}  loss {loss:6.3f}  {state:<32} {elapsed:5.0f}s"
        )

    return show


def run_demo(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    set_threads(1)
    steps, fault_start = LENGTHS["fast" if args.fast else "long" if args.long else "default"]
    steps = args.steps or steps
    fault_start = args.fault_start if args.fault_start is not None else fault_start
    args.out.mkdir(parents=True, exist_ok=True)
    bits = args.fa_bits or (DEMO_FA_BITS if args.scenario == "fa_precision" else None)
    knobs = {"fa_bits": bits} if bits is not None else {}
    scenario = ScenarioConfig.preset(
        args.scenario, seed=args.seed, steps=steps, fault_start=fault_start, **knobs
    )
    remediate = not args.no_remediation
    print(
        f"mechwatch demo: {args.scenario} fault switched on at step {fault_start} of {steps}"
        + (f" (dS floored to {bits} mantissa bits)" if bits is not None else "")
        + ", "
        f"seed {args.seed}, {'with' if remediate else 'without'} remediation"
    )
    config = default_agent_config(
        args.out / "agent",
        remediate=remediate,
        notify={"console": "auto", "event_log": None},
    )
    try:
        result = run_supervised(scenario, config, progress=_progress_printer(steps))
    finally:
        STATUS_LINE.end()
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
    events = args.out / "agent" / "events.jsonl"
    summary = _summary(result, baselines, fault_start, read_timeline(events).actions)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    picture = plot_demo(events, result, args.out / "report.png")
    report = build_report(events, args.out / "report.html", args.out / "report_overview.png")
    _print_summary(summary)
    print(f"event log: {events}\npicture:   {picture}\nreport:    {report.html}")
    return 0


def _summary(
    result: SupervisedResult,
    baselines: dict[str, SupervisedResult],
    fault_start: int,
    action_records: list[dict[str, Any]],
) -> dict[str, Any]:
    """``action_records``: the run's action records from its event log (before/after values
    make the sentences)."""
    first_alert = min(result.first_alert.values()) if result.first_alert else None
    actions = [
        {
            "step": a["step"],
            "action": a["action"],
            "dry_run": a.get("dry_run", False),
            "detail": a.get("detail", ""),
            "sentence": action_sentence(
                a["action"],
                a.get("detail", ""),
                a.get("before"),
                a.get("after"),
                dry_run=bool(a.get("dry_run")),
            ),
        }
        for a in action_records
        if a.get("status") in ("applied", "dry_run")
    ]
    out: dict[str, Any] = {
        "scenario": result.scenario,
        "seed": result.seed,
        "steps": result.steps,
        "fault_start": fault_start,
        "first_alert_step": first_alert,
        "first_alert_by_family": result.first_alert,
        "onset_step": result.onset_step,
        "attribution": result.attribution,
        "actions": actions,
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
        print(f"action at step {a['step']:<6}      {a['action']}: {a['sentence']}")
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

    # A rollback makes the steps go back: the abandoned path (the collapse that triggered it)
    # is drawn faded next to the path the run kept (agent.report.timeline).
    series = read_timeline(events_path).series
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
        for k, (place, path) in enumerate(series.get(metric, {}).items()):
            draw_path(ax, path, colors[k % len(colors)], place)
        ax.set_ylabel(label)
        ax.legend(fontsize=7, loc="lower left")
    marks = [Mark(result.fault_start, "fault on", "red")]
    if result.onset_step is not None:
        marks.append(Mark(result.onset_step, "onset", "orange"))
    if result.first_alert:
        marks.append(Mark(min(result.first_alert.values()), "first alert", "purple"))
    for a in result.actions:
        if a.get("status") == "applied":
            marks.append(Mark(a["step"], a["action"], "green"))
    axes[-1].set_xlabel("step")
    fig.tight_layout()
    labels = draw_marks(axes, [m for m in marks if m.step is not None])  # never overlapping
    title = f"mechwatch demo: {result.scenario}, seed {result.seed}"
    title_above(fig, axes[0], labels, f"{title} (attributed: {result.attribution})")
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return png


def cli_demo(argv: list[str]) -> int:
    return run_demo(argv)
