"""Deliver page events without ever blocking training or losing a page.

``PageDispatcher.submit`` is what the agent calls on the training thread: it writes the event
to the durable outbox (one fsync'd append; incidents are rare, so this is not per step) and
wakes the senders. One background thread per notifier delivers that notifier's events in
submission order, so an incident's opening message always goes out before its replies, and
one slow notifier (Slack during an outage) never delays another (the console).

Failure policy (see ``agent.notify.base``):

- transient (429, 5xx, network): retry the same event after Retry-After (capped at
  ``max_retry_after_s``) or an exponential backoff from ``retry_initial_s`` to
  ``retry_max_s`` with jitter. After ``max_attempts`` failures in a row the notifier is
  parked and tries again every ``recheck_s``. Logged once per outage (warning), and once
  when it is given up for now (error).
- permanent (bad token, unknown channel): logged once as an error with a hint, no retry
  storm; the notifier is parked and checks again every ``recheck_s`` (inviting the bot to a
  channel fixes ``not_in_channel`` without a restart). Its events stay in the outbox, so
  fixing the configuration and restarting delivers them.
- rejected (malformed message): recorded as rejected for that notifier; the queue moves on.

On start, events an earlier process left undelivered in the same run dir are sent first;
an event id already delivered is never sent again by the same notifier.

Requests in flight. Before each send an ``attempt`` (notifier, event id, unix time) is
fsync'd to the outbox; the ``done`` record follows the answer. An event with an attempt and
no ``done`` is *in doubt*: the process was killed during the request (which lasts up to the
HTTP timeout, not milliseconds), or the request timed out waiting for the answer. Before
sending an in-doubt event again, the sender asks the notifier (``DeliveryLookup``) whether it
got through: if so it is recorded as delivered with the reference found (so replies still
thread), else it is sent. A notifier that cannot tell (``LookupUnavailableError``: Slack
without the history scope, a webhook) or has no lookup gets it again, logged once with the
reason: exactly once where the lookup works, at least once for a request in flight otherwise.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from agent.incidents import IncidentEvent
from agent.notify.base import (
    DeliveryError,
    DeliveryLookup,
    LookupUnavailableError,
    MessageRejectedError,
    Notifier,
    PermanentDeliveryError,
    TransientDeliveryError,
)
from agent.notify.config import DeliveryConfig
from agent.notify.outbox import OUTBOX_DIRNAME, Outbox
from agent.notify.secrets import get_logger, scrub

log = get_logger("mechwatch.notify")


@dataclass
class NotifierStatus:
    """What one notifier's sender is doing; ``PageDispatcher.status()`` returns these."""

    name: str
    delivered: int = 0  # events delivered by this process
    rejected: int = 0
    failures: int = 0  # failed attempts in a row
    next_attempt_at: float = 0.0  # time.monotonic() before which it will not try
    parked: bool = False  # permanent error or retries used up: waits recheck_s
    last_error: str = ""  # scrubbed
    last_code: str = ""
    reported: set[str] = field(default_factory=set)  # error codes already logged loudly


class PageDispatcher:
    """Background, durable, exactly-once delivery of ``IncidentEvent``s to notifiers."""

    def __init__(
        self,
        notifiers: Sequence[Notifier],
        run_dir: str | Path | None,
        *,
        delivery: DeliveryConfig | None = None,
        start: bool = True,
    ) -> None:
        if not notifiers:
            raise ValueError("PageDispatcher needs at least one notifier")
        names = [n.name for n in notifiers]
        if len(set(names)) != len(names):
            raise ValueError(f"notifier names must be unique, got {names}")
        self.notifiers = list(notifiers)
        self.delivery = delivery or DeliveryConfig()
        directory = Path(run_dir) / OUTBOX_DIRNAME if run_dir is not None else None
        if directory is None:
            log.warning("no run dir for the page outbox: undelivered pages die with the process")
        self._outbox = Outbox(directory, names)
        self._cv = threading.Condition()
        self._status = {n.name: NotifierStatus(n.name) for n in notifiers}
        self._threads: list[threading.Thread] = []
        self._stopping = False
        self._closed = False
        self._random = random.Random()
        self._lookup_reported: set[tuple[str, str]] = set()  # (notifier, code) warned about
        if start:
            self.start()

    # ------------------------------------------------------------------ public API

    def start(self) -> None:
        """Start the sender threads (done by the constructor unless ``start=False``)."""
        with self._cv:
            if self._threads or self._closed:
                return
            for notifier in self.notifiers:
                thread = threading.Thread(
                    target=self._run,
                    args=(notifier,),
                    name=f"mechwatch-pages-{notifier.name}",
                    daemon=True,
                )
                self._threads.append(thread)
            for thread in self._threads:
                thread.start()

    def submit(self, event: IncidentEvent) -> None:
        """Persist ``event`` to the outbox and wake the senders. Never raises on I/O."""
        with self._cv:
            if self._closed:
                log.error(
                    "page %s submitted after the dispatcher was closed; not delivered",
                    event.event_id,
                )
                return
            try:
                added = self._outbox.add(event)
            except Exception as exc:  # never crash the training loop over a page
                log.error("could not queue page %s: %s", event.event_id, scrub(str(exc)))
                return
            if not added:
                log.debug("page %s already queued or delivered; ignored", event.event_id)
                return
            self._cv.notify_all()

    def pending(self) -> int:
        """Events not yet finished by every notifier."""
        with self._cv:
            return self._outbox.pending()

    def flush(self, timeout: float) -> bool:
        """Wait until every event is delivered (True) or ``timeout`` seconds pass (False).

        Returns False early when every notifier that still has events is parked on a
        permanent error or used up retries: waiting longer would not help.
        """
        deadline = time.monotonic() + max(0.0, timeout)
        with self._cv:
            while True:
                if self._outbox.pending() == 0:
                    return True
                if self._stuck() or not self._threads:
                    return False
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cv.wait(remaining)

    def close(self, timeout: float = 5.0) -> bool:
        """Flush for up to ``timeout`` seconds, stop the senders, release the outbox.

        Returns True when nothing was left undelivered. Undelivered events stay in the
        outbox for the next dispatcher on the same run dir.
        """
        if self._closed:
            return self.pending() == 0
        deadline = time.monotonic() + max(0.0, timeout)
        delivered = self.flush(timeout)
        with self._cv:
            self._stopping = True
            self._closed = True
            self._cv.notify_all()
        alive = []
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()) + 0.05)
            if thread.is_alive():
                alive.append(thread.name)
        with self._cv:
            left = self._outbox.pending()
            if alive:
                # A send is still in flight; its thread records the result when it returns.
                log.warning("pages: %s still sending at close", ", ".join(alive))
            else:
                self._outbox.close()
        for notifier in self.notifiers:
            try:
                notifier.close()
            except Exception as exc:
                log.warning("closing notifier %s failed: %s", notifier.name, scrub(str(exc)))
        if left:
            where = self._outbox.directory or "memory (no run dir: they are lost)"
            log.warning("pages: %d event(s) undelivered at close; kept in %s", left, where)
        return delivered and left == 0

    def status(self) -> dict[str, NotifierStatus]:
        """A copy of each notifier's sender state."""
        with self._cv:
            return {
                name: NotifierStatus(**{**vars(st), "reported": set(st.reported)})
                for name, st in self._status.items()
            }

    def __enter__(self) -> PageDispatcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ sender threads

    def _stuck(self) -> bool:
        waiting = [st for st in self._status.values() if self._outbox.pending_for(st.name)]
        return bool(waiting) and all(st.parked for st in waiting)

    def _next_job(
        self, notifier: Notifier
    ) -> tuple[IncidentEvent, str | None, float | None] | None:
        """Under the lock: wait until an event is due for ``notifier``; None to stop.

        Returns the event, the thread reference of its incident, and the unix time of its
        earliest in-doubt attempt (None when it is not in doubt).
        """
        st = self._status[notifier.name]
        while not self._stopping:
            event = self._outbox.next_for(notifier.name)
            if event is None:
                self._cv.wait()
                continue
            wait = st.next_attempt_at - time.monotonic()
            if wait > 0:
                self._cv.wait(wait)
                continue
            name = notifier.name
            thread = self._outbox.thread_for(name, event.incident.id)
            return event, thread, self._outbox.in_doubt_since(name, event.event_id)
        return None

    def _run(self, notifier: Notifier) -> None:
        while True:
            with self._cv:
                job = self._next_job(notifier)
            if job is None:
                return
            event, thread, in_doubt_since = job
            try:
                ref = self._deliver(notifier, event, thread, in_doubt_since)
            except Exception as exc:
                with self._cv:
                    try:
                        self._on_failure(notifier.name, event, exc)
                    except Exception as inner:  # a bug here must not kill the sender
                        log.exception("pages: failure handling broke: %s", inner)
                        self._status[notifier.name].next_attempt_at = (
                            time.monotonic() + self.delivery.retry_max_s
                        )
                    self._cv.notify_all()
                continue
            with self._cv:
                try:
                    self._outbox.mark_done(notifier.name, event, ref)
                except Exception as exc:
                    log.error(
                        "pages: could not record delivery of %s: %s",
                        event.event_id,
                        scrub(str(exc)),
                    )
                self._on_success(notifier.name, event)
                self._cv.notify_all()

    def _deliver(
        self,
        notifier: Notifier,
        event: IncidentEvent,
        thread: str | None,
        in_doubt_since: float | None,
    ) -> str | None:
        """Without the lock: settle an in-doubt event, else record an attempt and send."""
        if in_doubt_since is not None:
            found = self._find_delivered(notifier, event, thread, in_doubt_since)
            if found is not None:
                return found
        with self._cv:
            self._outbox.mark_attempt(notifier.name, event, time.time())
        try:
            return notifier.send(event, thread)
        except DeliveryError as exc:
            if not getattr(exc, "maybe_delivered", False):  # a clear "no": not in doubt
                with self._cv:
                    self._outbox.clear_attempt(notifier.name, event.event_id)
            raise

    def _find_delivered(
        self, notifier: Notifier, event: IncidentEvent, thread: str | None, since: float
    ) -> str | None:
        """The reference of in-doubt ``event`` if it was delivered; None: send it (again).

        A failed lookup (429, 5xx, network, a bad token) raises: it is retried like a send.
        """
        name = notifier.name
        code, reason, hint = "no_lookup", "it has no lookup", ""
        if isinstance(notifier, DeliveryLookup):
            try:
                ref = notifier.find_delivered(event, thread, since)
            except LookupUnavailableError as exc:
                code, reason, hint = exc.code, scrub(str(exc)), scrub(exc.hint)
            except DeliveryError:
                raise
            except Exception as exc:  # a bug in a lookup must not hold the page back
                code, reason = "lookup_failed", scrub(f"{type(exc).__name__}: {exc}")
            else:
                if ref:
                    log.info(
                        "pages: %s had delivered %s already (found it); not sending it again",
                        name,
                        event.event_id,
                    )
                    return ref
                with self._cv:
                    self._outbox.clear_attempt(name, event.event_id)
                log.info("pages: %s had not delivered %s; sending it", name, event.event_id)
                return None
        if (name, code) not in self._lookup_reported:
            self._lookup_reported.add((name, code))
            log.warning(
                "pages: %s cannot check whether %s got through before its request was cut "
                "off (%s); sending it again, so it may show twice%s",
                name,
                event.event_id,
                reason,
                f". Hint: {hint}" if hint else "",
            )
        return None

    def _backoff(self, failures: int) -> float:
        cfg = self.delivery
        delay = min(cfg.retry_max_s, cfg.retry_initial_s * 2 ** max(0, failures - 1))
        return delay * self._random.uniform(0.8, 1.2)

    def _on_success(self, name: str, event: IncidentEvent) -> None:
        st = self._status[name]
        if st.failures or st.parked:
            log.info(
                "pages: %s delivers again (%s after %d failed attempt(s))",
                name,
                event.event_id,
                st.failures,
            )
        st.delivered += 1
        st.failures = 0
        st.parked = False
        st.next_attempt_at = 0.0
        st.last_error = ""
        st.last_code = ""
        st.reported.clear()

    def _on_failure(self, name: str, event: IncidentEvent, exc: BaseException) -> None:
        st = self._status[name]
        cfg = self.delivery
        if isinstance(exc, DeliveryError):
            error = exc
        else:  # a notifier bug or an unexpected library error: retry like a transient one
            error = TransientDeliveryError(f"{type(exc).__name__}: {exc}", code="unexpected")
        message = scrub(str(error))
        hint = scrub(error.hint)
        st.last_error, st.last_code = message, error.code
        now = time.monotonic()
        pending = self._outbox.pending_for(name)

        if isinstance(error, MessageRejectedError):
            log.error(
                "pages: %s rejected %s as malformed (%s); recorded as rejected, moving on",
                name,
                event.event_id,
                message,
            )
            self._outbox.mark_done(name, event, outcome="rejected", detail=error.code)
            st.rejected += 1
            st.failures = 0
            return

        st.failures += 1
        if isinstance(error, PermanentDeliveryError):
            st.parked = True
            st.next_attempt_at = now + cfg.recheck_s
            if error.code not in st.reported:
                st.reported.add(error.code)
                log.error(
                    "pages: %s cannot deliver: %s.%s %d page(s) kept in the outbox; "
                    "fix the configuration and restart (or it checks again in %.0f s)",
                    name,
                    message,
                    f" Hint: {hint}." if hint else "",
                    pending,
                    cfg.recheck_s,
                )
            else:
                log.debug("pages: %s still failing: %s", name, message)
            return

        assert isinstance(error, TransientDeliveryError)
        if st.failures >= cfg.max_attempts:
            st.parked = True
            st.next_attempt_at = now + cfg.recheck_s
            if "gave_up" not in st.reported:
                st.reported.add("gave_up")
                log.error(
                    "pages: %s failed %d times in a row (last: %s); %d page(s) kept in "
                    "the outbox, next try in %.0f s%s",
                    name,
                    st.failures,
                    message,
                    pending,
                    cfg.recheck_s,
                    f". Hint: {hint}" if hint else "",
                )
            return
        if error.retry_after is not None:
            delay = min(error.retry_after, cfg.max_retry_after_s)
        else:
            delay = self._backoff(st.failures)
        st.next_attempt_at = now + delay
        if st.failures == 1:
            log.warning(
                "pages: %s delivery failed (%s); retrying in %.2f s%s",
                name,
                message,
                delay,
                f". Hint: {hint}" if hint else "",
            )
        else:
            log.debug(
                "pages: %s attempt %d failed (%s); retrying in %.2f s",
                name,
                st.failures,
                message,
                delay,
            )
