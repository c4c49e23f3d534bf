"""The on-disk format of ``DistributedCheckpointStore``'s checkpoints, defined once.

``ckpt-<step>.dcp.tmp/`` (a save in progress), ``ckpt-<step>.dcp/`` (a committed checkpoint's
files: DCP's ``.metadata`` and shards, one ``rank-<r>.pt`` per rank) and its manifest
``ckpt-<step>.dcp.json``: the step, the directory, ``files`` ({name: [sha256, size]}), the
table's own sha256, the health at save time, ``known_good``, the lineage and the world size.
A directory without a readable manifest is never trusted; the manifest is written last.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp

from agent.checkpoints.atomic import file_sha256
from agent.checkpoints.format import CheckpointCorrupt, CheckpointInfo

MANIFEST = re.compile(r"^ckpt-(\d+)\.dcp\.json$")
COMMITTED = re.compile(r"^ckpt-(\d+)\.dcp$")
TEMP = re.compile(r"^ckpt-(\d+)\.dcp\.tmp$")
KIND = "dcp"


def rank_file(rank: int) -> str:
    """The file of one rank's own state (RNG, data position, scheduler, agent)."""
    return f"rank-{rank}.pt"


def temp_dir(directory: Path, step: int) -> Path:
    return directory / f"ckpt-{step}.dcp.tmp"


def committed_dir(directory: Path, step: int) -> Path:
    return directory / f"ckpt-{step}.dcp"


def manifest_path(directory: Path, step: int) -> Path:
    return directory / f"ckpt-{step}.dcp.json"


def read_manifest(path: Path) -> tuple[CheckpointInfo, dict[str, Any]]:
    """One manifest file; CheckpointCorrupt unless it is complete (``info_of``)."""
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointCorrupt(f"{path.name}: unreadable manifest: {exc}") from exc
    return info_of(path, manifest), manifest


def info_of(path: Path, manifest: dict[str, Any]) -> CheckpointInfo:
    """The ``CheckpointInfo`` of a parsed manifest at ``path``; CheckpointCorrupt unless its
    step matches both names and its file table matches its sha256."""
    try:
        step = int(manifest["step"])
        if path.name != f"ckpt-{step}.dcp.json" or manifest["dir"] != f"ckpt-{step}.dcp":
            raise ValueError(f"step {step} does not match the names")
        if manifest.get("kind") != KIND or digest(manifest["files"]) != manifest["sha256"]:
            raise ValueError("not a DCP manifest, or its file table does not match its sha256")
        return CheckpointInfo(
            step=step,
            path=path.parent / manifest["dir"],
            manifest_path=path,
            sha256=str(manifest["sha256"]),
            size_bytes=int(manifest["size_bytes"]),
            saved_at=float(manifest["saved_at"]),
            health=manifest.get("health"),
            known_good=manifest.get("known_good") is True,
            lineage=manifest.get("lineage"),
        )
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CheckpointCorrupt(f"{path.name}: bad manifest: {exc}") from exc


def digest(files: dict[str, Any]) -> str:
    """sha256 of a file table (names, sha256s and sizes)."""
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()


def verify_file(path: Path, sha256: str, size: int) -> None:
    """CheckpointCorrupt unless ``path`` has ``size`` bytes and that sha256."""
    name = f"{path.parent.name}/{path.name}"
    try:
        actual = path.stat().st_size
        if actual != size:
            raise CheckpointCorrupt(f"{name}: {actual} bytes, the manifest says {size}")
        if file_sha256(path) != sha256:
            raise CheckpointCorrupt(f"{name}: sha256 does not match the manifest")
    except OSError as exc:
        raise CheckpointCorrupt(f"{name}: {exc}") from exc


def dcp_files(directory: Path) -> list[str]:
    """The files DCP's metadata in ``directory`` names (its .metadata, then the shards)."""
    names = [".metadata"]
    try:
        metadata = dcp.FileSystemReader(str(directory)).read_metadata()
        names += sorted({info.relative_path for info in metadata.storage_data.values()})
    except Exception:  # another DCP version: the directory listing check still holds
        pass
    return names


def unreadable(directory: Path, *, temp: bool = True) -> list[Path]:
    """Temp directories (``temp``) and committed directories without a manifest."""
    out = []
    for entry in directory.iterdir():
        m = COMMITTED.match(entry.name)
        if (temp and TEMP.match(entry.name)) or (
            m and not manifest_path(directory, int(m.group(1))).exists()
        ):
            out.append(entry)
    return out


def delete(info: CheckpointInfo) -> None:
    """Manifest first: a half-deleted checkpoint is never trusted."""
    info.manifest_path.unlink(missing_ok=True)
    shutil.rmtree(info.path, ignore_errors=True)
