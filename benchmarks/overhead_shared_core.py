"""What the agent costs when it has no spare core: the bare run and the agent run at the same
time, each process pinned to its own core, the agent's monitor thread and monitor process on
its training core.

    python benchmarks/overhead_shared_core.py [--rounds 4] [--steps 2000]
        [--variant agent] [--out FILE]

Why: ``benchmarks/overhead.py`` runs the variants one after the other, and on a shared 2-vCPU
machine the step time drifts between runs by more than the agent's cost (its results page).
Two runs *at the same time* see the same drift: two bare runs started together on cores 0 and
1 ended within 0.4% and 1.0% of each other (1,000 steps; the same 100-step blocks rose and
fell together). The price is the spare core: here the agent's monitor work (QK spectra, router
reductions: about 2.5% of a training core on the test bed) runs on the core that trains, so
this measures an upper bound, the cost on a host whose every core trains (CPU training,
oversubscribed hosts). A GPU host normally has spare cores, where ``benchmarks/overhead.py``'s
estimate applies. Each round swaps the cores, so a difference between the two cores cancels.

Per round: the whole run's wall time (building the model to ``agent.close()``), the training
steps' wall time (``run.step()``: forward, backward, optimizer step), the agent's / bare ratio
of each; and the training process's CPU time (``time.process_time()``: every thread of the
process that trains, the monitor process not included), the agent's / bare ratio of which is
what the run needs of its own core when the monitor process has another one: a whole run
that does not wait (CPU training) takes the CPU time it needs, and the two runs' ratio is
taken at the same time, so the machine's drift cancels as for the wall time. It is a
conservative proxy for a host with a spare core: the cache the monitor process evicts from
the shared core, and the agent's other threads (which could run beside it), count in it.
``--variant bare`` runs two bare processes: the design's null check. Medians and ranges over
the rounds. Uses ``overhead.py --child`` for the runs (the
same run as there). Linux only (CPU affinity); it says so and exits 0 elsewhere or with fewer
than 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import torch
from provenance import provenance

OVERHEAD = Path(__file__).resolve().parent / "overhead.py"
# "bare": both processes run the bare loop, the null check of the design (no agent anywhere)
VARIANTS = ("agent", "agent, grad norm given", "agent, qk.budget 0.01", "bare")


def _pinned(core: int, variant: str, steps: int) -> subprocess.Popen:
    """One ``overhead.py`` child run on ``core`` alone (its threads and children too)."""
    return subprocess.Popen(
        [sys.executable, str(OVERHEAD), "--child", variant, "--steps", str(steps)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: os.sched_setaffinity(0, {core}),  # inherited by its children
    )


def _result(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"child run failed ({proc.returncode}): {err.strip()[-2000:]}")
    return json.loads(out.strip().splitlines()[-1])


def rounds(n: int, steps: int, variant: str, cores: tuple[int, int]) -> list[dict]:
    """``n`` rounds of the bare and the agent run at once, the cores swapped each round."""
    results = []
    for i in range(n):
        bare_core, agent_core = cores if i % 2 == 0 else cores[::-1]
        bare = _pinned(bare_core, "bare", steps)
        agent = _pinned(agent_core, variant, steps)
        b, a = _result(bare), _result(agent)
        row = {
            "round": i,
            "bare_core": bare_core,
            "agent_core": agent_core,
            "bare_wall_s": b["wall_s"],
            "agent_wall_s": a["wall_s"],
            "bare_train_step_s": b["train_step_s"],
            "agent_train_step_s": a["train_step_s"],
            "bare_process_cpu_s": b["process_cpu_s"],
            "agent_process_cpu_s": a["process_cpu_s"],
            "agent_step_s": a["agent_step_s"],
            "monitor_cpu_s": a["costs"].get("monitor thread", 0.0),  # CPU s (agent/costs.py)
        }
        results.append(row)
        print(
            f"round {i}: bare {b['wall_s']:.2f} s (core {bare_core}), {variant} "
            f"{a['wall_s']:.2f} s (core {agent_core}): {a['wall_s'] / b['wall_s'] - 1:+.2%}",
            flush=True,
        )
    return results


def _pct(x: float) -> str:
    return f"{x:+.2%}"


def table(results: list[dict], steps: int, variant: str) -> list[str]:
    wall = [r["agent_wall_s"] / r["bare_wall_s"] - 1 for r in results]
    train = [r["agent_train_step_s"] / r["bare_train_step_s"] - 1 for r in results]
    # older saved rounds (before 2026-12-07) have no process CPU times
    cpu = [
        r["agent_process_cpu_s"] / r["bare_process_cpu_s"] - 1
        for r in results
        if "agent_process_cpu_s" in r
    ]
    if len(cpu) != len(results):
        cpu = []
    lines = [
        f"Test bed clean run, seed 0, {steps} steps, one torch thread; `bare` and `{variant}` "
        "started together, each pinned to its own core (the agent's monitor thread and process "
        "on its training core), the cores swapped every round.",
        "",
        "| round | bare s (core) | agent s (core) | whole run | training steps | "
        "`agent.step` per step | monitor jobs' CPU per step |"
        + (" bare / agent process CPU s | process CPU |" if cpu else ""),
        "|---|---|---|---|---|---|---|" + ("---|---|" if cpu else ""),
    ]
    for i, (r, w, t) in enumerate(zip(results, wall, train, strict=True)):
        extra = (
            f" {r['bare_process_cpu_s']:.2f} / {r['agent_process_cpu_s']:.2f} | {_pct(cpu[i])} |"
            if cpu
            else ""
        )
        lines.append(
            f"| {r['round']} | {r['bare_wall_s']:.2f} ({r['bare_core']}) | "
            f"{r['agent_wall_s']:.2f} ({r['agent_core']}) | {_pct(w)} | {_pct(t)} | "
            f"{r['agent_step_s'] / steps * 1e3:.3f} ms | "
            f"{r['monitor_cpu_s'] / steps * 1e3:.3f} ms |" + extra
        )
    lines += [
        "",
        f"Median over {len(results)} rounds: whole run {_pct(statistics.median(wall))} "
        f"[{_pct(min(wall))}..{_pct(max(wall))}], training steps "
        f"{_pct(statistics.median(train))} [{_pct(min(train))}..{_pct(max(train))}]"
        + (
            f", the training process's CPU time {_pct(statistics.median(cpu))} "
            f"[{_pct(min(cpu))}..{_pct(max(cpu))}]."
            if cpu
            else "."
        ),
    ]
    lines += _by_core(results, wall, "Whole run")
    if cpu:
        lines += _by_core(results, cpu, "The training process's CPU time")
    return lines


def _by_core(results: list[dict], ratios: list[float], what: str) -> list[str]:
    """``ratios`` by the agent's core, and the mean of the two cores' medians."""
    by_core = {
        core: [x for r, x in zip(results, ratios, strict=True) if r["agent_core"] == core]
        for core in sorted({r["agent_core"] for r in results})
    }
    if len(by_core) != 2 or not all(by_core.values()):
        return []
    medians = [
        statistics.median(xs) for xs in by_core.values()
    ]  # a core slower than the other cancels
    return [
        f"{what} by the agent's core: "
        + "; ".join(
            f"core {core}: {', '.join(_pct(x) for x in xs)}" for core, xs in by_core.items()
        )
        + f". Mean of the two cores' medians (a difference between the cores cancels): "
        f"{_pct(sum(medians) / 2)}."
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--variant", choices=VARIANTS, default="agent")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument(
        "--from-json", type=Path, default=None, help="a run's saved rounds: only the table"
    )
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # as in every child run (the provenance line reports it)
    if args.from_json:
        results = json.loads(args.from_json.read_text())
        print("\n".join(table(results, args.steps, args.variant)))
        return 0
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(cores) < 2:
        print("needs Linux CPU affinity and at least 2 cores: skipped")
        return 0
    results = rounds(args.rounds, args.steps, args.variant, (cores[0], cores[1]))
    lines = [*provenance(), *table(results, args.steps, args.variant)]
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
        args.out.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
