"""Checkpoints the agent can roll back to: atomic, checksummed, written off the training thread.

A ``CheckpointManager`` saves, every ``every_n_steps`` optimizer steps, everything a run needs
to continue bit-for-bit: the model, the optimizer, the LR scheduler, the RNG states (python
``random``, numpy's global generator, torch CPU and CUDA), the agent's state and the user's
data position. On the training thread ``save`` only copies that state to host memory; a
background thread serializes it with ``torch.save`` to ``ckpt-<step>.pt.tmp``, fsyncs it,
renames it to ``ckpt-<step>.pt``, fsyncs the directory and then writes the sidecar manifest
``ckpt-<step>.json`` (also atomically) with the file's sha256, size, time and the monitors'
health at save time. A checkpoint is *verified* when its manifest exists and the file's sha256
matches; a crash at any point leaves either the previous checkpoints or a complete new one,
never a half file that is taken for good.

Example::

    ckpts = CheckpointManager("runs/ckpt", model=model, optimizer=opt, scheduler=sched,
                              every_n_steps=500, data_state=loader.state,
                              restore_data=loader.restore)
    for step in range(1, total + 1):
        ...  # forward, backward, opt.step(), sched.step()
        ckpts.maybe_save(step, health={"healthy": True, "firing": []})
    ckpts.close()

``step`` always means the number of optimizer steps completed when the state was captured; a
restored run continues with optimizer step ``step + 1``.

A checkpoint belongs to the run that wrote it. Every manifest and payload records the
manager's *lineage*, a random id made when the manager starts; restoring a payload adopts its
lineage (a resumed run continues the timeline it was resumed from). A rollback only considers
checkpoints of the current lineage (``own_run=True``), and retention and ``discard_after`` only
delete checkpoints of it: checkpoints that another run left in the directory are never rolled
back to and never deleted by us (a warning names them at the first save), except that a save
at the same step replaces the file of that name.
"""

from __future__ import annotations

import atexit
import collections
import copy
import hashlib
import json
import logging
import os
import random
import re
import threading
import time
import uuid
import weakref
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Literal, Protocol, runtime_checkable

import numpy as np
import torch

_log = logging.getLogger(__name__)

# Checkpoint payload keys, defined once.
FORMAT_VERSION = 1
KEY_FORMAT = "format"
KEY_STEP = "step"
KEY_MODEL = "model"
KEY_OPTIMIZER = "optimizer"
KEY_SCHEDULER = "scheduler"
KEY_RNG = "rng"
KEY_AGENT = "agent"
KEY_DATA = "data"
KEY_LINEAGE = "lineage"
RNG_PYTHON = "python"
RNG_NUMPY = "numpy"
RNG_TORCH = "torch"
RNG_CUDA = "cuda"

_DATA_FILE = re.compile(r"^ckpt-(\d+)\.pt$")
_MANIFEST_FILE = re.compile(r"^ckpt-(\d+)\.json$")
_TMP_FILE = re.compile(r"^ckpt-\d+\.(pt|json)\.tmp$")
_MAX_RECORDED_WARNINGS = 200


class CheckpointCorrupt(Exception):
    """A checkpoint whose manifest, checksum or contents cannot be trusted."""


class CheckpointRestoreError(RuntimeError):
    """Loading a checkpoint into the run failed. ``run_unchanged`` says whether the run was put
    back exactly as it was before the attempt (False: the run may be inconsistent; halt it)."""

    def __init__(self, message: str, *, run_unchanged: bool) -> None:
        super().__init__(message)
        self.run_unchanged = run_unchanged


@dataclass(frozen=True)
class CheckpointInfo:
    """One checkpoint as described by its manifest (not yet verified against the file)."""

    step: int  # optimizer steps completed when the state was captured
    path: Path  # the data file, <dir>/ckpt-<step>.pt
    manifest_path: Path  # <dir>/ckpt-<step>.json
    sha256: str
    size_bytes: int
    saved_at: float  # unix seconds when the state was captured
    health: dict[str, Any] | None  # the monitors' health at save time, as given to save()
    known_good: bool  # health said healthy at save time
    lineage: str | None = None  # the run that wrote it (None: written before lineages existed)


@runtime_checkable
class CheckpointStore(Protocol):
    """What the rollback action needs from a checkpoint store; ``CheckpointManager`` is the
    implementation, an integration (or a test) may bring its own."""

    directory: Path

    def flush(self, timeout_s: float | None = None) -> bool: ...

    def checkpoints(self) -> list[CheckpointInfo]: ...

    def newest_verified(
        self,
        before_step: int | None = None,
        *,
        known_good_only: bool = False,
        skipped: list[str] | None = None,
        own_run: bool = False,
    ) -> CheckpointInfo | None: ...

    def load_newest(
        self,
        before_step: int | None = None,
        *,
        known_good_only: bool = False,
        skipped: list[str] | None = None,
        own_run: bool = False,
    ) -> tuple[CheckpointInfo, dict[str, Any]] | None: ...

    def restore(
        self,
        payload: dict[str, Any],
        *,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any | None = None,
        skip_batches: int = 0,
        source: str = "checkpoint",
    ) -> int: ...

    def discard_after(self, step: int) -> list[int]: ...

    def record_warning(self, message: str) -> None: ...


@dataclass
class _SaveJob:
    step: int
    payload: dict[str, Any] | None
    manifest: dict[str, Any]
    cuda_events: list[Any]  # torch.cuda.Event per device with copies in flight
    done: threading.Event = field(default_factory=threading.Event)


class _HashingWriter:
    """A write-only file wrapper that hashes what passes through it, so the checksum costs no
    second read of the file."""

    def __init__(self, file: BinaryIO) -> None:
        self._file = file
        self.sha256 = hashlib.sha256()
        self.size_bytes = 0

    def write(self, data: bytes) -> int:
        self.sha256.update(data)
        self.size_bytes += len(data)
        return self._file.write(data)

    def flush(self) -> None:
        self._file.flush()


def _serialize(payload: dict[str, Any], file: _HashingWriter) -> None:
    """The serialization step of the background writer (one function so tests can gate it)."""
    torch.save(payload, file)


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json_atomic(path: Path, obj: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_directory(path.parent)


def _file_sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


# Types that torch.load(weights_only=True) reconstructs without extra allow-listing.
_PLAIN_LEAVES = (str, bytes, bytearray, int, float, bool, complex, type(None))
_PLAIN_TORCH_LEAVES = (torch.dtype, torch.device, torch.Size)


class _HostCopier:
    """Copies a nested state (dicts, lists, tuples, tensors, plain values) to host memory.

    CPU tensors are cloned. Device tensors are copied with ``non_blocking=True`` into pinned
    host buffers that are kept and reused from one save to the next (``pinned`` is None for a
    one-off synchronous copy); one CUDA event per device marks when the copies are done, and
    the writer thread waits on it, so the training thread never synchronizes with the device.
    With ``weights_only`` every leaf must be a type ``torch.load(weights_only=True)`` accepts;
    numpy scalars are stored as Python numbers, anything else is a ValueError naming its path.
    """

    def __init__(self, *, weights_only: bool, pinned: dict[str, torch.Tensor] | None) -> None:
        self.weights_only = weights_only
        self.pinned = pinned
        self.devices: set[torch.device] = set()

    def copy(self, obj: Any, path: str) -> Any:
        kind = type(obj)
        if isinstance(obj, torch.Tensor):
            return self._copy_tensor(obj, path)
        if kind in _PLAIN_LEAVES or kind in _PLAIN_TORCH_LEAVES:
            return obj
        if kind in (dict, OrderedDict, Counter):
            out = kind()
            for key, value in obj.items():
                if self.weights_only and type(key) not in _PLAIN_LEAVES:
                    raise self._not_loadable(f"{path} key {key!r}", key)
                out[key] = self.copy(value, f"{path}[{key!r}]")
            metadata = getattr(obj, "_metadata", None)  # module state_dict versions
            if metadata is not None:
                out._metadata = copy.deepcopy(metadata)
            return out
        if kind in (list, tuple):
            return kind(self.copy(v, f"{path}[{i}]") for i, v in enumerate(obj))
        if kind is set:
            return {self.copy(v, f"{path}{{...}}") for v in obj}
        if isinstance(obj, np.generic) and self.weights_only:
            return obj.item()  # a numpy scalar becomes the Python number it holds
        if self.weights_only:
            raise self._not_loadable(path, obj)
        return copy.deepcopy(obj)

    def _copy_tensor(self, t: torch.Tensor, path: str) -> torch.Tensor:
        if self.weights_only and type(t) not in (torch.Tensor, torch.nn.Parameter):
            raise self._not_loadable(path, t)
        t = t.detach()
        if t.device.type == "cpu":
            return t.clone()
        if self.pinned is None or not torch.cuda.is_available() or t.device.type != "cuda":
            return t.to("cpu")  # one-off copy: synchronous, only used off the hot path
        buf = self.pinned.get(path)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
            self.pinned[path] = buf
        buf.copy_(t, non_blocking=True)
        self.devices.add(t.device)
        return buf

    @staticmethod
    def _not_loadable(path: str, obj: Any) -> ValueError:
        return ValueError(
            f"{path}: a {type(obj).__module__}.{type(obj).__qualname__} cannot be loaded with "
            "torch.load(weights_only=True); keep checkpointed state to dicts, lists, tuples, "
            "numbers, strings and plain tensors, or construct "
            "CheckpointManager(weights_only=False)"
        )


def capture_rng_state() -> dict[str, Any]:
    """The global RNG states as plain containers and tensors (loadable with weights_only)."""
    kind, keys, pos, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        RNG_PYTHON: random.getstate(),  # (version, tuple of 625 ints, gauss_next)
        RNG_NUMPY: {
            "kind": str(kind),
            "keys": [int(k) for k in keys],  # 624 uint32 words of MT19937
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        RNG_TORCH: torch.get_rng_state(),  # uint8 tensor
    }
    # Only when CUDA is in use: reading the CUDA generators would otherwise initialize CUDA.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state[RNG_CUDA] = torch.cuda.get_rng_state_all()  # one uint8 tensor per device
    return state


def restore_rng_state(state: dict[str, Any]) -> list[str]:
    """Set the global RNG states from ``capture_rng_state``'s dict; returns warnings."""
    warnings: list[str] = []
    version, internal, gauss_next = state[RNG_PYTHON]
    random.setstate((version, tuple(internal), gauss_next))
    np_state = state[RNG_NUMPY]
    np.random.set_state(
        (
            np_state["kind"],
            np.asarray(np_state["keys"], dtype=np.uint32),
            np_state["pos"],
            np_state["has_gauss"],
            np_state["cached_gaussian"],
        )
    )
    torch.set_rng_state(state[RNG_TORCH])
    cuda_states = state.get(RNG_CUDA)
    if cuda_states is not None:
        if torch.cuda.is_available() and torch.cuda.device_count() == len(cuda_states):
            torch.cuda.set_rng_state_all(cuda_states)
        else:
            warnings.append(
                f"CUDA RNG states for {len(cuda_states)} devices not restored: "
                f"{torch.cuda.device_count() if torch.cuda.is_available() else 0} visible"
            )
    return warnings


class CheckpointManager:
    """Saves and finds checkpoints of one process in one directory (one directory per rank).

    Args:
        directory: where checkpoints go; created if missing. Leftover ``*.tmp`` files from a
            crashed write are removed when the manager starts.
        model, optimizer, scheduler: the runtime objects to save (optimizer and scheduler are
            optional for hand-written loops).
        every_n_steps: ``maybe_save`` saves when ``step % every_n_steps == 0``.
        keep_last: how many of the newest checkpoints retention keeps.
        keep_known_good: how many known-good checkpoints (healthy at save time) retention
            keeps in addition to the last ``keep_last``, however old, spaced by
            ``known_good_spacing``. The newest known-good one is always kept.
        known_good_spacing: the spacing, in steps, of those known-good checkpoints: one per
            ``known_good_spacing``-step bucket, so they reach back about ``keep_known_good *
            known_good_spacing`` steps: choose it so that this covers the detection lag (the
            steps between a fault's onset and its alert) plus the rollback margin, because the
            checkpoints taken in between were still marked healthy. 0: simply the newest
            known-good ones. Default: ``keep_last * every_n_steps``.
        agent_state: returns the agent's state (``Agent.state_dict``) to save with each
            checkpoint; it is copied on the training thread.
        data_state: returns the data position (for example ``{"epoch": 3, "batch": 1200}``);
            it needs ``restore_data``.
        restore_data: ``restore_data(saved_data_state, skip_batches)`` puts the data source
            back at the saved position and then skips ``skip_batches`` further batches. Called
            on restore even without ``data_state`` (with ``None``).
        weights_only: save only what ``torch.load(weights_only=True)`` can load (checked at
            save time, with a ValueError naming the offending entry) and load with it. With
            False any picklable state is saved and loaded with full pickle: our own files,
            loaded only after their sha256 matched the manifest.
        on_busy: what ``save`` does when the previous write is still running: "wait" (up to
            ``busy_wait_s``, then skip with a warning) or "skip" (at once, with a warning).
            Training is never held longer than ``busy_wait_s``.
        busy_wait_s: the longest ``save`` waits for the previous write, in seconds.
        pin_memory: copy CUDA tensors through reused pinned host buffers without a device sync
            on the training thread (costs one host copy of the state, kept between saves).
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any | None = None,
        every_n_steps: int = 1000,
        keep_last: int = 3,
        keep_known_good: int = 2,
        known_good_spacing: int | None = None,
        agent_state: Callable[[], dict[str, Any]] | None = None,
        data_state: Callable[[], Any] | None = None,
        restore_data: Callable[[Any, int], None] | None = None,
        weights_only: bool = True,
        on_busy: Literal["wait", "skip"] = "wait",
        busy_wait_s: float = 60.0,
        pin_memory: bool = True,
    ) -> None:
        if not isinstance(model, torch.nn.Module):
            raise ValueError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
        for name, value, least in (
            ("every_n_steps", every_n_steps, 1),
            ("keep_last", keep_last, 1),
            ("keep_known_good", keep_known_good, 0),
            ("known_good_spacing", 0 if known_good_spacing is None else known_good_spacing, 0),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"{name}: expected an integer >= {least}, got {value!r}")
        if on_busy not in ("wait", "skip"):
            raise ValueError(f"on_busy: expected 'wait' or 'skip', got {on_busy!r}")
        if busy_wait_s < 0:
            raise ValueError(f"busy_wait_s: expected >= 0 seconds, got {busy_wait_s!r}")
        if data_state is not None and restore_data is None:
            raise ValueError("data_state: given without restore_data, nothing could restore it")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.every_n_steps = every_n_steps
        self.keep_last = keep_last
        self.keep_known_good = keep_known_good
        self.known_good_spacing = (
            keep_last * every_n_steps if known_good_spacing is None else known_good_spacing
        )
        self.agent_state = agent_state
        self.data_state = data_state
        self.restore_data = restore_data
        self.weights_only = weights_only
        self.on_busy = on_busy
        self.busy_wait_s = float(busy_wait_s)
        self.pin_memory = pin_memory
        # Retention also keeps the newest known-good checkpoint older than this step: the agent
        # sets it to the step a pending rollback must restore before (onset - margin + 1).
        self.protect_before_step: int | None = None
        # Recorded warnings (skipped corrupt checkpoints, skipped saves), newest last.
        self.warnings: collections.deque[str] = collections.deque(maxlen=_MAX_RECORDED_WARNINGS)
        self.last_error: str | None = None  # the last background write failure
        self.last_capture_seconds: float | None = None  # training-thread cost of the last save
        self.last_write_seconds: float | None = None  # background cost of the last write
        self.saves_started = 0
        self.saves_completed = 0
        self.saves_skipped = 0
        self._pinned: dict[str, torch.Tensor] = {}
        self._job: _SaveJob | None = None
        self._thread: threading.Thread | None = None
        self._dir_lock = threading.Lock()  # the writer's publish/retention vs. scans
        self._last_saved_step: int | None = None
        self._closed = False
        self.lineage = uuid.uuid4().hex[:16]  # this run's id in manifests and payloads
        self._foreign_reported = False
        self._remove_leftover_tmp_files()
        atexit.register(_flush_at_exit, weakref.ref(self))

    # ----------------------------------------------------------------------------------------
    # Saving (training thread: capture only; writer thread: serialize, publish, retention)

    def maybe_save(self, step: int, *, health: dict[str, Any] | None = None) -> bool:
        """Save when ``step`` is a multiple of ``every_n_steps`` (and not saved already).
        Returns whether a write was started."""
        if step % self.every_n_steps != 0 or step == self._last_saved_step:
            return False
        return self.save(step, health=health)

    def save(self, step: int, *, health: dict[str, Any] | None = None) -> bool:
        """Copy the run's state to host memory and write it in the background.

        ``health`` is the monitors' verdict at this step, JSON-serializable, for example
        ``{"healthy": True, "firing": []}``; the checkpoint is known-good when
        ``health["healthy"] is True`` (no health: not known-good). Returns False when the save
        was skipped because the previous write was still running (see ``on_busy``).
        """
        if self._closed:
            raise ValueError("save: the CheckpointManager is closed")
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step: expected an integer >= 0, got {step!r}")
        health_json = self._validate_health(health)
        if not self._wait_for_writer(step):
            return False
        if not self._foreign_reported:
            self._report_foreign()
        t0 = time.perf_counter()
        copier = _HostCopier(
            weights_only=self.weights_only, pinned=self._pinned if self.pin_memory else None
        )
        payload = self._capture(step, copier)
        events = []
        for device in copier.devices:  # mark the end of the non-blocking copies per device
            with torch.cuda.device(device):
                event = torch.cuda.Event()
                event.record()  # on the device's current stream, after the copies
            events.append(event)
        capture_seconds = time.perf_counter() - t0
        known_good = health is not None and health.get("healthy") is True
        manifest = {
            "format": FORMAT_VERSION,
            "step": step,
            "file": self.path_for(step).name,
            "saved_at": time.time(),
            "capture_seconds": capture_seconds,
            "health": health_json,
            "known_good": known_good,
            "lineage": self.lineage,
            "torch": torch.__version__,
        }
        job = _SaveJob(step=step, payload=payload, manifest=manifest, cuda_events=events)
        self._job = job
        self._thread = threading.Thread(
            target=self._write, args=(job,), name=f"mechwatch-ckpt-{step}", daemon=True
        )
        self._thread.start()
        self.saves_started += 1
        self.last_capture_seconds = capture_seconds
        self._last_saved_step = step
        return True

    @property
    def pending(self) -> bool:
        """Whether a background write is still running."""
        return self._job is not None and not self._job.done.is_set()

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait for the pending write; returns False if it was still running at the timeout."""
        job = self._job
        return True if job is None else job.done.wait(timeout_s)

    def close(self, timeout_s: float | None = None) -> None:
        """Wait for the pending write and release the pinned buffers."""
        self.flush(timeout_s)
        self._closed = True
        self._pinned.clear()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def path_for(self, step: int) -> Path:
        return self.directory / f"ckpt-{step}.pt"

    def manifest_path_for(self, step: int) -> Path:
        return self.directory / f"ckpt-{step}.json"

    def _validate_health(self, health: dict[str, Any] | None) -> dict[str, Any] | None:
        if health is None:
            return None
        if not isinstance(health, dict) or not isinstance(health.get("healthy"), bool):
            raise ValueError(f"health: expected a dict with a bool 'healthy' entry, got {health!r}")
        try:
            return json.loads(json.dumps(health))
        except (TypeError, ValueError) as e:
            raise ValueError(f"health: not JSON-serializable ({e})") from e

    def _wait_for_writer(self, step: int) -> bool:
        job = self._job
        if job is None or job.done.is_set():
            return True
        if self.on_busy == "wait" and job.done.wait(self.busy_wait_s):
            return True
        self.saves_skipped += 1
        self.record_warning(
            f"checkpoint at step {step} skipped: the write of step {job.step} is still running"
            + (f" after {self.busy_wait_s:g} s" if self.on_busy == "wait" else "")
        )
        return False

    def _capture(self, step: int, copier: _HostCopier) -> dict[str, Any]:
        payload: dict[str, Any] = {
            KEY_FORMAT: FORMAT_VERSION,
            KEY_STEP: step,
            KEY_MODEL: copier.copy(self.model.state_dict(), "model"),
            KEY_OPTIMIZER: None,
            KEY_SCHEDULER: None,
            KEY_RNG: capture_rng_state(),  # already fresh containers / tensors
            KEY_AGENT: None,
            KEY_DATA: None,
            KEY_LINEAGE: self.lineage,
        }
        if self.optimizer is not None:
            payload[KEY_OPTIMIZER] = copier.copy(self.optimizer.state_dict(), "optimizer")
        if self.scheduler is not None:
            payload[KEY_SCHEDULER] = copier.copy(self.scheduler.state_dict(), "scheduler")
        if self.agent_state is not None:
            payload[KEY_AGENT] = copier.copy(self.agent_state(), "agent_state")
        if self.data_state is not None:
            payload[KEY_DATA] = copier.copy(self.data_state(), "data_state")
        return payload

    def _write(self, job: _SaveJob) -> None:
        """Writer thread: publish the checkpoint, then apply retention. Never raises."""
        try:
            if self._publish(job):
                try:
                    with self._dir_lock:
                        self._apply_retention()
                except Exception as e:  # the new checkpoint is complete; old ones stay longer
                    self.record_warning(
                        f"retention after step {job.step} failed: {type(e).__name__}: {e}"
                    )
        finally:
            job.payload = None
            job.done.set()

    def _publish(self, job: _SaveJob) -> bool:
        """Serialize to a tmp file, fsync, rename, fsync the directory, write the manifest.
        Returns False (error recorded, earlier checkpoints untouched) when any of it fails."""
        step = job.step
        final = self.path_for(step)
        tmp = final.with_name(final.name + ".tmp")
        try:
            t0 = time.perf_counter()
            for event in job.cuda_events:
                event.synchronize()  # the non-blocking device-to-host copies have landed
            assert job.payload is not None
            with open(tmp, "wb") as f:
                writer = _HashingWriter(f)
                _serialize(job.payload, writer)
                f.flush()
                os.fsync(f.fileno())
            job.payload = None  # release the host copy (pinned buffers stay for reuse)
            manifest = dict(job.manifest)
            manifest["sha256"] = writer.sha256.hexdigest()
            manifest["size_bytes"] = writer.size_bytes
            manifest["write_seconds"] = time.perf_counter() - t0
            manifest_path = self.manifest_path_for(step)
            with self._dir_lock:
                # An older manifest of this step (a step saved again after a rollback) would
                # describe the file about to be replaced: drop it first, so no moment pairs a
                # manifest with the wrong file.
                manifest_path.unlink(missing_ok=True)
                os.replace(tmp, final)
                _fsync_directory(self.directory)
                _write_json_atomic(manifest_path, manifest)
        except Exception as e:  # never let a failed write reach the training loop
            self.last_error = f"checkpoint at step {step}: {type(e).__name__}: {e}"
            self.record_warning(f"write failed, previous checkpoints untouched: {self.last_error}")
            tmp.unlink(missing_ok=True)
            return False
        self.last_write_seconds = manifest["write_seconds"]
        self.saves_completed += 1
        return True

    # ----------------------------------------------------------------------------------------
    # Retention

    def _apply_retention(self) -> None:
        """Keep the last ``keep_last``; the newest known-good one; ``keep_known_good`` spaced
        known-good ones (the oldest known-good checkpoint of each of the newest
        ``known_good_spacing``-step buckets that have one: a choice that does not change as
        newer checkpoints arrive); and the newest known-good one before
        ``protect_before_step``. Delete the rest, manifest first, so a half-deleted checkpoint
        is never taken for verified. Caller holds _dir_lock."""
        infos = sorted(
            (i for i in self._read_manifests(record=False) if i.lineage == self.lineage),
            key=lambda i: i.step,
            reverse=True,
        )
        keep = {i.step for i in infos[: self.keep_last]}
        known_good = [i for i in infos if i.known_good]  # newest first
        if known_good:
            keep.add(known_good[0].step)
        if self.known_good_spacing > 0:
            oldest_in_bucket: dict[int, int] = {}
            for info in known_good:  # newest first: the last write per bucket is its oldest
                oldest_in_bucket[info.step // self.known_good_spacing] = info.step
            spaced = [oldest_in_bucket[b] for b in sorted(oldest_in_bucket, reverse=True)]
        else:
            spaced = [i.step for i in known_good]
        keep.update(spaced[: self.keep_known_good])
        protect = self.protect_before_step
        if protect is not None:
            older = [i for i in known_good if i.step < protect]
            if older:
                keep.add(older[0].step)
        for info in infos:
            if info.step not in keep:
                info.manifest_path.unlink(missing_ok=True)
                info.path.unlink(missing_ok=True)
        # Data files without a readable manifest can never be verified: remove them too.
        described = {i.step for i in self._read_manifests(record=False)}
        for step, path in self._data_files():
            if step not in described:
                self.manifest_path_for(step).unlink(missing_ok=True)
                path.unlink(missing_ok=True)

    def discard_after(self, step: int) -> list[int]:
        """Delete this run's checkpoints newer than ``step`` (after a rollback to ``step`` they
        belong to the abandoned future and carry the fault), and data files newer than it that
        have no readable manifest. Another run's checkpoints stay. Returns the deleted steps."""
        self.flush()
        deleted = []
        with self._dir_lock:
            infos = self._read_manifests(record=False)
            foreign = {i.step for i in infos if i.lineage != self.lineage}
            for info in infos:
                if info.step > step and info.lineage == self.lineage:
                    info.manifest_path.unlink(missing_ok=True)
                    deleted.append(info.step)
            for s, path in self._data_files():
                if s > step and s not in foreign:
                    path.unlink(missing_ok=True)
                    deleted.append(s)
        if self._last_saved_step is not None and self._last_saved_step > step:
            self._last_saved_step = None
        return sorted(set(deleted))

    # ----------------------------------------------------------------------------------------
    # Finding, verifying and loading

    def checkpoints(self) -> list[CheckpointInfo]:
        """Every checkpoint with a readable manifest, newest first (not verified)."""
        with self._dir_lock:
            infos = self._read_manifests(record=True)
        return sorted(infos, key=lambda i: i.step, reverse=True)

    def verify(self, info: CheckpointInfo) -> None:
        """Raise CheckpointCorrupt unless the file exists with the manifest's size and sha256."""
        try:
            size = info.path.stat().st_size
        except OSError as e:
            raise CheckpointCorrupt(f"{info.path.name}: file missing ({e})") from e
        if size != info.size_bytes:
            raise CheckpointCorrupt(
                f"{info.path.name}: {size} bytes, manifest says {info.size_bytes} (truncated?)"
            )
        try:
            digest = _file_sha256(info.path)
        except OSError as e:
            raise CheckpointCorrupt(f"{info.path.name}: cannot be read: {e}") from e
        if digest != info.sha256:
            raise CheckpointCorrupt(
                f"{info.path.name}: sha256 {digest[:12]}... does not match the manifest's "
                f"{info.sha256[:12]}..."
            )

    def newest_verified(
        self,
        before_step: int | None = None,
        *,
        known_good_only: bool = False,
        skipped: list[str] | None = None,
        own_run: bool = False,
    ) -> CheckpointInfo | None:
        """The newest checkpoint with ``step < before_step`` whose file matches its manifest
        (with ``own_run``: written by this run's lineage). Corrupt ones are skipped with a
        recorded warning (and appended to ``skipped``). Sees what is on disk: call ``flush``
        first to include a write still in flight."""
        for info in self._candidates(before_step, known_good_only, skipped, own_run):
            try:
                self.verify(info)
            except CheckpointCorrupt as e:
                self._skip(str(e), skipped)
                continue
            return info
        return None

    def load(self, checkpoint: CheckpointInfo | str | os.PathLike[str]) -> dict[str, Any]:
        """Verify a checkpoint's checksum, then load its payload to CPU.
        Raises CheckpointCorrupt when it cannot be trusted or read."""
        info = checkpoint if isinstance(checkpoint, CheckpointInfo) else self._info_for(checkpoint)
        self.verify(info)
        try:
            payload = torch.load(info.path, map_location="cpu", weights_only=self.weights_only)
        except Exception as e:  # a zip/pickle error after a matching checksum
            raise CheckpointCorrupt(f"{info.path.name}: cannot be loaded: {e}") from e
        if not isinstance(payload, dict) or payload.get(KEY_FORMAT) != FORMAT_VERSION:
            raise CheckpointCorrupt(f"{info.path.name}: not a mechwatch checkpoint payload")
        if payload.get(KEY_STEP) != info.step or KEY_MODEL not in payload:
            raise CheckpointCorrupt(
                f"{info.path.name}: payload step {payload.get(KEY_STEP)!r} does not match the "
                f"manifest's {info.step}"
            )
        return payload

    def load_newest(
        self,
        before_step: int | None = None,
        *,
        known_good_only: bool = False,
        skipped: list[str] | None = None,
        own_run: bool = False,
    ) -> tuple[CheckpointInfo, dict[str, Any]] | None:
        """The newest checkpoint with ``step < before_step`` (and, with ``own_run``, of this
        run's lineage) that verifies *and* loads, with its payload; corrupt ones are skipped
        (recorded warning, appended to ``skipped``)."""
        for info in self._candidates(before_step, known_good_only, skipped, own_run):
            try:
                return info, self.load(info)
            except CheckpointCorrupt as e:
                self._skip(str(e), skipped)
        return None

    def _candidates(
        self,
        before_step: int | None,
        known_good_only: bool,
        skipped: list[str] | None,
        own_run: bool = False,
    ) -> Iterator[CheckpointInfo]:
        for info in self.checkpoints():
            if before_step is not None and info.step >= before_step:
                continue
            if own_run and info.lineage != self.lineage:
                if skipped is not None:
                    skipped.append(f"{info.path.name}: written by another run ({info.lineage})")
                continue
            if known_good_only and not info.known_good:
                if skipped is not None:
                    skipped.append(f"{info.path.name}: not known-good (unhealthy at save time)")
                continue
            yield info

    def _info_for(self, path: str | os.PathLike[str]) -> CheckpointInfo:
        path = Path(path)
        m = _DATA_FILE.match(path.name)
        if m is None:
            raise CheckpointCorrupt(f"{path}: not a checkpoint file name (ckpt-<step>.pt)")
        return self._parse_manifest(path.parent / f"ckpt-{m.group(1)}.json")

    def _parse_manifest(self, manifest_path: Path) -> CheckpointInfo:
        try:
            with open(manifest_path, encoding="utf-8") as f:
                m = json.load(f)
        except FileNotFoundError as e:
            raise CheckpointCorrupt(f"{manifest_path.name}: manifest missing") from e
        except json.JSONDecodeError as e:
            raise CheckpointCorrupt(
                f"{manifest_path.name}:{e.lineno}:{e.colno}: invalid manifest JSON ({e.msg})"
            ) from e
        try:
            step = int(m["step"])
            if manifest_path.name != f"ckpt-{step}.json" or m["file"] != f"ckpt-{step}.pt":
                raise ValueError(f"step {step} does not match the file names")
            return CheckpointInfo(
                step=step,
                path=manifest_path.parent / m["file"],
                manifest_path=manifest_path,
                sha256=str(m["sha256"]),
                size_bytes=int(m["size_bytes"]),
                saved_at=float(m["saved_at"]),
                health=m.get("health"),
                known_good=m.get("known_good") is True,
                lineage=None if m.get("lineage") is None else str(m["lineage"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointCorrupt(f"{manifest_path.name}: bad manifest field: {e}") from e

    def _read_manifests(self, *, record: bool) -> list[CheckpointInfo]:
        infos = []
        for entry in os.scandir(self.directory):
            if _MANIFEST_FILE.match(entry.name):
                try:
                    infos.append(self._parse_manifest(Path(entry.path)))
                except CheckpointCorrupt as e:
                    if record:
                        self.record_warning(f"skipping checkpoint: {e}")
        return infos

    def _data_files(self) -> list[tuple[int, Path]]:
        out = []
        for entry in os.scandir(self.directory):
            m = _DATA_FILE.match(entry.name)
            if m is not None:
                out.append((int(m.group(1)), Path(entry.path)))
        return out

    def _remove_leftover_tmp_files(self) -> None:
        for entry in os.scandir(self.directory):
            if _TMP_FILE.match(entry.name):
                self.record_warning(f"removing {entry.name}: left over from an interrupted write")
                os.unlink(entry.path)

    # ----------------------------------------------------------------------------------------
    # Restoring (training thread, all or nothing)

    def restore(
        self,
        payload: dict[str, Any],
        *,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any | None = None,
        skip_batches: int = 0,
        source: str = "checkpoint",
    ) -> int:
        """Load a payload from ``load`` into the run and return its step.

        Restores model, optimizer, scheduler (the manager's own unless given), the RNG states
        and the data position (``restore_data(saved, skip_batches)``, called first). All or
        nothing: the payload is checked against the run before anything changes, and a CPU copy
        of the current state (and data position) is taken first; cost: one host copy of model
        + optimizer state and the time to make it. If loading fails midway that copy is put
        back and CheckpointRestoreError(run_unchanged=True) is raised (False when putting back
        failed too, or when there is a ``restore_data`` but no ``data_state`` hook to read the
        data position back from: halt the run then).
        """
        model = model if model is not None else self.model
        optimizer = optimizer if optimizer is not None else self.optimizer
        scheduler = scheduler if scheduler is not None else self.scheduler
        if skip_batches < 0:
            raise ValueError(f"skip_batches: expected >= 0, got {skip_batches}")
        if skip_batches > 0 and self.restore_data is None:
            raise ValueError("skip_batches: needs a restore_data hook on the CheckpointManager")
        _check_payload_fits(payload, model, optimizer, scheduler, source)
        undo = self._undo_copy(model, optimizer, scheduler)
        # Order: the user's data hook first (the likeliest to fail), the RNG states last (so
        # whatever the hook draws does not move them off the saved values).
        stage = "data"
        try:
            if self.restore_data is not None:
                self.restore_data(payload.get(KEY_DATA), skip_batches)
            elif payload.get(KEY_DATA) is not None:
                self.record_warning(f"{source}: data position saved but no restore_data hook")
            stage = "model"
            model.load_state_dict(payload[KEY_MODEL])
            stage = "optimizer"
            if optimizer is not None:
                optimizer.load_state_dict(payload[KEY_OPTIMIZER])
            stage = "scheduler"
            if scheduler is not None:
                scheduler.load_state_dict(payload[KEY_SCHEDULER])
            stage = "rng"
            for warning in restore_rng_state(payload[KEY_RNG]):
                self.record_warning(f"{source}: {warning}")
        except Exception as e:
            try:
                self._put_back(undo, model, optimizer, scheduler)
            except Exception as undo_error:
                raise CheckpointRestoreError(
                    f"{source}: loading the {stage} failed ({type(e).__name__}: {e}) and "
                    f"putting the run back failed too ({undo_error}): the run is inconsistent",
                    run_unchanged=False,
                ) from e
            if self.restore_data is not None and self.data_state is None:
                raise CheckpointRestoreError(
                    f"{source}: loading the {stage} failed ({type(e).__name__}: {e}); the "
                    "model, optimizer, scheduler and RNG were put back, the data position "
                    "could not be (no data_state hook)",
                    run_unchanged=False,
                ) from e
            raise CheckpointRestoreError(
                f"{source}: loading the {stage} failed ({type(e).__name__}: {e}); the run "
                "was put back as it was",
                run_unchanged=True,
            ) from e
        self._last_saved_step = int(payload[KEY_STEP])
        if payload.get(KEY_LINEAGE) is not None:  # the run continues that checkpoint's timeline
            self.lineage = str(payload[KEY_LINEAGE])
        return int(payload[KEY_STEP])

    def _undo_copy(
        self, model: torch.nn.Module, optimizer: Any | None, scheduler: Any | None
    ) -> dict[str, Any]:
        copier = _HostCopier(weights_only=False, pinned=None)  # synchronous, not reused
        return {
            KEY_MODEL: copier.copy(model.state_dict(), "model"),
            KEY_OPTIMIZER: None if optimizer is None else copier.copy(optimizer.state_dict(), ""),
            KEY_SCHEDULER: None if scheduler is None else copier.copy(scheduler.state_dict(), ""),
            KEY_RNG: capture_rng_state(),
            KEY_DATA: None if self.data_state is None else copier.copy(self.data_state(), ""),
        }

    def _put_back(
        self, undo: dict[str, Any], model: torch.nn.Module, optimizer: Any, scheduler: Any
    ) -> None:
        if self.data_state is not None and self.restore_data is not None:
            self.restore_data(undo[KEY_DATA], 0)
        model.load_state_dict(undo[KEY_MODEL])
        if optimizer is not None:
            optimizer.load_state_dict(undo[KEY_OPTIMIZER])
        if scheduler is not None:
            scheduler.load_state_dict(undo[KEY_SCHEDULER])
        restore_rng_state(undo[KEY_RNG])

    # ----------------------------------------------------------------------------------------

    def _report_foreign(self) -> None:
        """Warn, once, about checkpoints in the directory that another run wrote."""
        self._foreign_reported = True
        with self._dir_lock:
            foreign = sorted(
                i.step for i in self._read_manifests(record=False) if i.lineage != self.lineage
            )
        if foreign:
            self.record_warning(
                f"{len(foreign)} checkpoint(s) in {self.directory} were written by another run "
                f"(steps {foreign[:10]}{' ...' if len(foreign) > 10 else ''}): they are never "
                "rolled back to and never deleted by this run, except that a save at the same "
                "step replaces that file; use a new directory per run, or restore one of them to "
                "continue that run"
            )

    def record_warning(self, message: str) -> None:
        """Log a warning and keep it in ``warnings``."""
        self.warnings.append(message)
        _log.warning("mechwatch checkpoints (%s): %s", self.directory, message)

    def _skip(self, reason: str, skipped: list[str] | None) -> None:
        self.record_warning(f"skipping checkpoint: {reason}")
        if skipped is not None:
            skipped.append(reason)


def _check_payload_fits(
    payload: dict[str, Any],
    model: torch.nn.Module,
    optimizer: Any | None,
    scheduler: Any | None,
    source: str,
) -> None:
    """ValueError unless the payload's model/optimizer/scheduler state fit the run."""
    saved = payload[KEY_MODEL]
    current = model.state_dict()
    missing = sorted(set(current) - set(saved))
    unexpected = sorted(set(saved) - set(current))
    wrong_shape = [
        f"{k} {tuple(saved[k].shape)} vs {tuple(current[k].shape)}"
        for k in current
        if k in saved and isinstance(saved[k], torch.Tensor) and saved[k].shape != current[k].shape
    ]
    if missing or unexpected or wrong_shape:
        raise ValueError(
            f"{source} does not fit the model: missing {missing[:5]}, unexpected "
            f"{unexpected[:5]}, shape mismatch {wrong_shape[:5]}"
        )
    if optimizer is not None:
        saved_opt = payload.get(KEY_OPTIMIZER)
        if saved_opt is None:
            raise ValueError(f"{source} holds no optimizer state but the run has an optimizer")
        saved_sizes = [len(g["params"]) for g in saved_opt["param_groups"]]
        sizes = [len(g["params"]) for g in optimizer.param_groups]
        if saved_sizes != sizes:
            raise ValueError(
                f"{source} does not fit the optimizer: parameter groups of sizes "
                f"{saved_sizes}, the optimizer has {sizes}"
            )
    if scheduler is not None and payload.get(KEY_SCHEDULER) is None:
        raise ValueError(f"{source} holds no scheduler state but the run has a scheduler")
    if KEY_RNG not in payload:
        raise ValueError(f"{source} holds no RNG state")


def _flush_at_exit(ref: weakref.ref[CheckpointManager]) -> None:
    manager = ref()
    if manager is not None:
        manager.flush(timeout_s=manager.busy_wait_s)
