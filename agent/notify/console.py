"""Pages printed to the console: the default when no Slack destination is configured."""

from __future__ import annotations

import sys
import threading
from typing import TextIO

from agent.incidents import IncidentEvent
from agent.notify.render import render_text

RULE = "=" * 78


class ConsoleNotifier:
    """Writes each page as plain text to ``stream`` (standard error by default)."""

    name = "console"

    def __init__(self, stream: TextIO | None = None) -> None:
        self._stream = stream  # None: look up sys.stderr at send time (it may be replaced)
        self._lock = threading.Lock()

    def send(self, event: IncidentEvent, thread: str | None) -> str | None:
        text = render_text(event, limit=None)
        stream = self._stream if self._stream is not None else sys.stderr
        with self._lock:
            stream.write(f"{RULE}\n[mechwatch page] {text}\n{RULE}\n")
            stream.flush()
        return None

    def close(self) -> None:
        """The stream belongs to the caller; nothing to close."""

    def __repr__(self) -> str:
        return "ConsoleNotifier()"
