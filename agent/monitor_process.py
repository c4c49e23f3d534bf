"""QK jobs and router reductions in a monitor process (``qk.worker``): the training process's
side.

Why: a QK job is torch calls with Python in between; on a thread of the training process that
Python holds the interpreter lock the training thread needs between its own torch calls, and a
training step beside a job is ~40% slower; beside the same job in another process, ~2% slower
(benchmarks/results/monitor_contention.md). So the jobs run in one worker process per training
process (``agent.monitor_worker``), shared by every agent of that process and started at the
first job.

How: snapshot buffers are files in ``/dev/shm`` mapped by both processes (``SharedFiles``), so
a snapshot is still one copy kernel on the training thread and a job sent to the worker is a
few hundred bytes (paths, shapes, the layer's geometry, the heads). Frames go through a writer
thread (the training thread never blocks on a full pipe); a reader thread resolves each job's
``Future`` and calls the job's ``done`` callback (buffers back to the pool, the budget's
timing). The worker is started as ``python -m agent.monitor_worker``: a fresh interpreter,
never a fork of the training process (no copied CUDA state or locks) and never a re-import of
the user's script (``multiprocessing``'s spawn would run an unguarded training script again).

When the worker cannot start or exits, every job in flight fails (reported by the
measurements as a ``qk monitor`` failure) and ``alive`` turns False: the measurements then go
on on the monitor thread.

The worker's memory allocator (``WORKER_MALLOC_ENV``, glibc; ignored elsewhere): by default
glibc hands a freed block of more than a few hundred KiB back to the kernel (the mmap
threshold, heap trimming), so every job's temporaries were fresh pages again: on the test bed
a router read-out's (F, E, N) temporaries (0.8 MiB each) cost ~3,300 page faults, about half
of its CPU time. The worker keeps them mapped instead; its memory stays at its peak (free heap
above 64 MiB is still given back).
"""

from __future__ import annotations

import atexit
import dataclasses
import itertools
import logging
import os
import queue
import subprocess
import sys
import tempfile
import threading
import uuid
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from agent.monitor_worker import BatchSpec, JobSpec, ReduceSpec, Where, read_frame, write_frame

if TYPE_CHECKING:
    from agent.discovery import AttentionSite
    from agent.probes import QKJob, SnapshotBuffers
    from agent.router_buffer import HandedBatch

log = logging.getLogger(__name__)

# The worker's glibc malloc settings (module docstring), in its environment only; a value the
# user set wins. Blocks up to 32 MiB (glibc's largest threshold on 64-bit) come from the heap,
# and free heap is trimmed only beyond 64 MiB.
WORKER_MALLOC_ENV = {
    "MALLOC_MMAP_THRESHOLD_": str(32 * 2**20),
    "MALLOC_TRIM_THRESHOLD_": str(64 * 2**20),
}

Done = Callable[[float], None]  # the worker's CPU seconds for the job


def shared_directory() -> Path:
    """Where snapshot files live: ``/dev/shm`` (memory) when there is one, else the temp dir."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def file_prefix() -> str:
    """The path prefix of every shared file this process makes (the worker removes whatever
    is left under it when it ends: a file made just before this process was killed)."""
    return str(shared_directory() / f"mechwatch-{os.getpid()}-")


def process_supported() -> bool:
    """The worker needs ``torch.from_file`` shared mappings and fd passing: POSIX."""
    return os.name == "posix"


class SharedFiles:
    """Allocates fp32 CPU tensors on files both processes map. A tensor's file is removed, and
    the worker told to drop its mapping, when the training process lets the tensor go."""

    def __init__(self, process: MonitorProcess) -> None:
        self._process = process
        self._paths: dict[int, str] = {}  # data_ptr -> path

    def allocate(
        self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        shape = torch.Size(shape)
        numel = max(1, shape.numel())
        path = file_prefix() + uuid.uuid4().hex
        tensor = torch.from_file(path, shared=True, size=numel, dtype=dtype)
        tensor = tensor[: shape.numel()].view(shape)
        self._paths[tensor.data_ptr()] = path
        weakref.finalize(tensor, self._release, tensor.data_ptr(), path)
        self._process.adopt(path)  # removed by the worker if this process dies first
        return tensor

    def where(self, tensor: torch.Tensor) -> Where | None:
        """(path, shape, dtype name) of a whole tensor allocated here (None: another one)."""
        path = self._paths.get(tensor.data_ptr())
        if path is None:
            return None
        return path, tuple(tensor.shape), str(tensor.dtype).removeprefix("torch.")

    def _release(self, pointer: int, path: str) -> None:
        self._paths.pop(pointer, None)
        _unlink(path)
        self._process.unmap([path])

    def close(self) -> None:
        paths = list(self._paths.values())
        self._paths.clear()
        for path in paths:
            _unlink(path)
        self._process.unmap(paths)


class MonitorProcess:
    """One worker process and the two threads that talk to it. ``shared()`` is the one every
    agent of this process uses."""

    _shared: MonitorProcess | None = None
    _shared_lock = threading.Lock()
    _owners = itertools.count(1)

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[int, tuple[Future, Done]] = {}
        self._ids = itertools.count(1)
        self._outbox: queue.SimpleQueue[tuple | None] = queue.SimpleQueue()
        self._process: subprocess.Popen | None = None
        self.ready = threading.Event()  # the worker has imported torch and reads jobs
        self.alive = False
        self.error: str | None = None

    @classmethod
    def shared(cls) -> MonitorProcess:
        with cls._shared_lock:
            if cls._shared is None or not cls._shared.alive:
                cls._shared = cls()
                cls._shared.start()
                atexit.register(cls._shared.close)
            return cls._shared

    @classmethod
    def new_owner(cls) -> int:
        return next(cls._owners)

    def start(self) -> None:
        to_worker_read, to_worker_write = os.pipe()
        from_worker_read, from_worker_write = os.pipe()
        package_root = str(Path(__file__).resolve().parent.parent)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
        for key, value in WORKER_MALLOC_ENV.items():
            env.setdefault(key, value)
        try:
            self._process = subprocess.Popen(
                [sys.executable, "-m", "agent.monitor_worker"]
                + [str(to_worker_read), str(from_worker_write), file_prefix()],
                pass_fds=(to_worker_read, from_worker_write),
                env=env,
                stdin=subprocess.DEVNULL,
            )
        except OSError as exc:
            self.error = f"the monitor process did not start: {exc}"
            for fd in (to_worker_read, to_worker_write, from_worker_read, from_worker_write):
                os.close(fd)
            return
        os.close(to_worker_read)
        os.close(from_worker_write)
        self._write_fd, self._read_fd = to_worker_write, from_worker_read
        self.alive = True
        for target, name in ((self._write_loop, "writer"), (self._read_loop, "reader")):
            threading.Thread(target=target, name=f"mechwatch-monitor-{name}", daemon=True).start()

    # -- the training thread -----------------------------------------------------------------
    def submit(self, owner: int, spec: JobSpec, done: Done) -> Future:
        future: Future = Future()
        with self._lock:
            if not self.alive:
                future.set_exception(RuntimeError(self.error or "the monitor process exited"))
                return future
            job_id = next(self._ids)
            self._pending[job_id] = (future, done)
        self._outbox.put(("job", job_id, owner, spec))
        return future

    def reset(self, owner: int) -> None:
        self._send(("reset", owner))

    def forget(self, owner: int) -> None:
        self._send(("forget", owner))

    def unmap(self, paths: list[str]) -> None:
        if paths:
            self._send(("unmap", paths))

    def adopt(self, path: str) -> None:
        """The worker removes ``path`` when it ends, even if it never mapped it (this
        process killed before it let the file go)."""
        self._send(("adopt", path))

    def _send(self, message: tuple) -> None:
        if self.alive:
            self._outbox.put(message)

    def close(self) -> None:
        """Stop the worker (it removes the snapshot files it knows of)."""
        if self._process is None:
            return
        self._outbox.put(None)  # the writer closes the pipe: the worker sees its end
        try:
            self._process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._process.kill()
        self._fail_pending("the monitor process was closed")

    # -- the writer and reader threads ---------------------------------------------------------
    def _write_loop(self) -> None:
        try:
            while (message := self._outbox.get()) is not None:
                write_frame(self._write_fd, message)
        except OSError as exc:  # the worker is gone: the reader reports it
            log.debug("monitor process pipe: %s", exc)
        finally:
            os.close(self._write_fd)

    def _read_loop(self) -> None:
        try:
            while (message := read_frame(self._read_fd)) is not None:
                if message == ("ready",):
                    self.ready.set()
                else:
                    self._resolve(message)  # type: ignore[arg-type]
        except Exception as exc:  # a frame that cannot be read: the worker is unusable
            self.error = f"the monitor process's answer could not be read: {exc}"
        finally:
            os.close(self._read_fd)
            code = self._process.wait() if self._process is not None else None
            self.error = self.error or f"the monitor process exited (code {code})"
            self._fail_pending(self.error)

    def _resolve(self, message: tuple[Any, ...]) -> None:
        kind, job_id = message[0], message[1]
        with self._lock:
            future, done = self._pending.pop(job_id, (None, None))
        if future is None or done is None:
            return
        if kind == "done":
            done(message[3])
            if future.set_running_or_notify_cancel():
                future.set_result(message[2])
        else:
            done(0.0)
            if future.set_running_or_notify_cancel():
                future.set_exception(RuntimeError(message[2]))

    def _fail_pending(self, text: str) -> None:
        with self._lock:
            self.alive = False
            pending, self._pending = self._pending, {}
        for future, _ in pending.values():
            if future.set_running_or_notify_cancel():
                future.set_exception(RuntimeError(text))


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


class ProcessWorker:
    """One ``Measurements``' use of the shared monitor process: its snapshot buffers (and the
    routers' logit buffers) are allocated on shared files, its jobs are sent as ``JobSpec``s
    (and ``ReduceSpec``s), its Delta_2 directions live in the worker under its owner number."""

    def __init__(self, buffers: SnapshotBuffers) -> None:
        self.process = MonitorProcess.shared()
        self.owner = MonitorProcess.new_owner()
        self.files = SharedFiles(self.process)
        self._sites: dict[str, AttentionSite] = {}  # layer -> the site without its module
        self._sent: set[str] = set()  # layers whose jobs went to the worker since a reset
        if self.process.alive:
            buffers.allocate_cpu = self.files.allocate

    @property
    def ready(self) -> bool:
        """The worker takes jobs (until then they run on the monitor thread)."""
        return self.process.ready.is_set()

    def submit(self, job: QKJob, orders: tuple[int, ...], done: Done) -> Future:
        """The job's samples, computed by the worker (a failed future when a snapshot is not
        on a shared file). A layer's first job in the worker carries the Delta_2 directions
        of its heads measured on the monitor thread before (the persistence goes on; a thread
        job still running then leaves its head without a persistence sample once)."""
        handed = {}
        if job.site.name not in self._sent:
            keys = [(job.site.name, h) for h in job.heads]
            handed = {key: job.directions[key] for key in keys if key in job.directions}
        try:
            spec = JobSpec(
                step=job.step,
                site=self._site(job.site),
                previous=self._where(job.previous),
                current=self._where(job.current),
                heads=list(job.heads),
                controls=dict(job.controls),
                control_rows=job.control_rows,
                orders=orders,
                directions=handed,
            )
        except ValueError as exc:
            future: Future = Future()
            future.set_exception(exc)
            return future
        self._sent.add(job.site.name)
        return self.process.submit(self.owner, spec, done)

    def reduce(self, batches: list[HandedBatch], done: Done) -> Future:
        """The routers' (5 + E,) rows of one read-out, reduced by the worker (a failed future
        when a batch's logits are not on a shared file)."""
        specs = []
        for batch in batches:
            where = None
            if batch.logits is not None and batch.storage is not None:
                where = self.files.where(batch.storage.tensor)
                if where is None:
                    future: Future = Future()
                    future.set_exception(ValueError("router logits are not on a shared file"))
                    return future
            filled = 0 if batch.logits is None else batch.logits.shape[0]
            tokens_first = batch.storage is not None and batch.storage.tokens_first
            specs.append(
                BatchSpec(batch.top_k, where, filled, tokens_first, batch.sums, batch.load)
            )
        return self.process.submit(self.owner, ReduceSpec(specs), done)

    def reset(self) -> None:
        """The run rolled back: the worker forgets this owner's directions."""
        self._sent.clear()
        self.process.reset(self.owner)

    def close(self) -> None:
        self.process.forget(self.owner)
        self.files.close()

    def _site(self, site: AttentionSite) -> AttentionSite:
        stripped = self._sites.get(site.name)
        if stripped is None:
            stripped = dataclasses.replace(site, module=None, live_parameters={})
            self._sites[site.name] = stripped
        return stripped

    def _where(self, snapshot: dict[str, torch.Tensor]) -> dict[str, Where]:
        out = {}
        for name, tensor in snapshot.items():
            where = self.files.where(tensor)
            if where is None:
                raise ValueError(f"snapshot {name!r} is not on a shared file")
            out[name] = where
        return out
