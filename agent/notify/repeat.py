"""When to page again about an incident that is still firing.

The agent emits ``repeat`` events; this helper says when one is due: ``every_steps``
training steps or ``every_s`` wall-clock seconds after the incident's last page, whichever
comes first. Time is passed in (``time.time()`` seconds, so that the schedule survives a
restart through ``state_dict``); nothing here reads a clock.
"""

from __future__ import annotations

from typing import Any


class RepeatSchedule:
    """Tracks the last page per open incident and answers ``due(incident_id, step, now)``."""

    def __init__(self, every_steps: int | None = None, every_s: float | None = None) -> None:
        if every_steps is not None and every_steps < 1:
            raise ValueError(f"repeat every_steps must be >= 1, got {every_steps}")
        if every_s is not None and not every_s > 0:
            raise ValueError(f"repeat every_s must be > 0, got {every_s}")
        self.every_steps = every_steps
        self.every_s = every_s
        self._last: dict[str, tuple[int, float]] = {}  # incident id -> (step, unix seconds)

    def mark(self, incident_id: str, step: int, now: float) -> None:
        """Record a page about ``incident_id`` (its opening, a repeat, an escalation)."""
        self._last[incident_id] = (int(step), float(now))

    def due(self, incident_id: str, step: int, now: float) -> bool:
        """True when a repeat page is due. An incident never marked is not due."""
        last = self._last.get(incident_id)
        if last is None:
            return False
        last_step, last_time = last
        if self.every_steps is not None and step - last_step >= self.every_steps:
            return True
        return self.every_s is not None and now - last_time >= self.every_s

    def forget(self, incident_id: str) -> None:
        """Stop tracking a resolved incident."""
        self._last.pop(incident_id, None)

    def state_dict(self) -> dict[str, Any]:
        return {"last": {k: [s, t] for k, (s, t) in self._last.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._last = {k: (int(s), float(t)) for k, (s, t) in state.get("last", {}).items()}
