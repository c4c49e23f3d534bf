"""What the agent costs: whole test-bed runs with and without it, where its time goes, and one
monitor evaluation of a frontier-shaped layer stack.

Run: python benchmarks/overhead.py [--pairs 6] [--steps 400] [--variants ...] [--out FILE]
(``--steps 2000``: the test bed's default run length; ``--variants`` picks the agent variants,
the bare run is always measured.)

1. Whole runs (what a user sees): the test bed's clean run (seed 0, one torch thread) as
   separate processes, with and without a default ``Agent(model, optimizer, scheduler)``
   (every default monitor and rule, actions on, no checkpoints: the defaults), alternated
   (bare, agent, agent given the grad norm, and, to show what the mechanism monitors cost,
   an agent with the QK and router monitors off; the order rotates from pair to pair so that
   a drift of the machine hits every variant alike). A run's wall time is from building the
   model to ``agent.close()`` returning: construction, every step, the monitor thread, close.
   Importing mechwatch is a one-time cost that does not grow with the run; it is printed
   apart. Every run is listed; the overhead is given two ways, the ratio of the medians and
   the median of the pairwise ratios (each run against the bare run of its round, which
   cancels a drift of the machine between rounds), with the range of the pairwise ratios.
2. Where the time goes: ``Agent.costs()`` of the agent runs (``agent/costs.py``), per step.
   The monitor thread's cost to the training loop is not its CPU time (it runs on another
   core) but what it slows the training thread down by (the interpreter lock, caches, memory
   bandwidth). That is measured inside each agent run, where the machine's drift cancels: the
   wall time of every training step (``run.step()``, the model's forward, backward and
   optimizer step, not ``agent.step``) against the share of it during which a monitor job ran
   (the jobs' wall intervals, timed around ``MonitorThread.submit``'s function, and as the
   monitor process reports them for the jobs it runs, ``qk.worker``), fitted as
   step = idle + slope_thread x thread share + slope_process x process share (a job on the
   monitor thread and one in the process slow the training thread by different amounts: the
   interpreter lock); the contention per step is the sum of slope x mean share. The one-slope
   fit on any job is printed too, comparable with the earlier tables.
3. Frontier shape: one attention layer with d = 4096, 32 query heads of d_h = 128 and 8 KV heads
   (GQA), measured through the agent's own probe code (snapshot + compute_qk_samples) for all
   heads and for the sampled subset, extrapolated to 32 layers with the default and a sampled
   configuration; a 64-expert router's per-forward hook work on 8192 tokens; snapshot memory.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from provenance import provenance
from timing import QKLayer
from torch import nn

VARIANTS = (
    "bare",
    "agent",
    "agent, grad norm given",
    "agent, qk.budget 0.01",
    "agent, QK jobs on the thread",
    "agent, no QK / router monitors",
    "agent, qk.delta 12",
)
MONITOR = "monitor thread"  # the Costs part of the monitor jobs' CPU seconds (agent/costs.py)
# The AgentConfig keys of each agent variant (besides run_dir).
SETTINGS: dict[str, dict] = {
    "agent, qk.budget 0.01": {"qk": {"budget": 0.01}},
    "agent, QK jobs on the thread": {"qk": {"worker": "thread"}},
    "agent, no QK / router monitors": {"qk": {"enabled": False}, "router": {"enabled": False}},
    # twice the QK cadence: what a shorter cadence for fast faults costs (issue 13)
    "agent, qk.delta 12": {"qk": {"delta": 12}},
}


def child(variant: str, steps: int) -> dict:
    """One whole run in this process; returns its wall time and the agent's costs."""
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    from agent.agent import Agent  # noqa: PLC0415 - timed: the one-time import cost
    from agent.config import AgentConfig  # noqa: PLC0415
    from agent.testbed.runner import TestbedRun  # noqa: PLC0415
    from agent.testbed.scenarios import ScenarioConfig  # noqa: PLC0415

    imported = time.perf_counter() - t0
    # monitor jobs' wall intervals (perf_counter, s), on the monitor thread and in the process
    jobs: dict[str, list[tuple[float, float]]] = {"thread": [], "process": []}
    steps_timed: list[tuple[float, float]] = []  # training steps' wall intervals
    untime = _time_monitor_jobs(jobs) if variant != "bare" else lambda: None
    with tempfile.TemporaryDirectory() as run_dir:
        t0, cpu0, proc0 = time.perf_counter(), time.thread_time(), time.process_time()
        scenario = ScenarioConfig.preset("clean", seed=0, steps=steps + 1)
        run = TestbedRun(scenario, record_monitors=False)  # the bare loop: no test-bed monitors
        agent = None
        construct_s = close_s = 0.0
        if variant != "bare":
            config = AgentConfig(run_dir=run_dir, **SETTINGS.get(variant, {}))
            built = time.perf_counter()
            agent = Agent(run.model, run.optimizer, run.scheduler, config)
            construct_s = time.perf_counter() - built
        give_norm = variant == "agent, grad norm given"
        agent_step_s = 0.0  # wall seconds inside ``agent.step`` calls
        for step in range(steps):
            start = time.perf_counter()
            loss = run.step()
            end = time.perf_counter()
            steps_timed.append((start, end))
            if agent is not None:
                agent.step(step, loss=loss, grad_norm=run.last_grad_norm if give_norm else None)
                agent_step_s += time.perf_counter() - end
        costs = {}
        if agent is not None:
            closing = time.perf_counter()
            agent.close()
            close_s = time.perf_counter() - closing
            costs = agent.costs()
        wall, cpu = time.perf_counter() - t0, time.thread_time() - cpu0
        process_cpu = time.process_time() - proc0  # every thread of this process, no child
    untime()
    return {
        "variant": variant,
        "wall_s": wall,
        "train_cpu_s": cpu,
        "process_cpu_s": process_cpu,
        "import_s": imported,
        "costs": costs,
        "construct_s": construct_s,
        "close_s": close_s,
        "train_step_s": sum(end - start for start, end in steps_timed),
        "agent_step_s": agent_step_s,
        "contention": step_contention(steps_timed, jobs),
    }


def _time_monitor_jobs(intervals: dict[str, list[tuple[float, float]]]) -> Callable[[], None]:
    """Record the wall interval of every job the agent hands to its monitor thread or process
    (this benchmark's instrumentation: ``MonitorThread.submit`` and the process's result
    handler wrapped before the agent is built), under ``"thread"`` and ``"process"``; returns
    what undoes it."""
    from agent.monitor_thread import MonitorThread  # noqa: PLC0415

    submit = MonitorThread.submit

    def timed_submit(self: MonitorThread, fn):  # noqa: ANN001, ANN202
        def timed():  # noqa: ANN202
            start = time.perf_counter()
            try:
                return fn()
            finally:
                intervals["thread"].append((start, time.perf_counter()))

        return submit(self, timed)

    MonitorThread.submit = timed_submit  # type: ignore[method-assign]
    # QK jobs in the monitor process (qk.worker): the worker reports each job's wall interval
    # on the same monotonic clock (time.perf_counter on Linux)
    from agent.monitor_process import MonitorProcess  # noqa: PLC0415

    resolve = MonitorProcess._resolve

    def timed_resolve(self: MonitorProcess, message: tuple) -> None:
        if message[0] == "done":
            intervals["process"].append(message[4])
        resolve(self, message)

    MonitorProcess._resolve = timed_resolve  # type: ignore[method-assign]

    def untime() -> None:
        MonitorThread.submit = submit  # type: ignore[method-assign]
        MonitorProcess._resolve = resolve  # type: ignore[method-assign]

    return untime


def step_contention(
    steps: list[tuple[float, float]],
    jobs: dict[str, list[tuple[float, float]]] | list[tuple[float, float]],
    skip: int = 20,
) -> dict:
    """How much a running monitor job slows a training step: the least-squares fit of each
    step's wall time on the share of it during which a job of each kind ran (``jobs``: the
    intervals by kind, "thread" and "process"; a plain list is one kind), the first ``skip``
    steps (the allocator's warm-up) left out: step = idle + sum_k slope_k x share_k. Returns
    ``busy_share`` (any kind), ``idle_s``, ``slope_s`` (the one-kind fit on any job, comparable
    across variants), ``per_step_s`` (sum_k slope_k x mean share_k: the seconds the jobs add
    to an average step) and ``kinds``: {kind: {share, slope_s, per_step_s}} for the kinds that
    ran."""
    by_kind = jobs if isinstance(jobs, dict) else {"jobs": jobs}
    timed = steps[skip:]
    durations = np.array([end - start for start, end in timed], dtype=np.float64)  # (n,) s

    def shares(intervals: list[tuple[float, float]]) -> np.ndarray:  # (n,) in [0, 1]
        out = np.zeros(len(timed))
        for i, (start, end) in enumerate(timed):
            overlap = sum(max(0.0, min(end, j1) - max(start, j0)) for j0, j1 in intervals)
            out[i] = min(1.0, overlap / (end - start))
        return out

    share = {k: shares(v) for k, v in by_kind.items() if v}
    share = {k: v for k, v in share.items() if len(v) > 1 and v.var() > 0}
    merged = shares(sorted(j for v in by_kind.values() for j in v))
    fit = _least_squares(durations, {"any": merged} if merged.var() > 0 else {})
    kinds_fit = _least_squares(durations, share)
    kinds = {
        k: {
            "share": float(share[k].mean()),
            "slope_s": kinds_fit["slopes"][k],
            "per_step_s": kinds_fit["slopes"][k] * float(share[k].mean()),
        }
        for k in share
    }
    return {
        "busy_share": float(merged.mean()) if len(merged) else 0.0,
        "idle_s": kinds_fit["idle"],
        "slope_s": fit["slopes"].get("any", 0.0),
        "per_step_s": sum(v["per_step_s"] for v in kinds.values()),
        "kinds": kinds,
    }


def _least_squares(y: np.ndarray, regressors: dict[str, np.ndarray]) -> dict:
    """y = idle + sum_k slope_k x_k by least squares: {"idle": s, "slopes": {k: s}}."""
    if len(y) == 0:
        return {"idle": 0.0, "slopes": {k: 0.0 for k in regressors}}
    design = np.column_stack([np.ones(len(y)), *regressors.values()])  # (n, 1 + kinds)
    coef, *_ = np.linalg.lstsq(design, y, rcond=None)
    return {
        "idle": float(coef[0]),
        "slopes": dict(zip(regressors, map(float, coef[1:]), strict=True)),
    }


def whole_runs(pairs: int, steps: int, variants: tuple[str, ...] = VARIANTS) -> list[dict]:
    """``pairs`` rounds of every variant, each a fresh process, the order rotating."""
    results = []
    for i in range(pairs):
        order = variants[i % len(variants) :] + variants[: i % len(variants)]
        for variant in order:
            out = subprocess.run(
                [sys.executable, __file__, "--child", variant, "--steps", str(steps)],
                check=True,
                capture_output=True,
                text=True,
            )
            result = json.loads(out.stdout.strip().splitlines()[-1])
            result["pair"] = i
            results.append(result)
            print(f"pair {i} {variant:24s} {result['wall_s']:7.2f} s", flush=True)
    return results


def by_variant(results: list[dict]) -> dict[str, list[dict]]:
    """The runs of each variant ``results`` holds, in ``VARIANTS`` order."""
    by = {v: [r for r in results if r["variant"] == v] for v in VARIANTS}
    return {v: runs for v, runs in by.items() if runs}


def whole_run_table(results: list[dict], steps: int) -> list[str]:
    by = by_variant(results)
    lines = [
        f"Whole runs: test bed clean run, seed 0, {steps} steps, one torch thread, each run a "
        "fresh process, variants alternated (order rotating). Wall time from building the "
        "model to `agent.close()` returning.",
        "",
        "| variant | runs (s, in order) | median s | ms / step | overhead (ratio of medians) "
        "| overhead (median of the pairwise ratios [95% bootstrap interval]) "
        "| pairwise ratios (min..max) |",
        "|---|---|---|---|---|---|---|",
    ]
    for variant, runs in by.items():
        walls = [r["wall_s"] for r in runs]
        med = statistics.median(walls)
        cells = " |  |  |" if variant == "bare" else _overhead_cells(by, variant, "wall_s", True)
        lines.append(
            f"| {variant} | {', '.join(f'{w:.2f}' for w in walls)} | {med:.2f} | "
            f"{1e3 * med / steps:.2f} | {cells}"
        )
    lines += [
        "",
        "The training thread's CPU time over the same runs (`time.thread_time()` of the thread "
        "that trains: what the agent adds to it, its own work and the cache and memory traffic "
        "it causes; it does not count the time the machine gave to other processes, nor the "
        "training thread waiting for the interpreter lock):",
        "",
        "| variant | median CPU s | overhead (ratio of medians) | overhead (median of the "
        "pairwise ratios [95% bootstrap interval]) |",
        "|---|---|---|---|",
    ]
    for variant, runs in by.items():
        med = statistics.median(r["train_cpu_s"] for r in runs)
        cells = " |  |" if variant == "bare" else _overhead_cells(by, variant, "train_cpu_s", False)
        lines.append(f"| {variant} | {med:.2f} | {cells}")
    agent_imports = statistics.median(r["import_s"] for r in results if r["variant"] != "bare")
    bare_imports = statistics.median(r["import_s"] for r in by["bare"])
    lines += [
        "",
        f"Imports (once per process, outside the timed runs): {agent_imports:.2f} s with the "
        f"agent, {bare_imports:.2f} s for the bare run (the test bed alone).",
        "",
    ]
    return lines


def _overhead_cells(by: dict[str, list[dict]], variant: str, key: str, span: bool) -> str:
    """A variant's table cells against the bare runs, on ``key``: the ratio of the medians, the
    median of the pairwise ratios (each run against the bare run of its round) with its
    bootstrap interval and, when ``span``, the range of the pairwise ratios."""
    bare = by["bare"]
    pairwise = [r[key] / b[key] - 1 for r in by[variant] for b in bare if b["pair"] == r["pair"]]
    ratio = statistics.median(r[key] for r in by[variant]) / statistics.median(r[key] for r in bare)
    low, high = median_interval(pairwise)
    cells = [
        f"{ratio - 1:+.2%}",
        f"{statistics.median(pairwise):+.2%} [{low:+.1%}, {high:+.1%}]",
    ]
    if span:
        cells.append(f"{min(pairwise):+.1%}..{max(pairwise):+.1%}")
    return " ".join(f"{c} |" for c in cells)


def median_interval(values: list[float], level: float = 0.95) -> tuple[float, float]:
    """A percentile bootstrap interval of the median of ``values`` (10,000 resamples, a fixed
    generator: the same runs give the same interval)."""
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(10_000))
    tail = (1 - level) / 2
    return medians[int(tail * len(medians))], medians[int((1 - tail) * len(medians)) - 1]


def wall_parts_table(results: list[dict], steps: int) -> list[str]:
    """Every run's wall time taken apart, per step (medians over the runs of a variant), and
    the training steps' own slow-down against the bare run of the same round: what the
    agent's presence does to ``run.step()`` (forward, backward, optimizer step; the router
    hooks run inside it), besides its own calls."""
    by = by_variant(results)
    bare = {r["pair"]: r for r in by["bare"]}

    def ms(values: list[float]) -> str:
        return f"{1e3 * statistics.median(values) / steps:.2f} ms"

    lines = [
        "Each run's wall time taken apart (per step; medians over the runs): the training steps "
        "(`run.step()`: forward, backward, optimizer step, with the router hooks inside), the "
        "`agent.step` calls, building and closing the agent, and the rest (the loop, the test "
        "bed's set-up). The last column compares each run's training steps with those of the "
        "bare run of its round: a slow-down there is the agent's presence (contention, caches), "
        "not its own calls.",
        "",
        "| variant | whole run | `run.step()` | `agent.step` | build + close | rest "
        "| `run.step()` vs the bare run of the round (median [min..max]) |",
        "|---|---|---|---|---|---|---|",
    ]
    for variant, runs in by.items():
        rest = [
            r["wall_s"] - r["train_step_s"] - r["agent_step_s"] - r["construct_s"] - r["close_s"]
            for r in runs
        ]
        slower = [
            r["train_step_s"] / bare[r["pair"]]["train_step_s"] - 1
            for r in runs
            if r["pair"] in bare
        ]
        versus = (
            "-"
            if variant == "bare" or not slower
            else f"{statistics.median(slower):+.2%} [{min(slower):+.1%}..{max(slower):+.1%}]"
        )
        lines.append(
            f"| {variant} | {ms([r['wall_s'] for r in runs])} | "
            f"{ms([r['train_step_s'] for r in runs])} | {ms([r['agent_step_s'] for r in runs])} | "
            f"{ms([r['construct_s'] + r['close_s'] for r in runs])} | {ms(rest)} | {versus} |"
        )
    return lines + [""]


def breakdown_table(results: list[dict], steps: int) -> list[str]:
    bare = statistics.median(r["wall_s"] for r in results if r["variant"] == "bare") / steps
    runs = {v: rs for v, rs in by_variant(results).items() if v != "bare"}
    lines = [
        "Where the agent's time goes (`Agent.costs()`, mean over the agent runs; training-thread "
        "wall time unless marked; % of the bare run's step):",
        "",
        "| part | " + " | ".join(runs) + " |",
        "|---|" + "---|" * len(runs),
    ]
    parts = list(next(iter(runs.values()))[0]["costs"])
    totals = dict.fromkeys(runs, 0.0)
    for part in parts:
        cells = []
        for variant, rs in runs.items():
            per_step = statistics.mean(r["costs"][part] for r in rs) / steps
            if part != MONITOR:
                totals[variant] += per_step
            cells.append(f"{1e3 * per_step:.3f} ms ({per_step / bare:.2%})")
        label = "monitor jobs (CPU s, off the training thread)" if part == MONITOR else part
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines.append(
        "| **training thread, total** | "
        + " | ".join(f"**{1e3 * t:.3f} ms ({t / bare:.2%})**" for t in totals.values())
        + " |"
    )
    return lines + [""] + estimate_table(runs, totals, bare, steps)


def estimate_table(
    runs: dict[str, list[dict]], own: dict[str, float], bare: float, steps: int
) -> list[str]:
    """The overhead put together from parts measured inside the agent runs: the training
    thread's own work, the monitor thread's contention, and building and closing the agent
    spread over the run (means over the runs; % of the bare run's step)."""

    def cell(seconds: float) -> str:
        return f"{1e3 * seconds:.3f} ms ({seconds / bare:.2%})"

    rows: dict[str, list[str]] = {
        "monitor job running, share of the training steps' time": [],
        "training step while no job runs (fit)": [],
        "a step wholly beside a running job: slower by (fit)": [],
        "jobs on the monitor thread (all of them with `qk.worker: thread`; else those before"
        " the process is ready): share, a step wholly beside one slower by (fit on both kinds)": [],
        "jobs in the monitor process (QK, router reductions): share, a step wholly beside one"
        " slower by": [],
        "monitor jobs' contention per step (sum of slope x share)": [],
        "building the agent + `close()`, spread over the run": [],
        "**estimated overhead per step (own work + contention + build/close)**": [],
    }
    for variant, rs in runs.items():
        share = statistics.fmean(r["contention"]["busy_share"] for r in rs)
        idle = statistics.fmean(r["contention"]["idle_s"] for r in rs)
        slope = statistics.fmean(r["contention"]["slope_s"] for r in rs)
        contention = statistics.fmean(r["contention"]["per_step_s"] for r in rs)
        once = statistics.fmean(r["construct_s"] + r["close_s"] for r in rs) / steps
        values = iter(rows.values())
        next(values).append(f"{share:.1%}")
        next(values).append(f"{1e3 * idle:.2f} ms")
        next(values).append(f"{1e3 * slope:+.2f} ms")
        for kind in ("thread", "process"):
            fits = [r["contention"]["kinds"].get(kind) for r in rs]
            fits = [f for f in fits if f is not None]
            next(values).append(
                f"{statistics.fmean(f['share'] for f in fits):.1%}, "
                f"{1e3 * statistics.fmean(f['slope_s'] for f in fits):+.2f} ms"
                if fits
                else "-"
            )
        next(values).append(cell(contention))
        next(values).append(cell(once))
        next(values).append(f"**{cell(own[variant] + contention + once)}**")
    lines = [
        "The overhead from its parts, measured inside the agent runs, where the machine's drift "
        "cancels (the monitor thread's contention: each training step's wall time fitted on the "
        "share of it during which a monitor job ran; see the module docstring):",
        "",
        "| | " + " | ".join(runs) + " |",
        "|---|" + "---|" * len(runs),
    ]
    lines += [f"| {label} | " + " | ".join(cells) + " |" for label, cells in rows.items()]
    return lines + [""]


def frontier_layer(d: int, heads: int, kv_heads: int, dh: int, sampled_heads: int) -> dict:
    from agent.discovery import find_attention  # noqa: PLC0415 - the children time the import
    from agent.probes import QKSnapshots, compute_qk_samples  # noqa: PLC0415

    torch.manual_seed(0)
    model = nn.Module()
    model.attn = QKLayer(d, heads, kv_heads, dh)
    site = find_attention(model)[0]
    snapshot_bytes = sum(p.numel() * 4 for p in site.parameters_to_snapshot().values())
    out = {"snapshot_mb_per_layer": snapshot_bytes / 2**20}
    for label, per_layer in (("all heads", None), (f"{sampled_heads} heads", sampled_heads)):
        snaps = QKSnapshots([site], delta=1, heads_per_layer=per_layer)
        t0 = time.perf_counter()
        snaps.on_step(0)
        out["snapshot_s"] = time.perf_counter() - t0
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1e-3 * torch.randn_like(p))
        (job,) = snaps.on_step(1)
        t0 = time.perf_counter()
        compute_qk_samples(job)
        out[label] = time.perf_counter() - t0
    return out


def router_hook_cost(tokens: int, experts: int, top_k: int, d: int = 4096) -> float:
    """Seconds per forward of the router hook's work (``RouterLogitBuffer``: the product into
    the buffer, and its share of the batched reduction), fp32 on the CPU."""
    from agent.router_buffer import RouterLogitBuffer  # noqa: PLC0415

    x, w = torch.randn(tokens, d), torch.randn(experts, d) / d**0.5
    buffer = RouterLogitBuffer(experts, top_k)
    buffer.add(x, w, None)
    buffer.take()
    forwards = 16
    t0 = time.perf_counter()
    for _ in range(forwards):
        buffer.add(x, w, None)
    buffer.take()
    return (time.perf_counter() - t0) / forwards


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=6, help="rounds of every variant")
    p.add_argument("--steps", type=int, default=400, help="steps per run")
    p.add_argument(
        "--variants",
        nargs="+",
        choices=VARIANTS[1:],
        default=list(VARIANTS[1:]),
        help="the agent variants to run (the bare run always runs)",
    )
    p.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    p.add_argument("--skip-frontier", action="store_true", help="only the whole runs")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.steps)))
        return 0
    torch.set_num_threads(1)  # as in every run (the provenance line reports it)
    lines = provenance()
    variants = tuple(v for v in VARIANTS if v == "bare" or v in args.variants)
    results = whole_runs(args.pairs, args.steps, variants)
    lines += whole_run_table(results, args.steps) + wall_parts_table(results, args.steps)
    lines += breakdown_table(results, args.steps)
    if args.out:  # every run's numbers, to look again without running again
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
    print("\n".join(lines), flush=True)
    if not args.skip_frontier:
        lines += frontier_lines()
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 0


def frontier_lines() -> list[str]:
    torch.set_num_threads(1)  # one core, as the monitor thread has beside a training loop
    layer = frontier_layer(4096, 32, 8, 128, sampled_heads=8)
    per_layer_all, per_layer_8 = layer["all heads"], layer["8 heads"]
    mb = layer["snapshot_mb_per_layer"]
    return [
        "| frontier shape: d 4096, 32 heads x 128, 8 KV heads (GQA), 32 layers; CPU, 1 thread "
        "| value |",
        "|---|---|",
        f"| one layer, all 32 heads (monitor thread) | {per_layer_all:.2f} s |",
        f"| one layer, 8 heads (heads_per_layer: 8) | {per_layer_8:.2f} s |",
        f"| 32 layers, all heads, per evaluation | {32 * per_layer_all:.1f} s |",
        f"| layers_per_eval: 4, heads_per_layer: 8, per evaluation | {4 * per_layer_8:.2f} s |",
        f"| snapshot copy of one layer, training thread | {layer['snapshot_s']:.3f} s |",
        f"| snapshot memory per layer (fp32 W_q + W_k) | {mb:.0f} MiB |",
        f"| snapshot memory, all 32 layers (previous + current) | {2 * 32 * mb / 1024:.1f} GiB |",
        f"| snapshot memory, layers_per_eval: 4 | {2 * 4 * mb:.0f} MiB |",
        f"| 64-expert router hook on 8192 tokens, d 4096 (per forward, CPU, incl. z = x W^T) | "
        f"{1e3 * router_hook_cost(8192, 64, 2):.2f} ms |",
    ]


if __name__ == "__main__":
    raise SystemExit(main())
