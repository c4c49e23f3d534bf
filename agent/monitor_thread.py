"""The agent's one background thread (APScheduler ``BackgroundScheduler``): monitor jobs on
snapshots, and timers (the watchdog). Jobs run one at a time, in submission order; the training
thread never waits for one except where it asks for a result (``Future.result``)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

from apscheduler.executors.pool import ThreadPoolExecutor
from apscheduler.schedulers.background import BackgroundScheduler

T = TypeVar("T")


class MonitorThread:
    def __init__(self) -> None:
        self._scheduler = BackgroundScheduler(
            executors={"default": ThreadPoolExecutor(max_workers=1)},
            job_defaults={"coalesce": False, "max_instances": 1, "misfire_grace_time": None},
        )

    def start(self) -> None:
        self._scheduler.start()

    def submit(self, fn: Callable[[], T]) -> Future:
        """Run ``fn`` on the thread; a future cancelled before it starts (a rollback) skips it."""
        future: Future = Future()

        def run() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(fn())
            except Exception as exc:
                future.set_exception(exc)

        self._scheduler.add_job(run)
        return future

    def every(self, seconds: float, fn: Callable[[], None], name: str) -> None:
        """Call ``fn`` every ``seconds`` on the thread."""
        self._scheduler.add_job(fn, "interval", seconds=seconds, id=name)

    def shutdown(self) -> None:
        """Stop without waiting for a job in progress (it finishes on its own)."""
        try:
            self._scheduler.shutdown(wait=False)
        except Exception:  # not started, or already stopped
            pass
