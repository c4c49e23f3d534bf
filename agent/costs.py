"""Where the agent's own time goes, part by part (``Agent.costs()``, the ``costs`` record of the
event log at close, ``benchmarks/overhead.py``).

Each part adds the seconds it took: wall seconds on the training thread (what the training loop
waits for), CPU seconds on the monitor thread (``time.thread_time``: work that runs beside the
training loop, on another core when there is one). Reading a clock costs tens of nanoseconds;
a router hook reads it twice per forward.

Parts (``PARTS``, training thread unless said otherwise):
    router hooks      the forward hooks of the MoE routers (every training forward)
    grad norm         the agent's own gradient norm (when ``step()`` is not given one)
    step inputs       checking the loss and grad norm given to ``step()``
    read-outs         the buffered loss / grad norm and the router sums, read to the host
    snapshots         fp32 copies of the sampled Q/K and control weights
    kernel audit      capturing an audited attention call and replaying its backward
    monitor results   waiting for a monitor result that is due (0 unless the thread is late)
    rules             rule evaluation, attribution and pacing (one decision round)
    event log         writing event-log records (metrics, alerts, incidents, actions)
    metric sinks      TensorBoard, W&B, ``on_metrics``
    pages             handing pages to the dispatcher (it sends on its own thread)
    actions           running remediation actions
    checkpoints       queueing checkpoints (they are written on a writer thread)
    monitor thread    CPU seconds of the QK and control spectra (monitor thread)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

T = TypeVar("T")

PARTS = (
    "router hooks",
    "grad norm",
    "step inputs",
    "read-outs",
    "snapshots",
    "kernel audit",
    "monitor results",
    "rules",
    "event log",
    "metric sinks",
    "pages",
    "actions",
    "checkpoints",
    "monitor thread",
)
MONITOR_THREAD = "monitor thread"


class Costs:
    """Seconds per part since the agent started (see the module docstring)."""

    def __init__(self) -> None:
        self._seconds = dict.fromkeys(PARTS, 0.0)
        self._sources: dict[str, Callable[[], float]] = {}
        self._lock = threading.Lock()  # two threads add (training, monitor)

    def source(self, part: str, seconds: Callable[[], float]) -> None:
        """``part`` also counts ``seconds()``: a counter kept where taking the lock on every
        call would cost too much (the router hooks: one per router per forward)."""
        self._sources[part] = seconds

    def add(self, part: str, seconds: float) -> None:
        with self._lock:
            self._seconds[part] = self._seconds.get(part, 0.0) + seconds

    @contextmanager
    def timed(self, part: str) -> Iterator[None]:
        """Add the wall seconds of the ``with`` body to ``part``."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(part, time.perf_counter() - start)

    def call(self, part: str, fn: Callable[[], T]) -> T:
        """``fn()``, its wall seconds added to ``part``."""
        start = time.perf_counter()
        try:
            return fn()
        finally:
            self.add(part, time.perf_counter() - start)

    def on_monitor_thread(self, fn: Callable[[], T]) -> Callable[[], T]:
        """``fn`` wrapped to add its CPU seconds to the monitor thread's part."""

        def run() -> T:
            start = time.thread_time()
            try:
                return fn()
            finally:
                self.add(MONITOR_THREAD, time.thread_time() - start)

        return run

    def seconds(self) -> dict[str, float]:
        """A copy: part -> seconds."""
        with self._lock:
            out = dict(self._seconds)
        for part, seconds in self._sources.items():
            out[part] = out.get(part, 0.0) + seconds()
        return out
