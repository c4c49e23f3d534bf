"""benchmarks/overhead.py: the in-run contention fit recovers a known slowdown, and one agent run
of the benchmark reports its parts, the monitor jobs' busy share and the build/close time."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def overhead():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        spec = importlib.util.spec_from_file_location("overhead", ROOT / "benchmarks/overhead.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def _timeline(idle: float, extra: float) -> tuple[list, list]:
    """100 steps; a job runs beside all of steps 40-49 and the first half of step 70, and a
    step with a job beside it for a share b of its time takes ``idle + b * extra``."""
    steps, jobs, now = [], [], 0.0
    for i in range(100):
        busy = 1.0 if 40 <= i < 50 else (0.5 if i == 70 else 0.0)
        length = idle + busy * extra
        steps.append((now, now + length))
        if busy:
            jobs.append((now, now + busy * length))
        now += length
    return steps, jobs


def test_the_fit_recovers_the_slowdown_a_running_job_causes(overhead) -> None:
    steps, jobs = _timeline(idle=0.010, extra=0.005)
    fit = overhead.step_contention(steps, jobs, skip=0)
    assert fit["idle_s"] == pytest.approx(0.010, rel=1e-9)
    assert fit["slope_s"] == pytest.approx(0.005, rel=1e-9)  # a wholly busy step: +5 ms
    share = (10 + 0.5) / 100
    assert fit["busy_share"] == pytest.approx(share, rel=1e-9)
    assert fit["per_step_s"] == pytest.approx(0.005 * share, rel=1e-9)
    # the first steps (the allocator's warm-up) are left out of the fit
    assert overhead.step_contention(steps, jobs, skip=45)["busy_share"] == pytest.approx(5.5 / 55)


def test_the_fit_tells_a_thread_job_from_a_process_job(overhead) -> None:
    # 200 steps of 10 ms; a thread job beside steps 40-59 adds 6 ms, a process job beside
    # steps 120-139 adds 0.5 ms, and half of step 150 overlaps a thread job
    steps, kinds, now = [], {"thread": [], "process": []}, 0.0
    for i in range(200):
        thread = 1.0 if 40 <= i < 60 else (0.5 if i == 150 else 0.0)
        process = 1.0 if 120 <= i < 140 else 0.0
        length = 0.010 + 0.006 * thread + 0.0005 * process
        steps.append((now, now + length))
        if thread:
            kinds["thread"].append((now, now + thread * length))
        if process:
            kinds["process"].append((now, now + length))
        now += length
    fit = overhead.step_contention(steps, kinds, skip=0)
    assert fit["idle_s"] == pytest.approx(0.010, rel=1e-9)
    assert fit["kinds"]["thread"]["slope_s"] == pytest.approx(0.006, rel=1e-6)
    assert fit["kinds"]["process"]["slope_s"] == pytest.approx(0.0005, rel=1e-6)
    assert fit["kinds"]["thread"]["share"] == pytest.approx(20.5 / 200, rel=1e-9)
    expected = 0.006 * 20.5 / 200 + 0.0005 * 20 / 200
    assert fit["per_step_s"] == pytest.approx(expected, rel=1e-6)
    assert fit["busy_share"] == pytest.approx(40.5 / 200, rel=1e-9)


def test_no_job_no_contention_and_a_job_that_costs_nothing_costs_nothing(overhead) -> None:
    steps, _ = _timeline(idle=0.010, extra=0.0)
    assert overhead.step_contention(steps, [], skip=0)["per_step_s"] == 0.0
    steps, jobs = _timeline(idle=0.010, extra=0.0)
    fit = overhead.step_contention(steps, jobs, skip=0)
    assert fit["busy_share"] > 0.1
    assert abs(fit["per_step_s"]) < 1e-12


def test_an_agent_run_reports_its_parts_busy_share_and_build_time(overhead) -> None:
    import torch

    threads = torch.get_num_threads()
    try:
        result = overhead.child("agent", 60)
    finally:
        torch.set_num_threads(threads)
    assert result["wall_s"] > 0 and result["construct_s"] > 0 and result["close_s"] >= 0
    assert result["costs"]["monitor thread"] > 0  # the QK jobs ran (every 25 steps)
    contention = result["contention"]
    assert 0 < contention["busy_share"] < 1
    assert contention["idle_s"] > 0
    assert set(contention["kinds"]) <= {"thread", "process"} and contention["kinds"]
