"""Pages printed to the console: the default when no Slack destination is configured.

A page may arrive (on the dispatcher's thread) while a progress bar is being redrawn in place
on the same terminal (``mechwatch demo``). ``STATUS_LINE`` is that one-line status: whoever
draws a progress bar draws it through ``STATUS_LINE.show``, and ``ConsoleNotifier`` ends that
line before it prints a page and draws it again below the page, so the two never share a line.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TextIO

from agent.incidents import IncidentEvent
from agent.notify.render import render_text

RULE = "=" * 78


class StatusLine:
    """A one-line status redrawn in place with a carriage return (a progress bar)."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self._stream = stream  # None: look up sys.stdout at write time (it may be replaced)
        self._lock = threading.RLock()
        self._text = ""  # what the line shows now; "" when no line is open

    @property
    def stream(self) -> TextIO:
        return self._stream if self._stream is not None else sys.stdout

    def show(self, text: str) -> None:
        """Draw ``text`` over the current status line (padded so that no tail is left)."""
        with self._lock:
            pad = max(0, len(self._text) - len(text))
            self.stream.write("\r" + text + " " * pad)
            self.stream.flush()
            self._text = text

    def end(self) -> None:
        """End the status line (a newline): later output starts on a line of its own."""
        with self._lock:
            if self._text:
                self.stream.write("\n")
                self.stream.flush()
            self._text = ""

    @contextmanager
    def interrupted(self) -> Iterator[None]:
        """Print something else in between: the status line is ended before and drawn again
        after (nothing happens when no status line is open)."""
        with self._lock:
            text = self._text
            self.end()
            try:
                yield
            finally:
                if text:
                    self.show(text)


STATUS_LINE = StatusLine()


class ConsoleNotifier:
    """Writes each page as plain text to ``stream`` (standard error by default)."""

    name = "console"

    def __init__(self, stream: TextIO | None = None, status: StatusLine = STATUS_LINE) -> None:
        self._stream = stream  # None: look up sys.stderr at send time (it may be replaced)
        self._status = status

    def send(self, event: IncidentEvent, thread: str | None) -> str | None:
        text = render_text(event, limit=None)
        stream = self._stream if self._stream is not None else sys.stderr
        with self._status.interrupted():  # also serializes pages from several threads
            stream.write(f"{RULE}\n[mechwatch page] {text}\n{RULE}\n")
            stream.flush()
        return None

    def close(self) -> None:
        """The stream belongs to the caller; nothing to close."""

    def __repr__(self) -> str:
        return "ConsoleNotifier()"
