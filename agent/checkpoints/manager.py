"""``CheckpointManager``: saves a run's checkpoints off the training thread and finds,
verifies, loads and restores them (the package docstring has the whole picture).

On the training thread ``save`` only copies the state to host memory; a background thread
publishes it (``writer.py``) and applies retention (``retention.py``). A failed write never
raises into the training loop, nor from ``flush``/``close``: it leaves no temp file, never
counts as a checkpoint, never lets retention delete an older one, and its cause is warned and
reported once (``failures.py``).
"""

from __future__ import annotations

import atexit
import collections
import logging
import os
import threading
import time
import uuid
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import torch

from agent.checkpoints import format as fmt
from agent.checkpoints import retention
from agent.checkpoints.failures import SaveFailures
from agent.checkpoints.format import CheckpointInfo
from agent.checkpoints.host_copy import HostCopier, capture_payload, copy_done_events
from agent.checkpoints.restore import restore_payload
from agent.checkpoints.verify import load_payload, newest_trusted, verify_file
from agent.checkpoints.writer import SaveJob, publish

_log = logging.getLogger(__name__)

# Defaults, defined once (the agent's configuration refers to these).
DEFAULT_EVERY = 250  # optimizer steps between checkpoints
DEFAULT_KEEP_LAST = 3  # newest checkpoints kept
DEFAULT_KEEP_KNOWN_GOOD = 2  # spaced known-good checkpoints kept in addition
_MAX_RECORDED_WARNINGS = 200


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
        report: ``report("checkpoint", message)`` receives, from the writer thread, each
            distinct cause of failed saves once and the recovery after them (the agent passes
            its event log).
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any | None = None,
        every_n_steps: int = DEFAULT_EVERY,
        keep_last: int = DEFAULT_KEEP_LAST,
        keep_known_good: int = DEFAULT_KEEP_KNOWN_GOOD,
        known_good_spacing: int | None = None,
        agent_state: Callable[[], dict[str, Any]] | None = None,
        data_state: Callable[[], Any] | None = None,
        restore_data: Callable[[Any, int], None] | None = None,
        weights_only: bool = True,
        on_busy: Literal["wait", "skip"] = "wait",
        busy_wait_s: float = 60.0,
        pin_memory: bool = True,
        report: Callable[[str, str], None] | None = None,
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
        self.saves_failed = 0
        self.saves_skipped = 0
        self._failures = SaveFailures(self.directory, warn=self.record_warning, report=report)
        self._pinned: dict[str, torch.Tensor] = {}
        self._job: SaveJob | None = None
        self._thread: threading.Thread | None = None
        self._dir_lock = threading.Lock()  # the writer's publish/retention vs. scans
        self._last_saved_step: int | None = None
        self._closed = False
        self.lineage = uuid.uuid4().hex[:16]  # this run's id in manifests and payloads
        self._foreign_reported = False
        for path in fmt.tmp_files(self.directory):
            self.record_warning(f"removing {path.name}: left over from an interrupted write")
            path.unlink(missing_ok=True)
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
        health_json = fmt.validate_health(health)
        if not self._wait_for_writer(step):
            return False
        if not self._foreign_reported:
            self._foreign_reported = True
            with self._dir_lock:
                warning = retention.foreign_warning(self.directory, self.lineage)
            if warning is not None:
                self.record_warning(warning)
        t0 = time.perf_counter()
        copier = HostCopier(
            weights_only=self.weights_only, pinned=self._pinned if self.pin_memory else None
        )
        payload = capture_payload(
            step,
            copier,
            model=self.model,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            agent_state=self.agent_state,
            data_state=self.data_state,
            lineage=self.lineage,
        )
        events = copy_done_events(copier.devices)
        capture_seconds = time.perf_counter() - t0
        manifest = fmt.new_manifest(
            step,
            saved_at=time.time(),
            capture_seconds=capture_seconds,
            health=health_json,
            lineage=self.lineage,
            torch_version=torch.__version__,
        )
        job = SaveJob(step=step, payload=payload, manifest=manifest, cuda_events=events)
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
        """Wait for the pending write; returns False if it was still running at the timeout.
        A failed write does not raise here (see ``last_error``)."""
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
        return fmt.data_path(self.directory, step)

    def manifest_path_for(self, step: int) -> Path:
        return fmt.manifest_path(self.directory, step)

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

    def _write(self, job: SaveJob) -> None:
        """Writer thread: publish the checkpoint, then apply retention. Never raises. A failed
        write is recorded (``SaveFailures``) and runs no retention."""
        try:
            try:
                manifest = publish(job, self.directory, self._dir_lock)
            except Exception as e:  # never let a failed write reach the training loop
                self.saves_failed += 1
                self.last_error = self._failures.failed(job.step, e)
                return
            self.last_write_seconds = manifest["write_seconds"]
            self.saves_completed += 1
            self._failures.succeeded(job.step)
            try:
                with self._dir_lock:
                    retention.apply_retention(
                        self.directory,
                        self.lineage,
                        keep_last=self.keep_last,
                        keep_known_good=self.keep_known_good,
                        known_good_spacing=self.known_good_spacing,
                        protect_before_step=self.protect_before_step,
                    )
            except Exception as e:  # the new checkpoint is complete; old ones stay longer
                self.record_warning(
                    f"retention after step {job.step} failed: {type(e).__name__}: {e}"
                )
        finally:
            job.payload = None
            job.done.set()

    def discard_after(self, step: int) -> list[int]:
        """Delete this run's checkpoints newer than ``step`` (after a rollback to ``step`` they
        belong to the abandoned future and carry the fault), and data files newer than it that
        have no readable manifest. Another run's checkpoints stay. Returns the deleted steps."""
        self.flush()
        with self._dir_lock:
            deleted = retention.discard_after(self.directory, self.lineage, step)
        if self._last_saved_step is not None and self._last_saved_step > step:
            self._last_saved_step = None
        return deleted

    # ----------------------------------------------------------------------------------------
    # Finding, verifying and loading

    def checkpoints(self) -> list[CheckpointInfo]:
        """Every checkpoint with a readable manifest, newest first (not verified)."""
        with self._dir_lock:
            infos = fmt.read_manifests(
                self.directory, lambda e: self.record_warning(f"skipping checkpoint: {e}")
            )
        return sorted(infos, key=lambda i: i.step, reverse=True)

    def verify(self, info: CheckpointInfo) -> None:
        """Raise CheckpointCorrupt unless the file exists with the manifest's size and sha256."""
        verify_file(info)

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
        found = self._newest(verify_file, before_step, known_good_only, skipped, own_run)
        return None if found is None else found[0]

    def load(self, checkpoint: CheckpointInfo | str | os.PathLike[str]) -> dict[str, Any]:
        """Verify a checkpoint's checksum, then load its payload to CPU.
        Raises CheckpointCorrupt when it cannot be trusted, read, or holds another step."""
        if not isinstance(checkpoint, CheckpointInfo):
            checkpoint = fmt.info_for_data_file(checkpoint)
        return load_payload(checkpoint, weights_only=self.weights_only)

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
        return self._newest(self.load, before_step, known_good_only, skipped, own_run)

    def _newest(
        self,
        check: Callable[[CheckpointInfo], Any],
        before_step: int | None,
        known_good_only: bool,
        skipped: list[str] | None,
        own_run: bool,
    ) -> tuple[CheckpointInfo, Any] | None:
        return newest_trusted(
            self.checkpoints(),
            check,
            before_step=before_step,
            known_good_only=known_good_only,
            lineage=self.lineage if own_run else None,
            skipped=skipped,
            warn=self.record_warning,
        )

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
        nothing, see ``restore.py``: CheckpointRestoreError(run_unchanged=True) when the run
        was put back as it was, False when it may be inconsistent (halt the run then). The
        run adopts the payload's lineage: it continues that checkpoint's timeline.
        """
        if skip_batches < 0:
            raise ValueError(f"skip_batches: expected >= 0, got {skip_batches}")
        if skip_batches > 0 and self.restore_data is None:
            raise ValueError("skip_batches: needs a restore_data hook on the CheckpointManager")
        step = restore_payload(
            payload,
            model=model if model is not None else self.model,
            optimizer=optimizer if optimizer is not None else self.optimizer,
            scheduler=scheduler if scheduler is not None else self.scheduler,
            data_state=self.data_state,
            restore_data=self.restore_data,
            skip_batches=skip_batches,
            source=source,
            warn=self.record_warning,
        )
        self._last_saved_step = step
        if payload.get(fmt.KEY_LINEAGE) is not None:
            self.lineage = str(payload[fmt.KEY_LINEAGE])
        return step

    def record_warning(self, message: str) -> None:
        """Log a warning and keep it in ``warnings``."""
        self.warnings.append(message)
        _log.warning("mechwatch checkpoints (%s): %s", self.directory, message)


def _flush_at_exit(ref: weakref.ref[CheckpointManager]) -> None:
    manager = ref()
    if manager is not None:
        manager.flush(timeout_s=manager.busy_wait_s)
