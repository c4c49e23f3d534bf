"""Whether a checkpoint can be trusted: its file against its manifest, then its payload.

``verify_file`` checks that the data file exists with the manifest's size and sha256 (a
truncated, flipped or replaced file fails here). ``load_payload`` then loads it to CPU and
checks that it is a mechwatch payload of this format whose step is the manifest's (a file that
matches its checksum but does not load, or that holds another step, fails here). Both raise
CheckpointCorrupt naming the file; nothing else is ever returned for a bad checkpoint.

``newest_trusted`` walks the checkpoints newest first and returns the first that passes a
check, skipping (and naming) the others: the search behind ``newest_verified`` and
``load_newest``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

from agent.checkpoints.atomic import file_sha256
from agent.checkpoints.format import (
    FORMAT_VERSION,
    KEY_FORMAT,
    KEY_MODEL,
    KEY_STEP,
    CheckpointCorrupt,
    CheckpointInfo,
)


def verify_file(info: CheckpointInfo) -> None:
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
        digest = file_sha256(info.path)
    except OSError as e:
        raise CheckpointCorrupt(f"{info.path.name}: cannot be read: {e}") from e
    if digest != info.sha256:
        raise CheckpointCorrupt(
            f"{info.path.name}: sha256 {digest[:12]}... does not match the manifest's "
            f"{info.sha256[:12]}..."
        )


def load_payload(info: CheckpointInfo, *, weights_only: bool) -> dict[str, Any]:
    """Verify the file, then load its payload to CPU and check its format and step."""
    verify_file(info)
    try:
        payload = torch.load(info.path, map_location="cpu", weights_only=weights_only)
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


T = TypeVar("T")


def newest_trusted(
    infos: list[CheckpointInfo],
    check: Callable[[CheckpointInfo], T],
    *,
    before_step: int | None,
    known_good_only: bool,
    lineage: str | None,
    skipped: list[str] | None,
    warn: Callable[[str], None],
) -> tuple[CheckpointInfo, T] | None:
    """The first of ``infos`` (newest first) with ``step < before_step``, of ``lineage``
    (None: any), known-good if asked, for which ``check`` does not raise CheckpointCorrupt;
    with what ``check`` returned. Each passed-over checkpoint's reason is appended to
    ``skipped``; corrupt ones are also warned about."""
    for info in infos:
        if before_step is not None and info.step >= before_step:
            continue
        reason = None
        if lineage is not None and info.lineage != lineage:
            reason = f"{info.path.name}: written by another run ({info.lineage})"
        elif known_good_only and not info.known_good:
            reason = f"{info.path.name}: not known-good (unhealthy at save time)"
        else:
            try:
                return info, check(info)
            except CheckpointCorrupt as e:
                reason = str(e)
                warn(f"skipping checkpoint: {e}")
        if skipped is not None:
            skipped.append(reason)
    return None
