"""Atomic, durable, checksummed file writes.

A file is written as ``<name>.tmp`` through ``open_tmp`` (the one place checkpoint bytes reach
the file system), hashed as it is written, flushed and fsync'd, then renamed over ``<name>``
and the directory fsync'd. A crash leaves either the old ``<name>`` or the complete new one,
plus at most a ``.tmp`` file; a failed write removes its ``.tmp`` file before raising.

When the file system refuses a write (disk full, quota, I/O error) the serializer in between
may replace the ``OSError`` with its own error (``torch.save`` raises an opaque RuntimeError
"unexpected pos ..." once its stream writer saw a failed write). ``HashingWriter`` remembers
the first ``OSError`` it passed on, and ``write_tmp`` raises an ``OSError`` with that errno
(chained to the serializer's error), so the real cause is never lost.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO


def tmp_path(path: Path) -> Path:
    return path.with_name(path.name + ".tmp")


def open_tmp(path: Path) -> BinaryIO:
    """Create (or truncate) a temp file for writing."""
    return open(path, "wb")  # noqa: SIM115 - closed by write_tmp


class HashingWriter:
    """A write-only file wrapper that hashes what passes through it, so the checksum costs no
    second read of the file, and remembers the first OSError the file raised (``error``)."""

    def __init__(self, file: BinaryIO) -> None:
        self._file = file
        self.sha256 = hashlib.sha256()
        self.size_bytes = 0
        self.error: OSError | None = None

    def write(self, data: bytes) -> int:
        self.sha256.update(data)
        self.size_bytes += len(data)
        return self._call(self._file.write, data)

    def flush(self) -> None:
        self._call(self._file.flush)

    def _call(self, method: Callable[..., Any], *args: Any) -> Any:
        try:
            return method(*args)
        except OSError as e:
            if self.error is None:
                self.error = e
            raise


def write_tmp(tmp: Path, fill: Callable[[HashingWriter], None]) -> HashingWriter:
    """Create ``tmp``, let ``fill`` write it, flush and fsync it; returns the writer (sha256,
    size). On any failure ``tmp`` is removed and, if the file system refused a write, an
    OSError with its errno and ``tmp``'s name is raised even when ``fill`` raised something
    else."""
    writer: HashingWriter | None = None
    try:
        with open_tmp(tmp) as f:
            writer = HashingWriter(f)
            fill(writer)
            writer.flush()
            os.fsync(f.fileno())
    except Exception as e:
        tmp.unlink(missing_ok=True)
        cause = None if writer is None else writer.error
        if cause is not None and (cause is not e or cause.filename is None):
            raise OSError(cause.errno, cause.strerror, os.fspath(tmp)) from e
        raise
    return writer


def fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_durably(src: Path, dst: Path) -> None:
    """Rename ``src`` over ``dst`` and fsync the directory (``src`` stays if the rename fails)."""
    os.replace(src, dst)
    fsync_directory(dst.parent)


def write_bytes_atomic(path: Path, data: bytes) -> None:
    """Write ``path`` through a fsync'd temp file and a rename; no temp file is left behind."""
    tmp = tmp_path(path)
    write_tmp(tmp, lambda w: w.write(data))
    try:
        replace_durably(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)  # gone after a successful rename


def file_sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()
