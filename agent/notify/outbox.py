"""The durable outbox: which page events exist, which notifier delivered which, and where
each incident's thread is. Lives in ``<run_dir>/pages/``.

The journal ``outbox.jsonl`` is append-only; every record is flushed and fsync'd before the
call returns, so an event acknowledged by ``add`` survives a SIGKILL, and so does each
delivery. A torn last line (killed mid-write) is ignored on load. Records:

- ``{"op": "event", "id": ..., "event": {...}}``: a submitted ``IncidentEvent``.
- ``{"op": "attempt", "notifier": ..., "id": ..., "at": ...}``: ``notifier`` is about to send
  event ``id`` (``at``: unix time, seconds). Written and fsync'd *before* the request goes
  out, so a process killed while the request is in flight leaves an attempt without a
  ``done``: the event is *in doubt* (it may or may not have reached its destination).
- ``{"op": "not_delivered", "notifier": ..., "id": ...}``: the attempts so far certainly did
  not deliver (the destination said no, or a lookup found nothing): no longer in doubt.
- ``{"op": "done", "notifier": ..., "id": ..., "incident": ..., "ref": ..., "outcome": ...}``:
  one notifier finished with one event (``delivered``, or ``rejected`` as malformed).
  ``ref`` is what the notifier returned (a Slack thread reference) or null.
- ``{"op": "snapshot", "done": {notifier: [ids]}, "threads": {notifier: {incident: ref}},
  "attempts": {notifier: {id: at}}}``: the compacted history (``attempts``: the events still
  in doubt), written first when the journal is rewritten on open and close.

Rewrites are atomic (temp file, fsync, rename, fsync of the directory). An exclusive lock
file keeps two live processes from delivering the same outbox (the lock dies with its
process, so a killed agent never blocks the next one).

Not thread-safe: the dispatcher serializes every call under its own lock.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from agent.eventlog import iter_jsonl
from agent.incidents import IncidentEvent
from agent.notify.secrets import get_logger, scrub

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: no cross-process lock
    fcntl = None  # type: ignore[assignment]

log = get_logger("mechwatch.notify.outbox")

OUTBOX_DIRNAME = "pages"
JOURNAL_NAME = "outbox.jsonl"
LOCK_NAME = "outbox.lock"
JOURNAL_VERSION = 1


class OutboxLockedError(RuntimeError):
    """Another live process owns this outbox."""


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class Outbox:
    """Page events and their delivery state, persisted in ``directory`` (or memory only)."""

    def __init__(self, directory: str | Path | None, notifiers: Sequence[str]) -> None:
        if not notifiers:
            raise ValueError("an outbox needs at least one notifier name")
        self.directory = Path(directory) if directory is not None else None
        self.notifiers = tuple(notifiers)
        self._events: dict[str, IncidentEvent] = {}  # undelivered somewhere, submission order
        self._payloads: dict[str, dict[str, Any]] = {}  # the same events as JSON dicts
        self._done: dict[str, set[str]] = {}  # notifier -> event ids it finished
        self._threads: dict[str, dict[str, str]] = {}  # notifier -> incident id -> ref
        # notifier -> event id -> unix time (s) of the earliest send whose outcome is unknown
        self._attempts: dict[str, dict[str, float]] = {}
        self._file: IO[str] | None = None
        self._lock_file: IO[str] | None = None
        self.durable = self.directory is not None
        self._write_failed = False
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._acquire_lock()
            self._load()
            self._rewrite()
            self._file = open(self.journal_path, "a", encoding="utf-8")  # noqa: SIM115

    # ------------------------------------------------------------------ files

    @property
    def journal_path(self) -> Path:
        assert self.directory is not None
        return self.directory / JOURNAL_NAME

    def _acquire_lock(self) -> None:
        assert self.directory is not None
        path = self.directory / LOCK_NAME
        self._lock_file = open(path, "a+", encoding="utf-8")  # noqa: SIM115
        if fcntl is None:
            return
        try:
            fcntl.flock(self._lock_file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock_file.seek(0)
            owner = self._lock_file.read().strip() or "unknown"
            self._lock_file.close()
            self._lock_file = None
            raise OutboxLockedError(
                f"the page outbox {self.directory} is in use by another live process "
                f"(pid {owner}); give each agent its own run dir, or page from rank 0 only"
            ) from None
        self._lock_file.seek(0)
        self._lock_file.truncate()
        self._lock_file.write(str(os.getpid()))
        self._lock_file.flush()

    def _load(self) -> None:
        path = self.journal_path
        for lineno, record in iter_jsonl(path):
            op = record.get("op")
            try:
                if op == "snapshot":
                    for name, ids in record.get("done", {}).items():
                        self._done.setdefault(name, set()).update(ids)
                    for name, threads in record.get("threads", {}).items():
                        self._threads.setdefault(name, {}).update(threads)
                    for name, attempts in record.get("attempts", {}).items():
                        for event_id, at in attempts.items():
                            self._apply_attempt(name, event_id, float(at))
                elif op == "event":
                    event_id = record["id"]
                    if event_id not in self._events:
                        self._events[event_id] = IncidentEvent.from_dict(record["event"])
                        self._payloads[event_id] = record["event"]
                elif op == "attempt":
                    self._apply_attempt(record["notifier"], record["id"], float(record["at"]))
                elif op == "not_delivered":
                    self._attempts.get(record["notifier"], {}).pop(record["id"], None)
                elif op == "done":
                    self._apply_done(
                        record["notifier"],
                        record["id"],
                        record.get("incident"),
                        record.get("ref"),
                        record.get("outcome", "delivered"),
                    )
                else:
                    log.warning("%s:%d: unknown outbox record %r skipped", path, lineno, op)
            except (KeyError, TypeError, ValueError) as exc:
                log.warning(
                    "%s:%d: bad outbox record skipped (%s: %s)",
                    path,
                    lineno,
                    type(exc).__name__,
                    exc,
                )
        self._drop_finished()
        if self._events:
            log.info(
                "outbox %s: %d page event(s) from an earlier run still to deliver",
                self.directory,
                len(self._events),
            )

    def _snapshot(self) -> dict[str, Any]:
        return {
            "op": "snapshot",
            "version": JOURNAL_VERSION,
            "done": {name: sorted(ids) for name, ids in self._done.items()},
            "threads": self._threads,
            "attempts": {
                name: {e: at for e, at in attempts.items() if e in self._events}
                for name, attempts in self._attempts.items()
                if any(e in self._events for e in attempts)
            },
        }

    def _rewrite(self) -> None:
        """Replace the journal by a snapshot plus the pending events, atomically."""
        assert self.directory is not None
        tmp = self.journal_path.with_name(JOURNAL_NAME + ".tmp")
        lines = [self._snapshot()] + [
            {"op": "event", "id": event_id, "event": self._payloads[event_id]}
            for event_id in self._events
        ]
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                for record in lines:
                    f.write(scrub(json.dumps(record)) + "\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.journal_path)
            _fsync_dir(self.directory)
        except OSError as exc:
            log.error("outbox %s: could not compact the journal: %s", self.directory, exc)

    def _append(self, record: dict[str, Any]) -> None:
        if self._file is None or self._file.closed:
            return
        try:
            self._file.write(scrub(json.dumps(record)) + "\n")
            self._file.flush()
            os.fsync(self._file.fileno())
        except OSError as exc:
            if not self._write_failed:
                log.error(
                    "outbox %s: write failed (%s); pages are kept in memory only and "
                    "a restart could lose or repeat them",
                    self.directory,
                    exc,
                )
                self._write_failed = True
            self.durable = False
            return
        if self._write_failed:
            log.warning("outbox %s: writes work again", self.directory)
            self._write_failed = False
            self.durable = True

    # ------------------------------------------------------------------ state

    def _apply_attempt(self, name: str, event_id: str, at: float) -> None:
        if event_id in self._done.get(name, ()):
            return
        attempts = self._attempts.setdefault(name, {})
        attempts[event_id] = min(at, attempts.get(event_id, at))  # the earliest one counts

    def _apply_done(
        self, name: str, event_id: str, incident_id: str | None, ref: str | None, outcome: str
    ) -> None:
        self._done.setdefault(name, set()).add(event_id)
        self._attempts.get(name, {}).pop(event_id, None)
        if outcome == "delivered" and ref and incident_id:
            self._threads.setdefault(name, {}).setdefault(incident_id, ref)

    def _finished(self, event_id: str) -> bool:
        return all(event_id in self._done.get(name, ()) for name in self.notifiers)

    def _drop_finished(self) -> None:
        for event_id in [e for e in self._events if self._finished(e)]:
            del self._events[event_id]
            del self._payloads[event_id]

    def known(self, event_id: str) -> bool:
        """True once ``event_id`` was added here or delivered by any notifier, ever."""
        return event_id in self._events or any(event_id in d for d in self._done.values())

    def add(self, event: IncidentEvent) -> bool:
        """Persist ``event``. False (and nothing written) if its id is already known."""
        event_id = event.event_id
        if self.known(event_id):
            return False
        payload = event.to_dict()  # a deep copy: later changes to the incident are not paged
        self._append({"op": "event", "id": event_id, "event": payload})
        self._events[event_id] = IncidentEvent.from_dict(payload)
        self._payloads[event_id] = payload
        return True

    def next_for(self, name: str) -> IncidentEvent | None:
        """The oldest event ``name`` has not finished, or None."""
        done = self._done.get(name, set())
        for event_id, event in self._events.items():
            if event_id not in done:
                return event
        return None

    def thread_for(self, name: str, incident_id: str) -> str | None:
        return self._threads.get(name, {}).get(incident_id)

    def mark_attempt(self, name: str, event: IncidentEvent, at: float) -> None:
        """Record, durably, that ``name`` is about to send ``event`` (``at``: unix time, s)."""
        self._append({"op": "attempt", "notifier": name, "id": event.event_id, "at": at})
        self._apply_attempt(name, event.event_id, at)

    def in_doubt_since(self, name: str, event_id: str) -> float | None:
        """Unix time of the earliest send of ``event_id`` by ``name`` with an unknown outcome.

        None when no such send exists: the event was never attempted, or every attempt is
        known to have failed (``clear_attempt``), or it is done.
        """
        return self._attempts.get(name, {}).get(event_id)

    def clear_attempt(self, name: str, event_id: str) -> None:
        """Record that ``name``'s attempts at ``event_id`` so far certainly did not deliver
        (the destination said no, or a lookup found nothing). Nothing to do if none is open.
        """
        if event_id not in self._attempts.get(name, {}):
            return
        self._append({"op": "not_delivered", "notifier": name, "id": event_id})
        self._attempts[name].pop(event_id, None)

    def mark_done(
        self,
        name: str,
        event: IncidentEvent,
        ref: str | None = None,
        outcome: str = "delivered",
        detail: str = "",
    ) -> None:
        """Record that notifier ``name`` finished ``event`` (durably, then in memory)."""
        assert outcome in ("delivered", "rejected"), outcome
        record = {
            "op": "done",
            "notifier": name,
            "id": event.event_id,
            "incident": event.incident.id,
            "ref": ref,
            "outcome": outcome,
        }
        if detail:
            record["detail"] = detail
        self._append(record)
        self._apply_done(name, event.event_id, event.incident.id, ref, outcome)
        if self._finished(event.event_id):
            self._events.pop(event.event_id, None)
            self._payloads.pop(event.event_id, None)

    def pending(self) -> int:
        """Events some notifier has not finished."""
        return len(self._events)

    def pending_for(self, name: str) -> int:
        done = self._done.get(name, set())
        return sum(1 for event_id in self._events if event_id not in done)

    def close(self) -> None:
        """Compact the journal and release the lock. Idempotent."""
        if self._file is not None and not self._file.closed:
            self._file.close()
            self._rewrite()
        if self._lock_file is not None and not self._lock_file.closed:
            self._lock_file.close()  # closing the descriptor drops the flock
