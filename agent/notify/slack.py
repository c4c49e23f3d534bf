"""Slack pages through slack-sdk: a bot token (``WebClient.chat_postMessage``, threads) or an
incoming webhook (``WebhookClient``, no threads).

With a bot token the first message of an incident opens a thread; escalations, actions,
repeats and the resolution are replies in it (``thread_ts``). A webhook cannot thread or
report a message id, so its replies are top-level messages that quote the incident id.

Errors are sorted into the three ``agent.notify.base`` kinds. 429 (Retry-After), 5xx and
network errors are transient: the dispatcher waits, interruptibly, and tries again; slack-sdk's
``ConnectionErrorRetryHandler`` only covers an immediate retry of a dropped connection.
Token, channel and scope problems are permanent and come with a hint. A message Slack
rejects as malformed is retried once as plain text before it is given up.
"""

from __future__ import annotations

import re
import socket
import ssl
from typing import Any
from urllib.error import URLError

from slack_sdk import WebClient
from slack_sdk.errors import SlackApiError, SlackClientError
from slack_sdk.http_retry import ConnectionErrorRetryHandler, FixedValueRetryIntervalCalculator
from slack_sdk.webhook import WebhookClient

from agent.incidents import IncidentEvent
from agent.notify.base import (
    DeliveryError,
    MessageRejectedError,
    PermanentDeliveryError,
    TransientDeliveryError,
)
from agent.notify.config import DeliveryConfig, SlackSettings
from agent.notify.render import RenderedPage, render_page
from agent.notify.secrets import get_logger, scrub

# slack-sdk logs every failed connection attempt at ERROR; the dispatcher reports failures
# itself (once per outage), so the SDK's logger is quiet unless someone turns it up.
SDK_LOGGER = get_logger("mechwatch.notify.slack_sdk")
SDK_LOGGER.setLevel("CRITICAL")
# A thread reference is "<channel as configured>|<ts>": a reply goes into the thread only when
# the channel is still the same (a restart with another channel starts a new thread).
THREAD_SEPARATOR = "|"
# What a Slack error code looks like; anything else (an HTML error page) is reported by status.
ERROR_CODE = re.compile(r"[a-z][a-z0-9_]{1,60}")

# Web API errors after which nothing can be delivered until the configuration changes.
PERMANENT_API_ERRORS = frozenset(
    {
        "invalid_auth",
        "not_authed",
        "account_inactive",
        "token_revoked",
        "token_expired",
        "no_permission",
        "missing_scope",
        "not_allowed_token_type",
        "ekm_access_denied",
        "org_login_required",
        "team_access_not_granted",
        "access_denied",
        "restricted_action",
        "channel_not_found",
        "not_in_channel",
        "is_archived",
        "invalid_channel",
    }
)
# Errors about this one message.
MESSAGE_API_ERRORS = frozenset(
    {
        "invalid_blocks",
        "invalid_blocks_format",
        "msg_too_long",
        "no_text",
        "too_many_attachments",
        "invalid_arguments",
        "invalid_metadata_format",
        "invalid_metadata_schema",
        "metadata_too_large",
        "metadata_must_be_sent_from_app",
        "invalid_arg_name",
        "invalid_array_arg",
        "invalid_charset",
        "invalid_form_data",
        "invalid_post_type",
        "missing_post_type",
        "invalid_json",
        "json_not_object",
    }
)
# Incoming-webhook answers (HTTP status and a plain-text body).
PERMANENT_WEBHOOK_ERRORS = frozenset(
    {
        "invalid_token",
        "no_service",
        "no_team",
        "team_disabled",
        "channel_not_found",
        "channel_is_archived",
        "action_prohibited",
        "posting_to_general_channel_denied",
        "user_not_found",
    }
)
MESSAGE_WEBHOOK_ERRORS = frozenset(
    {
        "invalid_payload",
        "invalid_blocks",
        "invalid_blocks_format",
        "no_text",
        "missing_text_or_fallback_or_attachments",
        "too_many_attachments",
    }
)

HINTS = {
    "invalid_auth": "the bot token is not valid: check SLACK_BOT_TOKEN (xoxb-...) or "
    "notify.slack.token_file, and that the app is installed in this workspace",
    "not_authed": "no token reached Slack: set SLACK_BOT_TOKEN or notify.slack.token_file",
    "account_inactive": "the token belongs to an uninstalled app or a deleted workspace: "
    "reinstall the app and use its new bot token",
    "token_revoked": "the token was revoked: reinstall the app and use its new bot token",
    "token_expired": "the token expired (token rotation is on): use a non-rotating bot token",
    "missing_scope": "the app lacks a scope: add chat:write (and chat:write.public to post in "
    "channels the bot has not joined), then reinstall the app",
    "not_allowed_token_type": "use a bot token (xoxb-...), not a user or app-level token",
    "channel_not_found": "Slack knows no channel {channel} that this bot can see: check "
    "MECHWATCH_SLACK_CHANNEL (a channel ID like C0123456789 is safest); "
    "for a private channel, /invite the app first",
    "not_in_channel": "the bot is not a member of {channel}: /invite the app there, or add the "
    "chat:write.public scope",
    "is_archived": "channel {channel} is archived: unarchive it or pick another channel",
    "channel_is_archived": "the webhook's channel is archived: create a webhook for another "
    "channel",
    "invalid_token": "the incoming webhook URL is not valid: copy it again from the app's "
    "Incoming Webhooks page",
    "no_service": "the incoming webhook was disabled or removed: create a new webhook URL",
    "action_prohibited": "a workspace admin restricts posting through this webhook",
    "ratelimited": "Slack is rate-limiting this app; pages are delayed, not lost",
    "connection_refused": "nothing accepts connections at {url}: check network access from "
    "this host, HTTPS_PROXY, and MECHWATCH_SLACK_BASE_URL",
    "name_resolution": "the host name in {url} does not resolve: check DNS, HTTPS_PROXY and "
    "MECHWATCH_SLACK_BASE_URL",
    "timeout": "no answer from {url} within the timeout: check network access and proxies",
    "tls_error": "TLS handshake with {url} failed: check proxies and CA certificates",
    "connection_error": "could not reach {url}: check network access from this host",
}


def _retry_after(headers: Any) -> float | None:
    """Seconds from a Retry-After header (integer or decimal seconds), if present."""
    if not headers:
        return None
    for key in headers:
        if str(key).lower() == "retry-after":
            value = headers[key]
            if isinstance(value, list | tuple):
                value = value[0] if value else None
            try:
                return max(0.0, float(value))
            except (TypeError, ValueError):
                return None
    return None


def _network_code(exc: BaseException) -> str:
    reason = getattr(exc, "reason", exc)
    if isinstance(reason, ConnectionRefusedError):
        return "connection_refused"
    if isinstance(reason, socket.gaierror):
        return "name_resolution"
    if isinstance(reason, TimeoutError | socket.timeout):
        return "timeout"
    if isinstance(reason, ssl.SSLError):
        return "tls_error"
    return "connection_error"


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

    def __repr__(self) -> str:
        return f"SlackNotifier({self.settings.describe()})"

    # ------------------------------------------------------------------ errors

    def _hint(self, code: str) -> str:
        return HINTS.get(code, "").format(channel=self.settings.channel, url=self.url)

    def _api_error(self, method: str, exc: SlackApiError) -> DeliveryError:
        response = exc.response
        status = getattr(response, "status_code", 0) or 0
        data = getattr(response, "data", None)
        code = data.get("error", "") if isinstance(data, dict) else ""
        if not isinstance(code, str) or not ERROR_CODE.fullmatch(code):
            code = f"http_{status}"  # a non-JSON body (a proxy's HTML page, ...)
        http = f" (HTTP {status})" if status != 200 else ""
        message = scrub(f"Slack {method} failed: {code}{http}")
        if status == 429 or code == "ratelimited":
            return TransientDeliveryError(
                message,
                code="ratelimited",
                hint=self._hint("ratelimited"),
                retry_after=_retry_after(getattr(response, "headers", None)),
            )
        if status >= 500:
            return TransientDeliveryError(message, code=code)
        if code in PERMANENT_API_ERRORS:
            return PermanentDeliveryError(message, code=code, hint=self._hint(code))
        if code in MESSAGE_API_ERRORS:
            return MessageRejectedError(message, code=code)
        return TransientDeliveryError(message, code=code)

    def _network_error(self, method: str, exc: BaseException) -> TransientDeliveryError:
        code = _network_code(exc)
        message = scrub(f"Slack {method} failed: {code} ({exc})")
        return TransientDeliveryError(message, code=code, hint=self._hint(code))

    def _call(self, method: str, fn: Any, **kwargs: Any) -> Any:
        try:
            return fn(**kwargs)
        except SlackApiError as exc:
            raise self._api_error(method, exc) from None
        except (URLError, OSError) as exc:  # URLError, ConnectionError, TimeoutError, ...
            raise self._network_error(method, exc) from None
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
            kwargs["metadata"] = {
                "event_type": "mechwatch_page",
                "event_payload": {
                    "event_id": event.event_id,
                    "incident_id": event.incident.id,
                    "kind": event.kind,
                    "family": event.incident.family,
                    "severity": event.incident.severity,
                },
            }
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
        ts = response.get("ts") if isinstance(response.data, dict) else None
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
                message, code="ratelimited", retry_after=_retry_after(response.headers)
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
