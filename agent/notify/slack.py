"""Slack pages through slack-sdk: a bot token (``WebClient.chat_postMessage``, threads) or an
incoming webhook (``WebhookClient``, no threads).

With a bot token the first message of an incident opens a thread; escalations, actions,
repeats and the resolution are replies in it (``thread_ts``). A webhook cannot thread or
report a message id, so its replies are top-level messages that quote the incident id.

Errors are sorted into the three ``agent.notify.base`` kinds (``agent.notify.slack_errors``).
429 (Retry-After), 5xx and network errors are transient: the dispatcher waits, interruptibly,
and tries again; slack-sdk's ``ConnectionErrorRetryHandler`` only retries at once a
connection that failed before the request was sent. Token, channel and scope problems are
permanent and come with a hint. A message Slack rejects as malformed is retried once as plain
text before it is given up.

Every message carries metadata (``event_type`` ``mechwatch_page``) with the event id and the
run it comes from. ``find_delivered`` looks for it, for a page whose request was cut off by a
crash or a read timeout: ``conversations.history`` of the channel (or
``conversations.replies`` of the incident's thread) since the attempt, with
``include_all_metadata``. That needs the channel as an ID and the ``channels:history`` scope
(``groups:history`` for a private channel); without them the lookup is unavailable and the
page is sent again.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.error import URLError

from slack_sdk import WebClient
from slack_sdk.errors import SlackApiError, SlackClientError
from slack_sdk.http_retry import ConnectionErrorRetryHandler, FixedValueRetryIntervalCalculator
from slack_sdk.webhook import WebhookClient

from agent.incidents import IncidentEvent
from agent.notify.base import (
    DeliveryError,
    LookupUnavailableError,
    MessageRejectedError,
    PermanentDeliveryError,
    TransientDeliveryError,
)
from agent.notify.config import DeliveryConfig, SlackSettings
from agent.notify.render import RenderedPage, render_page
from agent.notify.secrets import get_logger, scrub
from agent.notify.slack_errors import (
    ERROR_CODE,
    HINTS,
    MESSAGE_WEBHOOK_ERRORS,
    PERMANENT_WEBHOOK_ERRORS,
    api_error,
    lookup_unavailable,
    network_code,
    network_error,
    retry_after,
)

# slack-sdk logs every failed connection attempt at ERROR; the dispatcher reports failures
# itself (once per outage), so the SDK's logger is quiet unless someone turns it up.
SDK_LOGGER = get_logger("mechwatch.notify.slack_sdk")
SDK_LOGGER.setLevel("CRITICAL")
# A thread reference is "<channel as configured>|<ts>": a reply goes into the thread only when
# the channel is still the same (a restart with another channel starts a new thread).
THREAD_SEPARATOR = "|"
# A conversation ID (public C..., private G..., direct D...); conversations.history takes only IDs.
CHANNEL_ID = re.compile(r"[CGD][A-Z0-9]{6,}")
METADATA_EVENT_TYPE = "mechwatch_page"
# The metadata keys that identify one page: incident ids repeat across runs, so the run's
# name, host, rank, job and the event's step are part of the identity.
PAGE_IDENTITY = ("event_id", "run", "host", "rank", "job", "step")
# The lookup searches from this many seconds before the recorded attempt (clock skew between
# this host and Slack), LOOKUP_PAGE messages per call, at most LOOKUP_PAGES calls.
LOOKUP_MARGIN_S = 120.0
LOOKUP_PAGE = 200
LOOKUP_PAGES = 5


def page_metadata(event: IncidentEvent) -> dict[str, Any]:
    """The ``metadata`` of ``event``'s message (Slack message metadata: flat JSON values)."""
    ctx = event.context
    payload: dict[str, Any] = {
        "event_id": event.event_id,
        "incident_id": event.incident.id,
        "kind": event.kind,
        "family": event.incident.family,
        "severity": event.incident.severity,
        "run": ctx.run_name,
        "host": ctx.host,
        "rank": ctx.rank,
        "step": event.step,
    }
    if ctx.job_id:
        payload["job"] = str(ctx.job_id)
    return {"event_type": METADATA_EVENT_TYPE, "event_payload": payload}


def _is_page(message: Any, expected: dict[str, Any]) -> bool:
    """Whether a message of conversations.history/.replies is the page ``expected`` describes."""
    metadata = message.get("metadata") if isinstance(message, dict) else None
    if not isinstance(metadata, dict) or metadata.get("event_type") != METADATA_EVENT_TYPE:
        return False
    payload = metadata.get("event_payload")
    want = expected["event_payload"]
    return isinstance(payload, dict) and all(payload.get(k) == want.get(k) for k in PAGE_IDENTITY)


class SlackNotifier:
    """Delivers pages to one Slack channel (bot token) or one incoming webhook."""

    name = "slack"

    def __init__(self, settings: SlackSettings, delivery: DeliveryConfig | None = None) -> None:
        delivery = delivery or DeliveryConfig()
        self.settings = settings
        self.mode = settings.mode
        handlers = (
            [
                ConnectionErrorRetryHandler(
                    max_retry_count=delivery.connection_retries,
                    interval_calculator=FixedValueRetryIntervalCalculator(
                        delivery.connection_retry_interval_s
                    ),
                    # Only failures before the request was sent: a connection dropped while
                    # waiting for the answer may hide a posted message (the dispatcher looks).
                    error_types=[URLError],
                )
            ]
            if delivery.connection_retries > 0
            else []
        )
        timeout = max(1, round(settings.timeout_s))
        self._web: WebClient | None = None
        self._webhook: WebhookClient | None = None
        if settings.mode == "bot":
            assert settings.token is not None and settings.channel
            self._web = WebClient(
                token=settings.token.get_secret_value(),
                base_url=settings.base_url,
                timeout=timeout,
                proxy=settings.proxy,
                logger=SDK_LOGGER,
                retry_handlers=handlers,
            )
            self.url = settings.base_url
        else:
            assert settings.webhook_url is not None
            self._webhook = WebhookClient(
                url=settings.webhook_url.get_secret_value(),
                timeout=timeout,
                proxy=settings.proxy,
                logger=SDK_LOGGER,
                retry_handlers=handlers,
            )
            self.url = "the Slack webhook URL"
        self.threads = settings.mode == "bot"
        # The channel's ID for lookups: configured, or learned from chat.postMessage's answer.
        channel = settings.channel or ""
        self._channel_id: str | None = channel if CHANNEL_ID.fullmatch(channel) else None

    def __repr__(self) -> str:
        return f"SlackNotifier({self.settings.describe()})"

    # ------------------------------------------------------------------ errors

    def _hint(self, code: str) -> str:
        return HINTS.get(code, "").format(channel=self.settings.channel, url=self.url)

    def _api_error(self, method: str, exc: SlackApiError) -> DeliveryError:
        response = exc.response
        return api_error(
            method,
            getattr(response, "status_code", 0) or 0,
            getattr(response, "data", None),
            getattr(response, "headers", None),
            self._hint,
        )

    def _call(self, method: str, fn: Any, **kwargs: Any) -> Any:
        try:
            return fn(**kwargs)
        except SlackApiError as exc:
            raise self._api_error(method, exc) from None
        except (URLError, OSError) as exc:  # URLError, ConnectionError, TimeoutError, ...
            raise network_error(method, exc, self._hint(network_code(exc))) from None
        except SlackClientError as exc:
            raise PermanentDeliveryError(
                scrub(f"Slack {method} failed: {exc}"), code="client_error"
            ) from None

    # ------------------------------------------------------------------ API

    def auth_test(self) -> dict[str, Any]:
        """``auth.test`` for the bot token: who we are. Raises a ``DeliveryError``."""
        if self._web is None:
            raise ValueError(
                "auth.test needs a bot token; a webhook cannot be tested without posting a message"
            )
        response = self._call("auth.test", self._web.auth_test)
        return dict(response.data) if isinstance(response.data, dict) else {}

    def send(self, event: IncidentEvent, thread: str | None) -> str | None:
        """Post ``event``; with a bot token, return ``"<channel>|<ts>"`` for threading."""
        if self._web is None:
            self._post_webhook(render_page(event, threaded=False))
            return None
        thread_ts = self._thread_ts(thread) if event.kind != "opened" else None
        page = render_page(event, threaded=thread_ts is not None)
        ts = self._post(event, page, thread_ts)
        return f"{self.settings.channel}{THREAD_SEPARATOR}{ts}" if ts else None

    def _thread_ts(self, thread: str | None) -> str | None:
        """The ts to reply under, if ``thread`` was opened in the channel configured now."""
        if not thread:
            return None
        channel, _, ts = thread.rpartition(THREAD_SEPARATOR)
        return ts if channel == self.settings.channel and ts else None

    def find_delivered(
        self, event: IncidentEvent, thread: str | None, attempted_at: float
    ) -> str | None:
        """``"<channel>|<ts>"`` of ``event``'s message if it was posted, else None.

        Searches where ``send`` would have posted: the channel's history, or the thread of
        ``thread`` for a reply, from ``attempted_at - LOOKUP_MARGIN_S`` (unix seconds) on.
        Raises ``LookupUnavailableError`` for a webhook, a channel given by name, a missing
        history scope or too many messages to search; other ``DeliveryError``s as ``send``.
        """
        if self._web is None:
            raise LookupUnavailableError(
                "an incoming webhook cannot list the messages it posted",
                code="webhook",
                hint=self._hint("webhook_lookup"),
            )
        if self._channel_id is None:
            raise LookupUnavailableError(
                f"the channel {self.settings.channel} is a name, not an ID",
                code="channel_name",
                hint=self._hint("channel_name"),
            )
        expected = page_metadata(event)
        thread_ts = self._thread_ts(thread) if event.kind != "opened" else None
        kwargs: dict[str, Any] = dict(
            channel=self._channel_id,
            oldest=f"{max(0.0, attempted_at - LOOKUP_MARGIN_S):.6f}",
            include_all_metadata=True,
            limit=LOOKUP_PAGE,
        )
        if thread_ts is None:
            method, fn = "conversations.history", self._web.conversations_history
        else:
            method, fn = "conversations.replies", self._web.conversations_replies
            kwargs["ts"] = thread_ts
        for _ in range(LOOKUP_PAGES):
            try:
                response = self._call(method, fn, **kwargs)
            except DeliveryError as exc:
                raise lookup_unavailable(exc, self._hint("history")) from None
            data = response.data if isinstance(response.data, dict) else {}
            for message in data.get("messages") or []:
                if _is_page(message, expected) and message.get("ts"):
                    return f"{self.settings.channel}{THREAD_SEPARATOR}{message['ts']}"
            cursor = (data.get("response_metadata") or {}).get("next_cursor")
            if not (data.get("has_more") and cursor):
                return None
            kwargs["cursor"] = cursor
        raise LookupUnavailableError(
            f"more than {LOOKUP_PAGES * LOOKUP_PAGE} messages to search in {self.settings.channel}",
            code="too_many_messages",
        )

    def _post(
        self,
        event: IncidentEvent,
        page: RenderedPage,
        thread_ts: str | None,
        *,
        plain: bool = False,
    ) -> str | None:
        """chat.postMessage; the new message's ts. ``plain``: text only, no blocks/metadata."""
        assert self._web is not None
        kwargs: dict[str, Any] = dict(
            channel=self.settings.channel, text=page.text, unfurl_links=False, unfurl_media=False
        )
        if not plain:
            kwargs["blocks"] = page.blocks
            kwargs["metadata"] = page_metadata(event)
        if thread_ts is not None:
            kwargs["thread_ts"] = thread_ts
            if event.kind in self.settings.broadcast_kinds:
                kwargs["reply_broadcast"] = True
        try:
            response = self._call("chat.postMessage", self._web.chat_postMessage, **kwargs)
        except MessageRejectedError:
            if plain:
                raise
            # Malformed blocks or metadata should never happen; do not lose the page over them.
            return self._post(event, page, thread_ts, plain=True)
        data = response.data if isinstance(response.data, dict) else {}
        ts = data.get("ts")
        channel_id = data.get("channel")
        if self._channel_id is None and isinstance(channel_id, str):
            self._channel_id = channel_id if CHANNEL_ID.fullmatch(channel_id) else None
        # Posted but no ts (never seen from Slack): delivered, only threading is lost.
        return str(ts) if ts else None

    def _post_webhook(self, page: RenderedPage, *, with_blocks: bool = True) -> None:
        assert self._webhook is not None
        blocks = page.blocks if with_blocks else None
        response = self._call(
            "webhook",
            self._webhook.send,
            text=page.text,
            blocks=blocks,
            unfurl_links=False,
            unfurl_media=False,
        )
        status = response.status_code
        if status == 200:
            return
        code = (response.body or "").strip()
        if not ERROR_CODE.fullmatch(code):
            code = f"http_{status}"
        message = scrub(f"Slack webhook failed: {code} (HTTP {status})")
        if status == 429:
            raise TransientDeliveryError(
                message, code="ratelimited", retry_after=retry_after(response.headers)
            )
        if status >= 500:
            raise TransientDeliveryError(message, code=code)
        if code in MESSAGE_WEBHOOK_ERRORS or (
            status == 400 and code not in PERMANENT_WEBHOOK_ERRORS
        ):
            if with_blocks:
                self._post_webhook(page, with_blocks=False)
                return
            raise MessageRejectedError(message, code=code)
        raise PermanentDeliveryError(message, code=code, hint=self._hint(code))

    def close(self) -> None:
        """Nothing to release: slack-sdk's urllib clients hold no open connections."""
