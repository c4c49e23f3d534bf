"""Pages recorded in the run's JSONL event log as ``kind="page"`` records.

A record carries the event id, kind, incident id, family, severity, the plain-text page and
the full event (``IncidentEvent.to_dict``), so that tools can rebuild the incident history.
"""

from __future__ import annotations

from agent.eventlog import EventLog
from agent.incidents import IncidentEvent
from agent.notify.base import TransientDeliveryError
from agent.notify.render import render_text

PAGE_KIND = "page"


class JsonlNotifier:
    """Appends one ``page`` record per event to an ``EventLog``."""

    name = "jsonl"

    def __init__(self, event_log: EventLog, *, owns_log: bool = False) -> None:
        self.event_log = event_log
        self._owns_log = owns_log  # close the log with the notifier (the factory opened it)

    def send(self, event: IncidentEvent, thread: str | None) -> str | None:
        written = self.event_log.write(
            PAGE_KIND,
            event.step,
            event_id=event.event_id,
            event_kind=event.kind,
            incident_id=event.incident.id,
            family=event.incident.family,
            severity=event.incident.severity,
            text=render_text(event, limit=None),
            event=event.to_dict(),
        )
        if not written:
            raise TransientDeliveryError(
                f"could not append to {self.event_log.path}", code="write_failed"
            )
        return None

    def close(self) -> None:
        if self._owns_log:
            self.event_log.close()
        else:
            self.event_log.flush()

    def __repr__(self) -> str:
        return f"JsonlNotifier({str(self.event_log.path)!r})"
