"""The on-disk format of a checkpoint directory, defined once.

One checkpoint is two files in the directory:

- ``ckpt-<step>.pt``: a ``torch.save`` of a dict with the ``KEY_*`` keys below (payload
  format ``FORMAT_VERSION``);
- ``ckpt-<step>.json``: its manifest, written after the data file is complete, with the file
  name, sha256, size, capture time, the monitors' health at save time, ``known_good`` and the
  writer's lineage.

Both are written as ``<name>.tmp`` and renamed into place (see ``atomic.py``). A data file
without a readable manifest is never trusted; a ``*.tmp`` file is a write that did not finish.
Parsing a manifest checks that its step, its own name and the data file it names agree.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.checkpoints.atomic import write_bytes_atomic

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

DATA_FILE = re.compile(r"^ckpt-(\d+)\.pt$")
MANIFEST_FILE = re.compile(r"^ckpt-(\d+)\.json$")
TMP_FILE = re.compile(r"^ckpt-\d+\.(pt|json)\.tmp$")


class CheckpointCorrupt(Exception):
    """A checkpoint whose manifest, checksum or contents cannot be trusted."""


class CheckpointRestoreError(RuntimeError):
    """Loading a checkpoint into the run failed. ``run_unchanged`` says whether the run was put
    back exactly as it was before the attempt (False: the run may be inconsistent; halt it)."""

    def __init__(self, message: str, *, run_unchanged: bool) -> None:
        super().__init__(message)
        self.run_unchanged = run_unchanged

    @property
    def escalate(self) -> bool:
        """A run left inconsistent must not go on: pacing escalates (page and halt)."""
        return not self.run_unchanged


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


def data_path(directory: Path, step: int) -> Path:
    return directory / f"ckpt-{step}.pt"


def manifest_path(directory: Path, step: int) -> Path:
    return directory / f"ckpt-{step}.json"


def new_manifest(
    step: int,
    *,
    saved_at: float,
    capture_seconds: float,
    health: dict[str, Any] | None,
    lineage: str,
    torch_version: str,
) -> dict[str, Any]:
    """A manifest without the fields only the writer knows (sha256, size_bytes,
    write_seconds). Known-good when ``health["healthy"] is True``."""
    return {
        "format": FORMAT_VERSION,
        "step": step,
        "file": f"ckpt-{step}.pt",
        "saved_at": saved_at,
        "capture_seconds": capture_seconds,
        "health": health,
        "known_good": health is not None and health.get("healthy") is True,
        "lineage": lineage,
        "torch": torch_version,
    }


def write_manifest(path: Path, manifest: dict[str, Any]) -> None:
    """Write a manifest atomically (tmp, fsync, rename, fsync the directory)."""
    write_bytes_atomic(path, json.dumps(manifest, indent=1, sort_keys=True).encode("utf-8"))


def validate_health(health: dict[str, Any] | None) -> dict[str, Any] | None:
    """The health given to ``save`` as plain JSON values; ValueError unless it is a
    JSON-serializable dict with a bool ``healthy`` entry (or None: unknown)."""
    if health is None:
        return None
    if not isinstance(health, dict) or not isinstance(health.get("healthy"), bool):
        raise ValueError(f"health: expected a dict with a bool 'healthy' entry, got {health!r}")
    try:
        return json.loads(json.dumps(health))
    except (TypeError, ValueError) as e:
        raise ValueError(f"health: not JSON-serializable ({e})") from e


def parse_manifest(path: Path) -> CheckpointInfo:
    """Read one manifest; CheckpointCorrupt (located ``name:line:col`` for bad JSON) unless it
    is complete and its step matches both file names."""
    try:
        with open(path, encoding="utf-8") as f:
            m = json.load(f)
    except FileNotFoundError as e:
        raise CheckpointCorrupt(f"{path.name}: manifest missing") from e
    except json.JSONDecodeError as e:
        raise CheckpointCorrupt(
            f"{path.name}:{e.lineno}:{e.colno}: invalid manifest JSON ({e.msg})"
        ) from e
    try:
        step = int(m["step"])
        if path.name != f"ckpt-{step}.json" or m["file"] != f"ckpt-{step}.pt":
            raise ValueError(f"step {step} does not match the file names")
        return CheckpointInfo(
            step=step,
            path=path.parent / m["file"],
            manifest_path=path,
            sha256=str(m["sha256"]),
            size_bytes=int(m["size_bytes"]),
            saved_at=float(m["saved_at"]),
            health=m.get("health"),
            known_good=m.get("known_good") is True,
            lineage=None if m.get("lineage") is None else str(m["lineage"]),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointCorrupt(f"{path.name}: bad manifest field: {e}") from e


def info_for_data_file(path: str | os.PathLike[str]) -> CheckpointInfo:
    """The manifest of a data file ``<dir>/ckpt-<step>.pt``."""
    path = Path(path)
    m = DATA_FILE.match(path.name)
    if m is None:
        raise CheckpointCorrupt(f"{path}: not a checkpoint file name (ckpt-<step>.pt)")
    return parse_manifest(path.parent / f"ckpt-{m.group(1)}.json")


def read_manifests(
    directory: Path, on_corrupt: Callable[[CheckpointCorrupt], None] | None = None
) -> list[CheckpointInfo]:
    """Every readable manifest in the directory, in no order; unreadable ones go to
    ``on_corrupt`` (or are ignored)."""
    infos = []
    for entry in os.scandir(directory):
        if MANIFEST_FILE.match(entry.name):
            try:
                infos.append(parse_manifest(Path(entry.path)))
            except CheckpointCorrupt as e:
                if on_corrupt is not None:
                    on_corrupt(e)
    return infos


def data_files(directory: Path) -> list[tuple[int, Path]]:
    """(step, path) of every data file in the directory, with or without a manifest."""
    out = []
    for entry in os.scandir(directory):
        m = DATA_FILE.match(entry.name)
        if m is not None:
            out.append((int(m.group(1)), Path(entry.path)))
    return out


def tmp_files(directory: Path) -> list[Path]:
    """Leftovers of writes that did not finish."""
    return [Path(e.path) for e in os.scandir(directory) if TMP_FILE.match(e.name)]
