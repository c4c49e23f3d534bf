"""The run's event log: one JSON object per line (metrics, alerts, incidents, actions, pages).

Each record is ``{"time": <unix seconds>, "kind": ..., "step": ..., **payload}``. Each line
goes to the OS in one unbuffered write as it is written (a killed process loses nothing the OS
has seen) and is fsync'd on ``flush()``, ``close()`` and at most every ``fsync_interval_s``
seconds while writing: that periodic fsync runs on a sync thread of the log's own (started by
the first one due), so a writer (the training thread) never waits for the disk. A process
killed mid-line leaves a torn last line: readers skip it, and a writer reopening the file starts
its first record on a line of its own.

I/O never raises out of ``write``, ``flush`` or ``close`` (the training loop must survive a
full disk): a record the disk refuses (ENOSPC, EIO, ...) is dropped whole (a partly written
line is cut back off), counted in ``dropped`` and ``write`` returns False; the cause is logged
once. As soon as a write succeeds again (or at ``close``), one record names it in the log
itself, at the step of the first record dropped, just before the record that succeeded::

    {"time": ..., "kind": "error", "step": 40, "what": "event log", "errno": "ENOSPC",
     "error": "[Errno 28] No space left on device", "dropped": 12}

Secrets never reach the file: every line goes through ``agent.notify.secrets.scrub``.

The format is public and versioned: docs/events.md lists every kind and field; the ``start``
record of each agent run carries ``format`` (``EVENT_LOG_FORMAT``). Fields are only ever added
within a format version; a change that removes or redefines a field raises it.
"""

from __future__ import annotations

import dataclasses
import errno
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

EVENT_LOG_FORMAT = 1  # the version of the record kinds and fields (docs/events.md)
RESERVED_FIELDS = ("time", "kind", "step")
EVENT_LOG_ERROR = "event log"  # the ``what`` of the record that names a write failure


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


def errno_name(exc: OSError) -> str:
    """``ENOSPC`` for an OSError with errno 28; ``OSError`` when it carries no errno."""
    return errno.errorcode.get(exc.errno or 0, type(exc).__name__)


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
        # Unbuffered: a record is in the file or it is not; nothing waits in a buffer for close.
        self._file = open(self.path, "a+b", buffering=0)  # noqa: SIM115 - lives as long as the log
        self._fd = self._file.fileno()
        self._needs_newline = self._ends_mid_line()  # a torn line to terminate first
        self._last_fsync = time.monotonic()  # when the latest fsync was due (or done)
        self._sync_lock = threading.Lock()  # one fsync at a time; close waits for the sync thread
        self._sync_due = threading.Event()  # set by a writer: the sync thread fsyncs
        self._syncer: threading.Thread | None = None
        self._closing = False
        self._failure: OSError | None = None  # the first error of the current failing period
        self._failure_step = -1
        self._dropped_in_failure = 0
        self._sync_failed = False
        self.written = 0  # records written by this instance
        self.dropped = 0  # records lost to I/O errors (disk full, ...)

    def _ends_mid_line(self) -> bool:
        end = self._file.seek(0, os.SEEK_END)
        if end == 0:
            return False
        self._file.seek(end - 1)
        return self._file.read(1) != b"\n"

    @property
    def closed(self) -> bool:
        return self._file.closed

    def write(self, kind: str, step: int, **payload: Any) -> bool:
        """Append one record. Returns False when the disk refuses it (see the module docstring).

        Raises ``ValueError`` for a payload that uses a reserved field or cannot be encoded,
        and for a closed log; never for I/O.
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
        with self._lock:
            if self._file.closed:
                raise ValueError(f"event log {self.path} is closed")
            if not self._append(self._failure_line() + line, int(step)):
                self.dropped += 1
                self._dropped_in_failure += 1
                return False
            self.written += 1
            self._maybe_fsync()
        return True

    def flush(self) -> None:
        """fsync everything written so far (records reach the OS as they are written)."""
        with self._lock:
            if not self._file.closed:
                with self._sync_lock:
                    self._sync()
                self._last_fsync = time.monotonic()

    def close(self) -> None:
        """Name a pending write failure if the disk takes it now, fsync and close."""
        with self._lock:
            if self._file.closed:
                return
            if self._failure is not None:
                self._append(self._failure_line(), self._failure_step)
            with self._sync_lock:  # the sync thread never touches a closed descriptor
                self._closing = True
                self._sync_due.set()  # it wakes, sees the log closing and ends
                self._sync()
                try:
                    self._file.close()
                except OSError as exc:  # the descriptor is released even when close says EIO
                    log.error("event log %s: close failed: %s", self.path, exc)

    def __enter__(self) -> EventLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"EventLog({str(self.path)!r}, written={self.written}, dropped={self.dropped})"

    # ------------------------------------------------------------------ I/O, under the lock
    def _failure_line(self) -> str:
        """The record naming the current write failure (at the step of the first record it
        dropped) and a newline, or '' when there is none."""
        if self._failure is None:
            return ""
        record = {
            "time": time.time(),
            "kind": "error",
            "step": self._failure_step,
            "what": EVENT_LOG_ERROR,
            "errno": errno_name(self._failure),
            "error": str(self._failure),
            "dropped": self._dropped_in_failure,
        }
        return json.dumps(record) + "\n"

    def _append(self, lines: str, step: int) -> bool:
        """Write ``lines`` (one or two records) whole, or nothing. A failure at ``step`` starts
        a failing period (unless one is on); a success ends it."""
        data = ("\n" if self._needs_newline else "") + scrub(lines) + "\n"
        view = memoryview(data.encode("utf-8"))
        done = 0
        try:
            while done < len(view):
                n = os.write(self._fd, view[done:])
                if n == 0:  # no progress and no error: treat it as the disk refusing
                    raise OSError(errno.EIO, "write made no progress")
                done += n
        except OSError as exc:
            self._cut_back(done)
            if self._failure is None:
                self._failure, self._failure_step = exc, step
                log.error("event log %s: write failed (%s); dropping records", self.path, exc)
            return False
        self._needs_newline = False
        if self._failure is not None:
            log.warning(
                "event log %s: writes work again (%d records dropped)",
                self.path,
                self._dropped_in_failure,
            )
            self._failure, self._dropped_in_failure = None, 0
        return True

    def _cut_back(self, done: int) -> None:
        """Remove the ``done`` bytes of a partly written line (or end it at the next write)."""
        if done == 0:
            return
        try:
            os.ftruncate(self._fd, os.fstat(self._fd).st_size - done)
        except OSError:
            self._needs_newline = True

    def _maybe_fsync(self) -> None:
        """Hand an fsync to the sync thread when the latest is ``fsync_interval_s`` old."""
        now = time.monotonic()
        if now - self._last_fsync < self.fsync_interval_s:
            return
        self._last_fsync = now
        self._sync_due.set()
        if self._syncer is None:
            name = f"mechwatch-eventlog-sync {self.path.name}"
            self._syncer = threading.Thread(target=self._sync_loop, name=name, daemon=True)
            self._syncer.start()

    def _sync_loop(self) -> None:
        """The sync thread: one fsync per request (requests that come during one are merged),
        until the log closes."""
        while True:
            self._sync_due.wait()
            self._sync_due.clear()
            with self._sync_lock:
                if self._closing:
                    return
                self._sync()

    def _sync(self) -> None:
        """fsync, under ``_sync_lock``; a failure is logged once (until a sync works again),
        never raised."""
        try:
            os.fsync(self._fd)
        except OSError as exc:
            if exc.errno != errno.EINVAL and not self._sync_failed:  # EINVAL: cannot be synced
                log.error("event log %s: fsync failed: %s", self.path, exc)
                self._sync_failed = True
        else:
            self._sync_failed = False


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


def last_run(events: list[dict]) -> list[dict]:
    """The records of the last agent start on: a run directory used again (a job restarted
    from scratch, or resumed) keeps the earlier runs' records, since the log appends. All of
    them when no start is recorded."""
    starts = [i for i, e in enumerate(events) if e.get("kind") == "start"]
    return events[starts[-1] :] if starts else events


def read_events(path: str | Path, kinds: str | tuple[str, ...] | None = None) -> list[dict]:
    """All records of an event log, optionally only those whose ``kind`` is in ``kinds``."""
    if isinstance(kinds, str):
        kinds = (kinds,)
    return [
        record for _, record in iter_jsonl(path) if kinds is None or record.get("kind") in kinds
    ]
