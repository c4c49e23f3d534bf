"""The monitor process's main loop (``python -m agent.monitor_worker READ_FD WRITE_FD``): QK jobs
and router reductions computed off the training process, so that their Python code never holds
the training process's interpreter lock (benchmarks/results/monitor_contention.md: the same
jobs slow a training step by 41% on a thread of its process, by 2% in another process).

Arguments: the pipe ends, and the path prefix of the training process's shared files. The
worker first answers ``("ready",)`` (torch imported). The training process
(``agent.monitor_process``) sends frames over a pipe; each frame is one pickled tuple:

* ``("job", job_id, owner, spec)``: compute the QK samples of one job (``JobSpec``), or the
  routing sums of the routers' handed-over logits (``ReduceSpec``: a list of (5 + E,) rows),
  and answer ``("done", job_id, result, cpu_seconds, (start, end))`` (``end - start``: its
  wall time on ``time.perf_counter``, the system's monotonic clock on Linux) or
  ``("error", job_id, text)``;
* ``("reset", owner)``: forget ``owner``'s Delta_2 directions (the run rolled back);
* ``("unmap", paths)``: drop the mappings of snapshot files the training process let go;
* ``("adopt", path)``: a file the training process made; removed at the end if still there;
* ``("forget", owner)``: the owner closed (its directions are dropped).

Snapshots and router logit buffers are never sent: they are files (``/dev/shm``) both
processes map; a frame names them by path and shape (and dtype). When the training process goes
away (end of file on the pipe) the worker removes every file it knows of and exits.
"""

from __future__ import annotations

import os
import pickle
import struct
import sys
import time
from dataclasses import dataclass, field

import torch

from agent.discovery import AttentionSite
from agent.probes import QKJob, compute_qk_samples
from agent.router_buffer import HandedBatch

_HEADER = struct.Struct("<Q")  # frame length, bytes


Where = tuple[str, tuple[int, ...], str]  # a tensor on a shared file: path, shape, dtype name


@dataclass
class JobSpec:
    """What a ``QKJob`` is, without tensors: snapshots as {parameter name: (path, shape)}."""

    step: int
    site: AttentionSite  # without its module and live parameters
    previous: dict[str, Where]
    current: dict[str, Where]
    heads: list[int]
    controls: dict[str, str]
    control_rows: int | None
    orders: tuple[int, ...]
    # (layer, head) -> Delta_2 top direction (d,) measured on the monitor thread before this
    # layer's first job in the worker
    directions: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict)


@dataclass
class BatchSpec:
    """A ``HandedBatch`` without tensors: its logit buffer as (path, shape, dtype name) of the
    whole storage, the forwards filled, its layout, and the sums already reduced."""

    top_k: int
    storage: Where | None  # the whole buffer (None: no forward buffered)
    filled: int
    tokens_first: bool
    sums: torch.Tensor | None  # (5,)
    load: torch.Tensor | None  # (E,)


@dataclass
class ReduceSpec:
    """The routers' batches handed over for one read-out (``HandedBatch.reduce`` each)."""

    batches: list[BatchSpec]


def write_frame(fd: int, message: object) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    _write_all(fd, _HEADER.pack(len(data)) + data)


def read_frame(fd: int) -> object | None:
    """The next message, or None at the end of the pipe."""
    header = _read_exact(fd, _HEADER.size)
    if header is None:
        return None
    data = _read_exact(fd, _HEADER.unpack(header)[0])
    return None if data is None else pickle.loads(data)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _read_exact(fd: int, size: int) -> bytes | None:
    chunks, left = [], size
    while left:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


class Worker:
    def __init__(self) -> None:
        self.mapped: dict[str, torch.Tensor] = {}  # path -> flat tensor on the file
        self.adopted: set[str] = set()  # files to remove at the end (mapped or not)
        self.directions: dict[int, dict[tuple[str, int], torch.Tensor]] = {}  # owner -> ...

    def tensor(
        self, path: str, shape: tuple[int, ...], dtype_name: str = "float32"
    ) -> torch.Tensor:
        dtype = getattr(torch, dtype_name)
        flat = self.mapped.get(path)
        numel = 1
        for n in shape:
            numel *= n
        if flat is None or flat.numel() != numel or flat.dtype != dtype:
            flat = torch.from_file(path, shared=True, size=numel, dtype=dtype)
            self.mapped[path] = flat
        return flat.view(shape)

    def reduce(self, spec: ReduceSpec) -> tuple[list[torch.Tensor | None], float]:
        """Each batch's (5 + E,) routing sums (``HandedBatch.reduce``) and the CPU seconds."""
        start = time.thread_time()
        rows = []
        for batch in spec.batches:
            logits = None
            if batch.storage is not None and batch.filled:
                tensor = self.tensor(*batch.storage)[: batch.filled]
                logits = tensor.transpose(1, 2) if batch.tokens_first else tensor
            handed = HandedBatch(batch.top_k, logits, batch.sums, batch.load, None)
            rows.append(handed.reduce())
        return rows, time.thread_time() - start

    def compute(self, owner: int, spec: JobSpec) -> tuple[list, float]:
        """The job's samples and the CPU seconds they took."""
        start = time.thread_time()
        directions = self.directions.setdefault(owner, {})
        for key, direction in spec.directions.items():
            directions.setdefault(key, direction)
        job = QKJob(
            spec.step,
            spec.site,
            {name: self.tensor(*where) for name, where in spec.previous.items()},
            {name: self.tensor(*where) for name, where in spec.current.items()},
            spec.heads,
            spec.controls,
            directions,
            control_rows=spec.control_rows,
        )
        samples = compute_qk_samples(job, spec.orders)
        return samples, time.thread_time() - start

    def handle(self, message: tuple, write: int) -> None:
        kind = message[0]
        if kind == "job":
            _, job_id, owner, spec = message
            began = time.perf_counter()
            try:
                if isinstance(spec, ReduceSpec):
                    samples, seconds = self.reduce(spec)
                else:
                    samples, seconds = self.compute(owner, spec)
            except Exception as exc:
                write_frame(write, ("error", job_id, f"{type(exc).__name__}: {exc}"))
            else:
                interval = (began, time.perf_counter())
                write_frame(write, ("done", job_id, samples, seconds, interval))
        elif kind in ("reset", "forget"):
            self.directions.pop(message[1], None)
        elif kind == "unmap":
            for path in message[1]:
                self.mapped.pop(path, None)
                self.adopted.discard(path)
        elif kind == "adopt":
            self.adopted.add(message[1])

    def remove_files(self, prefix: str | None = None) -> None:
        """Remove the files it knows of and, with ``prefix``, every file whose path starts
        with it (those the training process made just before it was killed)."""
        paths = set(self.mapped) | self.adopted
        if prefix:
            directory, name = os.path.split(prefix)
            try:
                paths |= {
                    os.path.join(directory, n) for n in os.listdir(directory) if n.startswith(name)
                }
            except OSError:
                pass
        for path in paths:
            try:
                os.unlink(path)
            except OSError:
                pass


def main(argv: list[str]) -> int:
    read, write = int(argv[0]), int(argv[1])
    prefix = argv[2] if len(argv) > 2 else None  # the training process's shared files
    torch.set_num_threads(int(os.environ.get("MECHWATCH_MONITOR_THREADS", "1")))
    worker = Worker()
    try:
        write_frame(write, ("ready",))
        while (message := read_frame(read)) is not None:
            worker.handle(message, write)  # type: ignore[arg-type]
    except (BrokenPipeError, KeyboardInterrupt):
        pass
    finally:
        worker.remove_files(prefix)
    return 0


if __name__ == "__main__":
    # Run the imported module's main, not this __main__ copy: the specs the training process
    # pickles are agent.monitor_worker's classes, and isinstance must see the same ones.
    from agent.monitor_worker import main as module_main

    sys.exit(module_main(sys.argv[1:]))
