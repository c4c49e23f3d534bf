"""QK jobs and router reductions in the monitor process (``qk.worker: process``,
agent/monitor_process.py): the same samples as on the thread, the run goes on when the worker
dies, and no snapshot or logit file is left."""

from __future__ import annotations

import dataclasses
import gc
import os

import pytest
import torch

from agent.config import AgentConfig
from agent.discovery import find_attention, find_routers
from agent.measurements import Measurements
from agent.monitor_process import MonitorProcess, process_supported, shared_directory
from agent.monitor_thread import MonitorThread
from agent.samples import Sample
from agent.testbed.runner import TestbedRun
from agent.testbed.scenarios import ScenarioConfig

pytestmark = pytest.mark.skipif(not process_supported(), reason="POSIX only")

STEPS = 160  # snapshots every 25 steps; results 5 steps later: evaluations 50 to 150


def _measure(
    worker: str,
    tmp_path,
    *,
    restart_at: int | None = None,
    kill_at: int | None = None,
    ready_at: int | None = None,
) -> tuple[list[Sample], list[tuple[str, str]], Measurements]:
    """Drive a test-bed run through ``Measurements`` (default agent config) with the jobs on
    ``worker``; returns every QK and router sample, the reported failures and the
    measurements."""
    torch.manual_seed(0)
    run = TestbedRun(ScenarioConfig.preset("clean", seed=3, steps=STEPS), record_monitors=False)
    config = AgentConfig.model_validate({"run_dir": tmp_path, "qk": {"worker": worker}})
    thread = MonitorThread()
    thread.start()
    reports: list[tuple[str, str]] = []
    measurements = Measurements(
        run.model,
        config,
        find_attention(run.model),
        find_routers(run.model),
        submit=thread.submit,
        report=lambda what, text: reports.append((what, text)),
    )
    samples: list[Sample] = []
    if ready_at is not None:  # the worker counts as starting until ready_at
        measurements.worker.process.ready.wait(timeout=60)
        measurements.worker.process.ready.clear()
    try:
        for step in range(STEPS):
            if step == ready_at:
                measurements.worker.process.ready.set()
            loss = run.step()
            measurements.record(step, loss, None)
            if step == restart_at:
                measurements.restart()
            if step == kill_at:
                process = measurements.worker.process._process
                process.kill()
                process.wait()
            samples += [
                s
                for s in measurements.collect(step)
                if "layer" in s.label_dict or "router" in s.label_dict
            ]
    finally:
        measurements.close()
        thread.shutdown()
    return samples, reports, measurements


def test_the_process_measures_what_the_thread_measures(tmp_path, monkeypatch) -> None:
    from agent.monitor_process import ProcessWorker  # noqa: PLC0415

    reduced: list[bool] = []  # one per read-out whose router reduction went to the worker
    reduce = ProcessWorker.reduce

    def counted(self, batches, done):  # noqa: ANN001, ANN202
        future = reduce(self, batches, done)
        reduced.append(not (future.done() and future.exception() is not None))
        return future

    monkeypatch.setattr(ProcessWorker, "reduce", counted)
    on_thread, _, thread_run = _measure("thread", tmp_path / "t", restart_at=60)
    assert reduced == []
    in_process, reports, process_run = _measure("process", tmp_path / "p", restart_at=60)
    assert len(reduced) >= 5 and all(reduced)  # read-outs at 25..150, once the worker is ready
    assert thread_run.worker is None and process_run.worker is not None
    assert reports == []
    assert len(on_thread) == len(in_process) > 100
    routers = [s for s in in_process if "router" in s.label_dict]
    assert {s.metric for s in routers} >= {"router_entropy_norm", "router_load_max"}
    key = lambda s: (s.step, s.metric, s.labels)  # noqa: E731
    for a, b in zip(sorted(on_thread, key=key), sorted(in_process, key=key), strict=True):
        assert key(a) == key(b)
        assert b.value == pytest.approx(a.value, rel=1e-6, abs=1e-9), key(a)
    # the restart at 60 dropped the directions in both: no persistence right after it
    for samples in (on_thread, in_process):
        persistence = {s.step for s in samples if s.metric == "qk_delta2_persistence"}
        assert persistence == {50, 125, 150}  # 75: no evaluation, 100: first after it


def test_jobs_run_on_the_thread_until_the_worker_is_ready(tmp_path) -> None:
    on_thread, _, _ = _measure("thread", tmp_path / "t")
    handed_over, reports, _ = _measure("process", tmp_path / "p", ready_at=80)
    assert reports == []
    key = lambda s: (s.step, s.metric, s.labels)  # noqa: E731
    assert [key(s) for s in sorted(on_thread, key=key)] == [
        key(s) for s in sorted(handed_over, key=key)
    ]  # the persistence at 100 (worker) compares with the direction at 75 (thread)
    for a, b in zip(sorted(on_thread, key=key), sorted(handed_over, key=key), strict=True):
        assert b.value == pytest.approx(a.value, rel=1e-6, abs=1e-9), key(a)


def test_a_dead_worker_is_reported_and_the_thread_takes_over(tmp_path) -> None:
    samples, reports, measurements = _measure("process", tmp_path, kill_at=52)
    assert measurements.worker is None  # fell back
    assert any(what == "qk monitor" and "exited" in text for what, text in reports), reports
    steps = {s.step for s in samples if "layer" in s.label_dict}
    assert {125, 150} <= steps  # measured on the thread after the worker died
    router_steps = {s.step for s in samples if s.metric == "router_entropy_norm"}
    assert {125, 150} <= router_steps  # reduced on the thread after it died
    MonitorProcess.shared()  # a new worker for the next agent of this process


def _files_of_this_process() -> set[str]:
    prefix = f"mechwatch-{os.getpid()}-"
    return {n for n in os.listdir(shared_directory()) if n.startswith(prefix)}


def test_no_snapshot_file_is_left_behind(tmp_path) -> None:
    before = _files_of_this_process()  # those of agents other tests left open
    _measure("process", tmp_path)
    gc.collect()
    assert _files_of_this_process() - before == set()
    # the worker exits and is dropped: close removes its files all the same, while the
    # measurements (and their router buffers) are still referenced
    _, _, closed = _measure("process", tmp_path / "killed", kill_at=52)
    MonitorProcess.shared()
    assert closed.worker is None
    assert _files_of_this_process() - before == set()


def test_process_on_request_needs_cpu_weights_in_one_process(tmp_path) -> None:
    from agent.distributed.measurements import DistributedMeasurements  # noqa: PLC0415
    from agent.distributed.world import World  # noqa: PLC0415

    run = TestbedRun(ScenarioConfig.preset("clean", seed=0, steps=10))
    config = AgentConfig.model_validate({"run_dir": tmp_path, "qk": {"worker": "process"}})
    sites, routers = find_attention(run.model), find_routers(run.model)
    hooks = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in run.model.modules())
    with pytest.raises(ValueError, match="qk.worker: 'process' needs"):
        DistributedMeasurements(run.model, config, sites, routers, world=World(0, 1))
    after = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in run.model.modules())
    assert after == hooks


def test_a_job_that_fails_in_the_worker_fails_its_future_only() -> None:
    from concurrent.futures import Future  # noqa: PLC0415

    from agent.monitor_worker import JobSpec  # noqa: PLC0415

    run = TestbedRun(ScenarioConfig.preset("clean", seed=0, steps=10))
    site = dataclasses.replace(find_attention(run.model)[0], module=None, live_parameters={})
    process = MonitorProcess.shared()
    gone = {name: ("/nonexistent/mechwatch-snapshot", (4, 4)) for name in ("a",)}
    spec = JobSpec(0, site, gone, gone, [0], {}, None, (2, 3))
    done: list[float] = []
    future: Future = process.submit(MonitorProcess.new_owner(), spec, done.append)
    with pytest.raises(RuntimeError, match="nonexistent"):
        future.result(timeout=60)
    assert done == [0.0] and process.alive  # the buffers go back; the worker goes on


def test_the_worker_keeps_its_temporaries_and_starts_light(monkeypatch) -> None:
    """The worker runs with ``WORKER_MALLOC_ENV`` (a value already set in the environment
    wins), and importing it does not import the discovery's pydantic override models."""
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415

    from agent.monitor_process import WORKER_MALLOC_ENV  # noqa: PLC0415

    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "12345")
    process = MonitorProcess()
    process.start()
    try:
        assert process.ready.wait(timeout=60)
        assert process._process is not None
        environ = Path(f"/proc/{process._process.pid}/environ")
        if environ.exists():  # Linux
            pairs = dict(
                item.split("=", 1) for item in environ.read_text().split("\0") if "=" in item
            )
            assert pairs["MALLOC_MMAP_THRESHOLD_"] == WORKER_MALLOC_ENV["MALLOC_MMAP_THRESHOLD_"]
            assert pairs["MALLOC_TRIM_THRESHOLD_"] == "12345"
    finally:
        process.close()
    code = "import sys, agent.monitor_worker; print('pydantic' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


TRAINER = """
import sys, time, tempfile, torch
torch.set_num_threads(1)
from agent.agent import Agent
from agent.config import AgentConfig
from agent.testbed.runner import TestbedRun
from agent.testbed.scenarios import ScenarioConfig
run = TestbedRun(ScenarioConfig.preset("clean", seed=0, steps=20), record_monitors=False)
agent = Agent(run.model, run.optimizer, run.scheduler, AgentConfig(run_dir=tempfile.mkdtemp()))
agent.measurements.worker.process.ready.wait(60)
for step in range(10):
    agent.step(step, loss=run.step())
print("trained", flush=True)
time.sleep(600)
"""


def test_a_killed_training_process_leaves_no_file(tmp_path) -> None:
    """SIGKILL before the agent let its files go (router logit buffers the worker never
    mapped): the worker, seeing its pipe close, removes every file the process made."""
    import signal  # noqa: PLC0415
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415
    import time  # noqa: PLC0415

    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    child = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "trained"
        prefix = f"mechwatch-{child.pid}-"
        made = [n for n in os.listdir(shared_directory()) if n.startswith(prefix)]
        assert made  # the router buffers (and any snapshot) are shared files
        time.sleep(0.5)  # the writer thread has sent the adoptions
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            left = [n for n in os.listdir(shared_directory()) if n.startswith(prefix)]
            if not left:
                break
            time.sleep(0.2)
        assert left == []
    finally:
        if child.poll() is None:
            child.kill()
