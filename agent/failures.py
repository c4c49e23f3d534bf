"""The agent's own failures: recorded, reported once, never raised into the training loop.

``FailureLog.guarded(what, fn, default)`` runs one part of the agent; an exception is reported
(a warning and an ``error`` record in the event log, once per part and first line of the
message) and ``default`` is returned, so the other parts go on. The one exception is
``RankFailure`` (a collective of a distributed job failed): recorded and raised, because the
ranks can no longer reach one decision."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

from agent.distributed.world import RankFailure
from agent.eventlog import EventLog

log = logging.getLogger("mechwatch")
T = TypeVar("T")


class FailureLog:
    def __init__(self, events: EventLog, step: Callable[[], int]) -> None:
        self.events = events
        self._step = step  # the step the agent is at (-1 before the first)
        self._reported: set[str] = set()

    def guarded(self, what: str, fn: Callable[[], T], default: T) -> T:
        """``fn()``, or ``default`` after reporting its exception; a ``RankFailure`` (a
        collective of a distributed job failed) is recorded and raised: the job must stop."""
        try:
            return fn()
        except RankFailure as exc:
            self.write("error", self._step(), what=what, error=str(exc), fatal=True)
            raise
        except Exception as exc:
            self.exception(what, exc)
            return default

    def exception(self, what: str, exc: BaseException) -> None:
        self.report(what, f"{type(exc).__name__}: {exc}")

    def report(self, what: str, text: str, *, outcome: str = "the agent skips this part") -> None:
        """Warn once per (part, first line of the message) and record it in the event log;
        ``outcome`` says what the agent does about it."""
        key = f"{what}: {text.splitlines()[0] if text else ''}"
        if key in self._reported:
            return
        self._reported.add(key)
        warnings.warn(f"mechwatch: {key} (reported once; {outcome})", stacklevel=3)
        self.write("error", self._step(), what=what, error=text)

    def write(self, kind: str, step: int, **payload: Any) -> None:
        """An event-log record; a log that cannot be written never stops the agent."""
        try:
            self.events.write(kind, step, **payload)
        except Exception:
            log.exception("mechwatch: cannot write the event log")
