"""The agent's background threads: one that runs monitor jobs on snapshots, one at a time in
submission order, and APScheduler's (``BackgroundScheduler``) for timers (the watchdog). The
training thread never waits for a job except where it asks for a result (``Future.result``).

Jobs go to a plain one-thread executor, not through APScheduler: a job submitted through
``add_job`` cost the training thread about a millisecond (a date trigger, time-zone arithmetic,
a wake-up of the scheduler's own thread, whose Python then competes for the interpreter lock),
several times the job's hand-over itself (benchmarks/results/overhead.md)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

from apscheduler.executors.pool import ThreadPoolExecutor as SchedulerPool
from apscheduler.schedulers.background import BackgroundScheduler

T = TypeVar("T")


class MonitorThread:
    def __init__(self) -> None:
        self._jobs = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mechwatch-monitor")
        self._scheduler = BackgroundScheduler(
            executors={"default": SchedulerPool(max_workers=1)},
            job_defaults={"coalesce": False, "max_instances": 1, "misfire_grace_time": None},
        )

    def start(self) -> None:
        self._scheduler.start()

    def submit(self, fn: Callable[[], T]) -> Future:
        """Run ``fn`` on the monitor thread; a future cancelled before it starts (a rollback)
        skips it. After ``shutdown`` the future fails at once."""
        try:
            return self._jobs.submit(fn)
        except RuntimeError as exc:  # shut down
            future: Future = Future()
            future.set_exception(exc)
            return future

    def every(self, seconds: float, fn: Callable[[], None], name: str) -> None:
        """Call ``fn`` every ``seconds`` on the timer thread."""
        self._scheduler.add_job(fn, "interval", seconds=seconds, id=name)

    def shutdown(self) -> None:
        """Stop without waiting for a job in progress (it finishes on its own); jobs not yet
        started are cancelled."""
        self._jobs.shutdown(wait=False, cancel_futures=True)
        try:
            self._scheduler.shutdown(wait=False)
        except Exception:  # not started, or already stopped
            pass
