"""Why a monitor job slows the training thread: the interpreter lock or the hardware.

Run: python benchmarks/monitor_contention.py [--rounds 2] [--steps 150] [--out FILE]

The agent computes its QK spectra on a background thread of the training process. That thread
runs on another core, yet ``benchmarks/overhead.py`` measures training steps that overlap a
monitor job as a third slower. Two causes are possible: the interpreter lock (the job's Python
code between its torch calls holds it, and the training thread, which gives it up at every
torch call of its own, waits to get it back) and the hardware (two busy cores share caches,
memory bandwidth and, on a 2-vCPU machine, possibly one physical core). This benchmark tells
them apart. It captures the QK jobs a default ``Agent`` hands to its monitor thread on the
test bed's clean run (seed 0, one torch thread) and times the test bed's training step
(forward, backward, optimizer step) while, in turn:

- nothing else runs;
- the captured jobs run back to back on a thread of the same process (the agent's
  arrangement, with the job running all the time instead of a few % of it);
- the same jobs run back to back in a forked process (the same arithmetic on another core, no
  shared interpreter lock);
- with ``--pure-python``, a thread runs pure Python (the interpreter lock alone, no arithmetic
  to compete with; a training step then takes seconds to tens of seconds, so it is opt-in).

The conditions are alternated for ``--rounds`` rounds; each row is the median step over
``--steps`` steps (the first 10 left out; at most 20 s per condition and round, so the pure-Python
condition times fewer steps). The in-process thread minus the process is what the
interpreter lock costs; the process minus nothing is what the hardware costs.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import provenance  # noqa: E402

NOTHING, ON_THREAD, IN_PROCESS, PURE_PYTHON = (
    "nothing",
    "jobs on a thread",
    "jobs in a process",
    "pure Python on a thread",
)
WARMUP_STEPS = 60  # agent steps before the jobs are captured (two QK evaluations at 25)
MAX_SECONDS = 20.0  # per condition and round: the step count is cut short after this


def capture_jobs() -> tuple[object, list]:
    """The test bed's clean run after ``WARMUP_STEPS`` steps under a default agent, and the
    last QK jobs the agent handed to its monitor thread (one per attention layer, two rounds)."""
    from agent.agent import Agent  # noqa: PLC0415
    from agent.config import AgentConfig  # noqa: PLC0415
    from agent.measurements import Measurements  # noqa: PLC0415
    from agent.testbed.runner import TestbedRun  # noqa: PLC0415
    from agent.testbed.scenarios import ScenarioConfig  # noqa: PLC0415

    jobs: list = []
    submit = Measurements._submit_job

    def keep(self: Measurements, job: object):  # noqa: ANN202
        jobs.append(job)
        return submit(self, job)

    Measurements._submit_job = keep  # type: ignore[method-assign]
    try:
        run = TestbedRun(
            ScenarioConfig.preset("clean", seed=0, steps=10_000), record_monitors=False
        )
        with tempfile.TemporaryDirectory() as run_dir:
            agent = Agent(run.model, run.optimizer, run.scheduler, AgentConfig(run_dir=run_dir))
            for step in range(WARMUP_STEPS):
                agent.step(step, loss=run.step())
            agent.close()
    finally:
        Measurements._submit_job = submit  # type: ignore[method-assign]
    return run, jobs[-4:]


def run_jobs(jobs: list, stop: threading.Event, ready: threading.Event) -> None:
    from agent.probes import compute_qk_samples  # noqa: PLC0415

    torch.set_num_threads(1)
    ready.set()
    while not stop.is_set():
        for job in jobs:
            compute_qk_samples(job)


def pure_python(stop: threading.Event, ready: threading.Event) -> None:
    ready.set()
    total = 0
    while not stop.is_set():
        for i in range(1000):
            total += i


def median_step_ms(step: Callable[[], object], steps: int, skip: int = 10) -> float:
    """The median of ``steps`` timed steps after ``skip``, stopping early after
    ``MAX_SECONDS`` (a pure-Python thread makes a step up to a hundred times slower)."""
    times: list[float] = []
    began = time.perf_counter()

    def in_time() -> bool:
        return len(times) <= skip + 2 or time.perf_counter() - began < MAX_SECONDS

    while len(times) < steps and in_time():
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times[skip:])


def measure(run: object, jobs: list, condition: str, steps: int) -> float:
    """The median training step (ms) while ``condition`` runs beside it."""
    fork = mp.get_context("fork")
    events = fork if condition == IN_PROCESS else threading
    stop, ready = events.Event(), events.Event()
    worker: threading.Thread | mp.process.BaseProcess | None = None
    if condition == ON_THREAD:
        worker = threading.Thread(target=run_jobs, args=(jobs, stop, ready), daemon=True)
    elif condition == IN_PROCESS:
        worker = fork.Process(target=run_jobs, args=(jobs, stop, ready), daemon=True)
    elif condition == PURE_PYTHON:
        worker = threading.Thread(target=pure_python, args=(stop, ready), daemon=True)
    if worker is not None:
        worker.start()
        ready.wait(timeout=60)
    try:
        return median_step_ms(run.step, steps)  # type: ignore[attr-defined]
    finally:
        stop.set()
        if worker is not None:
            worker.join(timeout=60)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=150, help="timed training steps per condition")
    p.add_argument("--pure-python", action="store_true", help="add the pure-Python thread")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    run, jobs = capture_jobs()
    conditions = [NOTHING, ON_THREAD, IN_PROCESS] + ([PURE_PYTHON] if args.pure_python else [])
    rows: dict[str, list[float]] = {c: [] for c in conditions}
    for r in range(args.rounds):
        for condition in conditions[r % 2 :] + conditions[: r % 2]:  # rotate the order
            rows[condition].append(measure(run, jobs, condition, args.steps))
            print(f"round {r} {condition:24s} {rows[condition][-1]:8.2f} ms", flush=True)
    alone = statistics.median(rows[NOTHING])
    lines = provenance() + [
        f"Test bed clean run, seed 0, one torch thread; {len(jobs)} QK jobs of a default agent "
        f"({', '.join(sorted({j.site.name for j in jobs}))}, {len(jobs[0].heads)} heads and "
        f"{len(jobs[0].controls)} control matrices each) run back to back beside the training "
        f"step; median step over {args.steps} steps per round, rounds: {args.rounds}.",
        "",
        "| beside the training step | median step per round (ms) | vs nothing |",
        "|---|---|---|",
    ]
    for condition in conditions:
        values = rows[condition]
        change = statistics.median(values) / alone - 1
        cells = ", ".join(f"{v:.1f}" for v in values)
        lines.append(f"| {condition} | {cells} | {change:+.0%} |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
