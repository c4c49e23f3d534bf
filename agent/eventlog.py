"""The run's event log: one JSON object per line (metrics, alerts, incidents, actions, pages).

Each record is ``{"time": <unix seconds>, "kind": ..., "step": ..., **payload}``. Lines are
flushed as they are written (a killed process loses nothing the OS has seen) and fsync'd on
``flush()``, ``close()`` and at most every ``fsync_interval_s`` seconds while writing.
A process killed mid-line leaves a torn last line: readers skip it, and a writer reopening
the file terminates it first so that the next record starts on a line of its own.

Secrets never reach the file: every line goes through ``agent.notify.secrets.scrub``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from agent.notify.secrets import get_logger, scrub

log = get_logger("mechwatch.eventlog")

RESERVED_FIELDS = ("time", "kind", "step")


def _to_json(value: Any) -> Any:
    """``json.dumps`` fallback: numpy scalars, paths, sets, dataclasses."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, set | frozenset):
        return sorted(value, key=str)
    item = getattr(value, "item", None)  # numpy / torch scalars; callers pass no device tensors
    if callable(item) and getattr(value, "ndim", 1) == 0:
        return item()
    raise TypeError(f"{type(value).__name__} is not JSON-serializable")


class EventLog:
    """Thread-safe append-only JSONL writer for one run's events."""

    def __init__(self, path: str | Path, *, fsync_interval_s: float = 1.0) -> None:
        if fsync_interval_s < 0 or not math.isfinite(fsync_interval_s):
            raise ValueError(
                f"fsync_interval_s must be a finite number >= 0, got {fsync_interval_s}"
            )
        self.path = Path(path)
        self.fsync_interval_s = float(fsync_interval_s)
        self._lock = threading.Lock()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a+b")  # noqa: SIM115 - lives as long as the log
        self._terminate_torn_line()
        self._last_fsync = time.monotonic()
        self._write_failed = False
        self.written = 0  # records written by this instance
        self.dropped = 0  # records lost to I/O errors (disk full, ...)

    def _terminate_torn_line(self) -> None:
        end = self._file.seek(0, os.SEEK_END)
        if end == 0:
            return
        self._file.seek(end - 1)
        if self._file.read(1) != b"\n":
            self._file.write(b"\n")
            self._file.flush()

    @property
    def closed(self) -> bool:
        return self._file.closed

    def write(self, kind: str, step: int, **payload: Any) -> bool:
        """Append one record. Returns False (and logs once) when the disk refuses it.

        Raises ``ValueError`` for a payload that uses a reserved field or cannot be encoded.
        """
        if not isinstance(kind, str) or not kind:
            raise ValueError(f"event kind must be a non-empty string, got {kind!r}")
        clash = [k for k in RESERVED_FIELDS if k in payload]
        if clash:
            raise ValueError(f"event payload field(s) {clash} are reserved ({RESERVED_FIELDS})")
        record = {"time": time.time(), "kind": kind, "step": int(step), **payload}
        try:
            line = json.dumps(record, default=_to_json, ensure_ascii=False)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"event {kind!r} at step {step}: payload is not JSON: {exc}") from exc
        data = (scrub(line) + "\n").encode("utf-8")
        with self._lock:
            if self._file.closed:
                raise ValueError(f"event log {self.path} is closed")
            try:
                self._file.write(data)
                self._file.flush()
                now = time.monotonic()
                if now - self._last_fsync >= self.fsync_interval_s:
                    os.fsync(self._file.fileno())
                    self._last_fsync = now
            except OSError as exc:
                self.dropped += 1
                if not self._write_failed:
                    log.error(
                        "event log %s: write failed (%s); records are being dropped", self.path, exc
                    )
                    self._write_failed = True
                return False
            self.written += 1
            if self._write_failed:
                log.warning("event log %s: writes work again (%d dropped)", self.path, self.dropped)
                self._write_failed = False
        return True

    def flush(self) -> None:
        """Flush and fsync everything written so far."""
        with self._lock:
            if self._file.closed:
                return
            try:
                self._file.flush()
                os.fsync(self._file.fileno())
            except OSError as exc:
                log.error("event log %s: fsync failed: %s", self.path, exc)
                return
            self._last_fsync = time.monotonic()

    def close(self) -> None:
        self.flush()
        with self._lock:
            if not self._file.closed:
                self._file.close()

    def __enter__(self) -> EventLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"EventLog({str(self.path)!r}, written={self.written})"


def iter_jsonl(path: str | Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, record) for each JSON object line of ``path``.

    A torn last line (no newline, or not JSON) is skipped silently: it is what a killed
    writer leaves. A bad line elsewhere is skipped with a warning naming ``path:line``.
    A missing file yields nothing.
    """
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return
    lines = raw.split(b"\n")
    torn_tail = lines[-1] != b""  # the last record has no newline: it may be cut short
    if not torn_tail:
        lines.pop()
    for index, line in enumerate(lines):
        lineno = index + 1
        is_last = index == len(lines) - 1
        if not line.strip():
            continue
        try:
            record = json.loads(line.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            if is_last:
                log.debug("%s:%d: skipping torn last line", path, lineno)
            else:
                log.warning("%s:%d: skipping a line that is not JSON (%s)", path, lineno, exc)
            continue
        if not isinstance(record, dict):
            log.warning("%s:%d: skipping a line that is not a JSON object", path, lineno)
            continue
        if is_last and torn_tail:
            # Complete JSON without its newline: the write finished but the newline did not.
            log.debug("%s:%d: last line has no newline; keeping it", path, lineno)
        yield lineno, record


def read_events(path: str | Path, kinds: str | tuple[str, ...] | None = None) -> list[dict]:
    """All records of an event log, optionally only those whose ``kind`` is in ``kinds``."""
    if isinstance(kinds, str):
        kinds = (kinds,)
    return [
        record for _, record in iter_jsonl(path) if kinds is None or record.get("kind") in kinds
    ]
