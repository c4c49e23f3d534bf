"""``DistributedCheckpointStore``: rollback checkpoints of a distributed job, written with
torch.distributed.checkpoint (DCP), committed atomically and verified by checksum. It is a
``CheckpointStore`` (``agent.checkpoints.store``): the rollback action uses it as it uses
``CheckpointManager`` in one process.

In ``directory``, which every rank reads and writes (a shared file system, as DCP's
``FileSystemWriter`` needs)::

    ckpt-<step>.dcp.tmp/   a save in progress: DCP's shards and .metadata, one rank-<r>.pt each
    ckpt-<step>.dcp/       a committed checkpoint's files
    ckpt-<step>.dcp.json   its manifest (files, sha256, sizes, health, lineage): the commit

Save (every rank, training thread, the same step): each rank writes ``rank-<r>.pt`` (its RNG
states, its data position, the scheduler and the agent state); ``dcp.save`` writes the model
and optimizer state (``get_state_dict``: DDP's replicas once, FSDP2's shards by their owners);
each rank hashes the files it wrote and the tables are gathered; rank 0 checks that every
rank's file and every file DCP's metadata names are there with those sizes, renames the temp
directory and writes the manifest (atomically): only then does the checkpoint count. Rank 0
then applies retention (``retention.retained_steps``: keep_last, spaced known-good ones,
``protect_before_step``) and broadcasts the outcome, so every rank records the same. A rank
that dies during a save leaves a temp directory (or a directory without a manifest) that is
never read, and is removed when a store starts in that directory.

Find and restore (every rank, the same step, in the rollback action): rank 0's list of
manifests is broadcast; each rank checks its share of the files (sha256 and size; file i is
checked by rank i % world) and loads its own rank file; the verdicts are gathered, so every
rank accepts or skips the same checkpoint. ``restore`` puts back the data position
(``restore_data``), loads the model and optimizer (``dcp.load`` + ``set_state_dict``), the
scheduler and the RNG states; the outcomes are gathered, and a restore that failed on any
rank raises ``CheckpointRestoreError(run_unchanged=False)`` on every rank (the agent pages and
halts). Saves are synchronous: the training thread waits for the write.
"""

from __future__ import annotations

import functools
import io
import json
import logging
import shutil
import time
import uuid
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from agent.checkpoints import format as fmt
from agent.checkpoints.atomic import file_sha256, fsync_directory, write_bytes_atomic
from agent.checkpoints.format import CheckpointCorrupt, CheckpointInfo, CheckpointRestoreError
from agent.checkpoints.retention import retained_steps
from agent.checkpoints.rng import capture_rng_state, restore_rng_state
from agent.distributed import checkpoint_format as layout
from agent.distributed.checkpoint_format import rank_file
from agent.distributed.world import World

_log = logging.getLogger(__name__)


class DistributedCheckpointStore:
    """See the module docstring. Arguments as ``CheckpointManager``'s, plus ``world``."""

    def __init__(
        self,
        directory: str | Path,
        *,
        world: World,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any | None = None,
        every_n_steps: int = 250,
        keep_last: int = 3,
        keep_known_good: int = 2,
        known_good_spacing: int | None = None,
        agent_state: Callable[[], dict[str, Any]] | None = None,
        data_state: Callable[[], Any] | None = None,
        restore_data: Callable[[Any, int], None] | None = None,
        report: Callable[[str, str], None] | None = None,
    ) -> None:
        if data_state is not None and restore_data is None:
            raise ValueError("data_state: given without restore_data, nothing could restore it")
        self.directory = Path(directory)
        self.world = world
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.every_n_steps = every_n_steps
        self.keep_last, self.keep_known_good = keep_last, keep_known_good
        self.known_good_spacing = (
            keep_last * every_n_steps if known_good_spacing is None else known_good_spacing
        )
        self.agent_state, self.data_state, self.restore_data = agent_state, data_state, restore_data
        self.report = report
        self.protect_before_step: int | None = None
        self.warnings: deque[str] = deque(maxlen=200)
        self.saves_completed = self.saves_failed = 0
        self.last_error: str | None = None
        self._last_saved_step: int | None = None
        if world.rank == 0:
            self.directory.mkdir(parents=True, exist_ok=True)
            for path in layout.unreadable(self.directory):
                self.record_warning(f"removing {path.name}: left over from an unfinished save")
                shutil.rmtree(path, ignore_errors=True)
        self.lineage = world.broadcast_object(uuid.uuid4().hex[:16])

    # -- saving (every rank, the same step) ---------------------------------------------------
    def maybe_save(self, step: int, *, health: dict[str, Any] | None = None) -> bool:
        if step % self.every_n_steps != 0 or step == self._last_saved_step:
            return False
        return self.save(step, health=health)

    def save(self, step: int, *, health: dict[str, Any] | None = None) -> bool:
        """Write and commit the checkpoint of the state after ``step``; True when committed
        (the same answer on every rank)."""
        health = fmt.validate_health(health)
        t0 = time.perf_counter()
        tmp = layout.temp_dir(self.directory, step)
        error = _attempt(lambda: self._write_rank_file(tmp, step))
        errors = self.world.gather_objects(error)
        if any(errors):
            return self._failed(step, _first(errors))
        try:
            dcp.save(self._state(), checkpoint_id=tmp, process_group=self.world.group)
        except Exception as exc:  # DCP gathers the ranks' errors: it fails on every rank
            self._cleanup(tmp)
            return self._failed(step, f"dcp.save: {type(exc).__name__}: {exc}")
        table = self._hash_own(tmp)
        tables = self.world.gather_objects(table)
        outcome = None
        if self.world.rank == 0:
            outcome = _attempt(lambda: self._commit(step, tmp, tables, health, t0))
        outcome = self.world.broadcast_object(outcome)
        if outcome is not None:
            return self._failed(step, outcome)
        self.saves_completed += 1
        self._last_saved_step = step
        return True

    def _write_rank_file(self, tmp: Path, step: int) -> None:
        tmp.mkdir(parents=True, exist_ok=True)
        payload = {
            fmt.KEY_FORMAT: fmt.FORMAT_VERSION,
            fmt.KEY_STEP: step,
            fmt.KEY_LINEAGE: self.lineage,
            fmt.KEY_RNG: capture_rng_state(),
            fmt.KEY_DATA: self.data_state() if self.data_state is not None else None,
            fmt.KEY_SCHEDULER: self.scheduler.state_dict() if self.scheduler else None,
            fmt.KEY_AGENT: self.agent_state() if self.agent_state is not None else None,
            "world": self.world.size,
        }
        buffer = io.BytesIO()
        torch.save(payload, buffer)
        write_bytes_atomic(tmp / rank_file(self.world.rank), buffer.getvalue())

    def _hash_own(self, tmp: Path) -> dict[str, Any] | str:
        """{file: [sha256, size]} of the files this rank wrote, or what went wrong."""

        def table() -> dict[str, Any]:
            mine = [rank_file(self.world.rank)]
            mine += [p.name for p in tmp.glob(f"__{self.world.rank}_*")]
            if self.world.rank == 0:
                mine.append(".metadata")
            return {n: [file_sha256(tmp / n), (tmp / n).stat().st_size] for n in mine}

        try:
            return table()
        except Exception as exc:
            return f"rank {self.world.rank}: hashing failed: {type(exc).__name__}: {exc}"

    def _commit(self, step: int, tmp: Path, tables: list, health: dict | None, t0: float) -> None:
        """Rank 0: check that the save is complete, then publish it (see the docstring)."""
        bad = [t for t in tables if isinstance(t, str)]
        if bad:
            raise RuntimeError("; ".join(bad))
        files: dict[str, list] = {}
        for table in tables:
            files.update(table)
        missing = [rank_file(r) for r in range(self.world.size) if rank_file(r) not in files]
        missing += [name for name in layout.dcp_files(tmp) if name not in files]
        for path in tmp.iterdir():  # files no rank claimed (another naming): hash them here
            if path.name not in files and not path.name.endswith(".tmp"):
                files[path.name] = [file_sha256(path), path.stat().st_size]
        missing += [n for n, (_, size) in files.items() if (tmp / n).stat().st_size != size]
        if missing:
            raise RuntimeError(f"incomplete save, missing or changed: {sorted(missing)[:5]}")
        final = layout.committed_dir(self.directory, step)
        if final.exists():
            layout.manifest_path(self.directory, step).unlink(missing_ok=True)
            shutil.rmtree(final)
        fsync_directory(tmp)
        tmp.rename(final)
        fsync_directory(self.directory)
        files = dict(sorted(files.items()))
        manifest = {
            "format": fmt.FORMAT_VERSION,
            "kind": layout.KIND,
            "step": step,
            "dir": final.name,
            "files": files,
            "sha256": layout.digest(files),
            "size_bytes": sum(size for _, size in files.values()),
            "saved_at": time.time(),
            "write_seconds": time.perf_counter() - t0,
            "health": health,
            "known_good": health is not None and health.get("healthy") is True,
            "lineage": self.lineage,
            "world": self.world.size,
            "torch": torch.__version__,
        }
        data = json.dumps(manifest, indent=1, sort_keys=True).encode("utf-8")
        write_bytes_atomic(layout.manifest_path(self.directory, step), data)
        try:
            self._retention()
        except Exception as exc:  # the new checkpoint is committed; old ones stay longer
            self.record_warning(f"retention after step {step} failed: {exc}")

    def _retention(self) -> None:
        own = [info for info, _ in self._read() if info.lineage == self.lineage]
        keep = retained_steps(
            own,
            keep_last=self.keep_last,
            keep_known_good=self.keep_known_good,
            known_good_spacing=self.known_good_spacing,
            protect_before_step=self.protect_before_step,
        )
        for info in own:
            if info.step not in keep:
                layout.delete(info)
        for path in layout.unreadable(self.directory, temp=False):
            shutil.rmtree(path, ignore_errors=True)

    def _failed(self, step: int, error: str) -> bool:
        self.saves_failed += 1
        self.last_error = f"checkpoint at step {step} not saved: {error}"
        self.record_warning(self.last_error)
        if self.report is not None:
            self.report("checkpoint", self.last_error)
        return False

    def _cleanup(self, tmp: Path) -> None:
        self.world.barrier()
        if self.world.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)

    def _state(self) -> dict[str, Any]:
        optimizers = [self.optimizer] if self.optimizer is not None else []
        model, optim = get_state_dict(self.model, optimizers)
        return {"model": model, "optimizer": optim} if optimizers else {"model": model}

    # -- finding and verifying (every rank, the same step) ------------------------------------
    def checkpoints(self) -> list[CheckpointInfo]:
        """Every checkpoint with a readable manifest, newest first (not verified)."""
        return [info for info, _ in self._read()]

    def _read(self) -> list[tuple[CheckpointInfo, dict[str, Any]]]:
        out = []
        for entry in self.directory.iterdir():
            if layout.MANIFEST.match(entry.name):
                try:
                    out.append(layout.read_manifest(entry))
                except CheckpointCorrupt as exc:
                    self.record_warning(f"skipping checkpoint: {exc}")
        return sorted(out, key=lambda pair: pair[0].step, reverse=True)

    def newest_verified(
        self,
        before_step: int | None = None,
        *,
        known_good_only: bool = False,
        skipped: list[str] | None = None,
        own_run: bool = False,
    ) -> CheckpointInfo | None:
        found = self._newest(before_step, known_good_only, skipped, own_run, load=False)
        return None if found is None else found[0]

    def load_newest(
        self,
        before_step: int | None = None,
        *,
        known_good_only: bool = False,
        skipped: list[str] | None = None,
        own_run: bool = False,
    ) -> tuple[CheckpointInfo, dict[str, Any]] | None:
        return self._newest(before_step, known_good_only, skipped, own_run, load=True)

    def _newest(self, before_step, known_good_only, skipped, own_run, *, load: bool):
        """The newest checkpoint every rank accepts, with this rank's rank file (``load``).
        Every rank walks rank 0's list of manifests, so they all check the same ones."""
        listed = None
        if self.world.rank == 0:
            listed = [(info.manifest_path.name, manifest) for info, manifest in self._read()]
        for name, manifest in self.world.broadcast_object(listed):
            info = layout.info_of(self.directory / name, manifest)
            if before_step is not None and info.step >= before_step:
                continue
            if own_run and info.lineage != self.lineage:
                reason = f"{info.path.name}: written by another run ({info.lineage})"
            elif known_good_only and not info.known_good:
                reason = f"{info.path.name}: not known-good (unhealthy at save time)"
            else:
                payload, error = _attempt_value(
                    functools.partial(self._check, info, manifest, load)
                )
                reason = _first(self.world.gather_objects(error))
                if reason is None:
                    return info, payload
                self.record_warning(f"skipping checkpoint: {reason}")
            if skipped is not None:
                skipped.append(reason)
        return None

    def _check(self, info: CheckpointInfo, manifest: dict, load: bool) -> dict[str, Any] | None:
        """This rank's share of the checks (CheckpointCorrupt on a failure)."""
        files = manifest["files"]
        mine = rank_file(self.world.rank)
        if manifest.get("world") != self.world.size or mine not in files:
            raise CheckpointCorrupt(
                f"{info.path.name}: saved by {manifest.get('world')} ranks, this job has "
                f"{self.world.size}"
            )
        for i, (name, (sha256, size)) in enumerate(sorted(files.items())):
            if i % self.world.size == self.world.rank or name == mine:
                layout.verify_file(info.path / name, sha256, size)
        if not load:
            return None
        payload = torch.load(info.path / mine, map_location="cpu", weights_only=False)
        if payload.get(fmt.KEY_STEP) != info.step:
            raise CheckpointCorrupt(f"{info.path.name}/{mine}: holds another step")
        return {**payload, "path": str(info.path)}

    # -- restoring (every rank, the same step) ------------------------------------------------
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
        """Restore every rank from ``payload`` (``load_newest``'s); all ranks or none."""
        if model is not None and model is not self.model:
            raise ValueError("restore: this store restores the model it was created with")
        scheduler = scheduler if scheduler is not None else self.scheduler
        error = _attempt(lambda: self._restore_data(payload, skip_batches))
        if _first(self.world.gather_objects(error)) is not None:
            raise _restore_error(source, self.world.gather_objects(error))
        state = self._state()
        try:
            dcp.load(state, checkpoint_id=payload["path"], process_group=self.world.group)
        except Exception as exc:
            raise CheckpointRestoreError(
                f"{source}: dcp.load failed ({type(exc).__name__}: {exc}): the run may be "
                "inconsistent",
                run_unchanged=False,
            ) from exc
        error = _attempt(lambda: self._load_local(state, payload, scheduler, source))
        errors = self.world.gather_objects(error)
        if _first(errors) is not None:
            raise _restore_error(source, errors)
        self._last_saved_step = int(payload[fmt.KEY_STEP])
        self.lineage = str(payload.get(fmt.KEY_LINEAGE) or self.lineage)
        return int(payload[fmt.KEY_STEP])

    def _restore_data(self, payload: dict[str, Any], skip_batches: int) -> None:
        if self.restore_data is not None:
            self.restore_data(payload.get(fmt.KEY_DATA), skip_batches)
        elif skip_batches:
            raise ValueError("skip_batches: needs a restore_data hook")

    def _load_local(self, state: dict, payload: dict, scheduler: Any, source: str) -> None:
        optimizers = [self.optimizer] if self.optimizer is not None else []
        set_state_dict(
            self.model,
            optimizers,
            model_state_dict=state["model"],
            optim_state_dict=state.get("optimizer", {}),
        )
        if scheduler is not None:
            scheduler.load_state_dict(payload[fmt.KEY_SCHEDULER])
        for warning in restore_rng_state(payload[fmt.KEY_RNG]):
            self.record_warning(f"{source}: {warning}")

    def discard_after(self, step: int) -> list[int]:
        """Delete this run's checkpoints newer than ``step`` (rank 0; every rank returns the
        same list)."""
        deleted = None
        if self.world.rank == 0:
            deleted = []
            for info, _ in self._read():
                if info.step > step and info.lineage == self.lineage:
                    layout.delete(info)
                    deleted.append(info.step)
        deleted = self.world.broadcast_object(deleted)
        if self._last_saved_step is not None and self._last_saved_step > step:
            self._last_saved_step = None
        return sorted(deleted)

    # -- the rest of CheckpointStore --------------------------------------------------------
    @property
    def pending(self) -> bool:
        return False  # saves are synchronous

    def flush(self, timeout_s: float | None = None) -> bool:
        return True

    def close(self, timeout_s: float | None = None) -> None:
        pass

    def record_warning(self, message: str) -> None:
        self.warnings.append(message)
        _log.warning("mechwatch checkpoints (%s): %s", self.directory, message)


def _attempt(fn: Callable[[], Any]) -> str | None:
    """None when ``fn`` ran, else its error as text."""
    try:
        fn()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def _attempt_value(fn: Callable[[], Any]) -> tuple[Any, str | None]:
    try:
        return fn(), None
    except Exception as exc:
        return None, str(exc) if isinstance(exc, CheckpointCorrupt) else f"{exc!r}"


def _first(errors: list[str | None]) -> str | None:
    found = [(rank, e) for rank, e in enumerate(errors) if e is not None]
    return None if not found else "; ".join(f"rank {r}: {e}" for r, e in found[:3])


def _restore_error(source: str, errors: list[str | None]) -> CheckpointRestoreError:
    return CheckpointRestoreError(
        f"{source}: restore failed ({_first(errors)}); the ranks may disagree: halting",
        run_unchanged=False,
    )
