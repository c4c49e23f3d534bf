"""The notifier contract and the three ways a delivery can fail.

A notifier turns one ``IncidentEvent`` into one message. ``send`` is called from a
background sender thread (never the training thread), one event at a time, in the order the
events were submitted. ``thread`` is the reference ``send`` returned for the first delivered
message of the same incident (a Slack ``ts``), or None; a notifier that cannot thread
returns None and quotes the incident id in its replies instead.

Failures are exceptions of three kinds, which decide what the dispatcher does next:

- ``TransientDeliveryError``: try the same event again later (after ``retry_after`` seconds
  when the server said so, else after an exponential backoff).
- ``PermanentDeliveryError``: the notifier cannot deliver anything until its configuration
  changes (bad token, unknown channel). Reported once; the events stay in the outbox.
- ``MessageRejectedError``: this one message can never be delivered (malformed); it is
  recorded as rejected for this notifier and the queue moves on.

A send whose outcome is unknown (the process was killed while the request was in flight, or
the request timed out waiting for the answer) leaves the event *in doubt*. Before sending it
again the dispatcher asks a notifier that implements ``DeliveryLookup`` whether the event got
through; ``LookupUnavailableError`` means it cannot tell, and the event is sent again (at
least once). A notifier without ``find_delivered`` is always sent to again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from agent.incidents import IncidentEvent


class DeliveryError(Exception):
    """A page could not be delivered. ``code`` is a short machine-readable reason."""

    def __init__(self, message: str, *, code: str, hint: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.hint = hint


class TransientDeliveryError(DeliveryError):
    """Try again later: rate limit, 5xx, no network."""

    def __init__(
        self,
        message: str,
        *,
        code: str,
        hint: str = "",
        retry_after: float | None = None,
        maybe_delivered: bool = False,
    ) -> None:
        super().__init__(message, code=code, hint=hint)
        self.retry_after = retry_after  # seconds the server asked us to wait, if it did
        # The request went out but no answer came (a read timeout): it may have been delivered.
        self.maybe_delivered = maybe_delivered


class PermanentDeliveryError(DeliveryError):
    """Nothing can be delivered until the configuration is fixed (token, channel, scopes)."""


class MessageRejectedError(DeliveryError):
    """This message can never be delivered as it is (too large, malformed)."""


class LookupUnavailableError(DeliveryError):
    """The notifier cannot tell whether an event was delivered (no API, missing scope)."""


@runtime_checkable
class Notifier(Protocol):
    """Delivers page events somewhere people (or tools) will see them."""

    # Unique among the notifiers of one dispatcher; keys delivery records in the outbox.
    name: str

    def send(self, event: IncidentEvent, thread: str | None) -> str | None:
        """Deliver ``event``; return a reference replies can thread under, or None."""
        ...

    def close(self) -> None:
        """Release resources. Called once, after the last ``send``."""
        ...


@runtime_checkable
class DeliveryLookup(Protocol):
    """Optional for a notifier: can tell whether an in-doubt event reached its destination."""

    def find_delivered(
        self, event: IncidentEvent, thread: str | None, attempted_at: float
    ) -> str | None:
        """Look for ``event`` as sent with ``thread`` no earlier than ``attempted_at`` (unix
        time, seconds). Return the reference ``send`` would have returned (non-empty) when
        it was delivered, None when it certainly was not. Raise ``LookupUnavailableError``
        when this cannot be known, another ``DeliveryError`` when the lookup itself failed.
        """
        ...
