"""The background writer's publish sequence for one checkpoint.

``publish`` runs on the writer thread: it waits for the device-to-host copies, serializes the
payload to ``ckpt-<step>.pt.tmp`` (hashing it as it goes), fsyncs it, drops any older manifest
of the same step, renames the file into place, fsyncs the directory, and writes the manifest
(tmp, fsync, rename, fsync). The manifest comes last, so at every moment a manifest describes a
complete file. When any of it fails, ``publish`` removes everything of this step it wrote (the
temp files, and the data file and manifest if they were already in place) and re-raises, with
the file system's OSError named even when ``torch.save`` wrapped it (``atomic.write_tmp``).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from agent.checkpoints.atomic import HashingWriter, replace_durably, tmp_path, write_tmp
from agent.checkpoints.format import data_path, manifest_path, write_manifest


@dataclass
class SaveJob:
    """One capture handed to the writer thread."""

    step: int
    payload: dict[str, Any] | None  # host copy; dropped as soon as it is serialized
    manifest: dict[str, Any]  # format.new_manifest, without the writer's fields
    cuda_events: list[Any]  # torch.cuda.Event per device with copies in flight
    done: threading.Event = field(default_factory=threading.Event)


def _serialize(payload: dict[str, Any], file: HashingWriter) -> None:
    """The serialization step of the background writer (one function so tests can gate it)."""
    torch.save(payload, file)


def publish(job: SaveJob, directory: Path, dir_lock: threading.Lock) -> dict[str, Any]:
    """Write the job's checkpoint (see the module docstring); returns the manifest written.
    ``dir_lock`` is held from dropping the old manifest to writing the new one."""
    step = job.step
    final = data_path(directory, step)
    tmp = tmp_path(final)
    manifest_file = manifest_path(directory, step)
    step_files_ours = False  # whether this step's files on disk are (partly) this write's
    try:
        t0 = time.perf_counter()
        for event in job.cuda_events:
            event.synchronize()  # the non-blocking device-to-host copies have landed
        payload = job.payload
        assert payload is not None
        writer = write_tmp(tmp, lambda w: _serialize(payload, w))
        job.payload = payload = None  # release the host copy (pinned buffers stay for reuse)
        manifest = dict(job.manifest)
        manifest["sha256"] = writer.sha256.hexdigest()
        manifest["size_bytes"] = writer.size_bytes
        manifest["write_seconds"] = time.perf_counter() - t0
        with dir_lock:
            # An older manifest of this step (a step saved again after a rollback) would
            # describe the file about to be replaced: drop it first, so no moment pairs a
            # manifest with the wrong file.
            manifest_file.unlink(missing_ok=True)
            step_files_ours = True
            replace_durably(tmp, final)
            write_manifest(manifest_file, manifest)
    except BaseException:
        with dir_lock:
            tmp.unlink(missing_ok=True)
            if step_files_ours:  # a data file without a manifest is never trusted: free it
                manifest_file.unlink(missing_ok=True)
                final.unlink(missing_ok=True)
        raise
    return manifest
