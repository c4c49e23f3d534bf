"""Failed saves: name the real cause once, report when saving works again.

A full disk fails every save until space is freed; warning on each attempt buries the cause,
and ``torch.save`` hides it (an opaque RuntimeError once its stream writer saw a failed
write). ``SaveFailures`` turns each failure into one message that names the cause: for an
``OSError`` anywhere in the exception's chain its errno name and text (``ENOSPC (No space left
on device)``), the file, the directory and the free bytes ``os.statvfs`` reports; otherwise the
exception's type and text. Each distinct cause (the errno name, or the exception type) is
warned and reported once; the first save that succeeds afterwards reports, once, that saving
recovered and how many saves failed, and a cause seen again after that is news again.

``report(kind, message)`` is called from the writer thread as ``report("checkpoint",
message)`` for a failure and ``report("checkpoint recovered", message)`` for a recovery (the
agent passes its event log); an exception from it is logged, never raised.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Callable
from pathlib import Path

_log = logging.getLogger(__name__)

REPORT_KIND = "checkpoint"  # a failed save
RECOVERED_KIND = "checkpoint recovered"  # the first save that works after failures


def os_error_in(exc: BaseException) -> OSError | None:
    """The first OSError along ``exc``'s cause/context chain (``exc`` itself included)."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        if isinstance(e, OSError):
            return e
        seen.add(id(e))
        e = e.__cause__ if e.__cause__ is not None else e.__context__
    return None


def free_bytes(directory: Path) -> int | None:
    """Bytes available to this user on the directory's file system, None if unknown."""
    try:
        st = os.statvfs(directory)
    except (AttributeError, OSError):  # no statvfs on this platform, or the path is gone
        return None
    return st.f_bavail * st.f_frsize


def describe_failure(exc: BaseException, directory: Path) -> tuple[str, str]:
    """(cause, text): the cause key a failure is reported once under, and what to say."""
    os_error = os_error_in(exc)
    if os_error is not None and os_error.errno is not None:
        cause = errno.errorcode.get(os_error.errno, f"errno {os_error.errno}")
        text = f"{cause} ({os_error.strerror or os.strerror(os_error.errno)})"
        if os_error.filename is not None:
            text += f" writing {os.fspath(os_error.filename)}"
    else:
        cause = type(exc).__name__
        text = f"{cause}: {exc}"
    free = free_bytes(directory)
    where = "free space unknown" if free is None else f"{free} bytes free"
    return cause, f"{text}; {where} in {directory}"


class SaveFailures:
    """Once-per-cause bookkeeping of a manager's failed and recovered saves (writer thread)."""

    def __init__(
        self,
        directory: Path,
        *,
        warn: Callable[[str], None],
        report: Callable[[str, str], None] | None,
    ) -> None:
        self.directory = directory
        self._warn = warn
        self._report = report
        self.failed_since_success = 0
        self.causes: list[str] = []  # causes reported since the last successful save

    def failed(self, step: int, exc: BaseException) -> str:
        """Record a failed save; warns and reports if its cause is new. Returns the message."""
        cause, text = describe_failure(exc, self.directory)
        message = f"checkpoint at step {step} not saved: {text}; earlier checkpoints untouched"
        self.failed_since_success += 1
        if cause not in self.causes:
            self.causes.append(cause)
            self._warn(f"{message} (said once per cause until a save succeeds)")
            self._send(REPORT_KIND, message)
        return message

    def succeeded(self, step: int) -> None:
        """Record a successful save; reports the recovery after failures."""
        if self.failed_since_success == 0:
            return
        message = (
            f"checkpoint saving recovered at step {step} after {self.failed_since_success} "
            f"failed save(s) ({', '.join(self.causes)})"
        )
        self.failed_since_success = 0
        self.causes = []
        _log.info("mechwatch checkpoints (%s): %s", self.directory, message)
        self._send(RECOVERED_KIND, message)

    def _send(self, kind: str, message: str) -> None:
        if self._report is None:
            return
        try:
            self._report(kind, message)
        except Exception as e:  # reporting must never break the writer
            _log.warning("mechwatch checkpoints: report(%r) failed: %r", message, e)
