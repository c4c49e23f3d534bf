"""How Slack's answers map to the three failure kinds of ``agent.notify.base``.

429 (with its Retry-After), 5xx and network errors are transient; token, channel and scope
problems are permanent and come with a hint; errors about one message reject that message.
A network error raised while waiting for the answer (a read timeout, a connection dropped
after the request went out) may hide a delivered message: it is marked ``maybe_delivered``.
"""

from __future__ import annotations

import re
import socket
import ssl
from collections.abc import Callable
from typing import Any
from urllib.error import URLError

from agent.notify.base import (
    DeliveryError,
    LookupUnavailableError,
    MessageRejectedError,
    PermanentDeliveryError,
    TransientDeliveryError,
)
from agent.notify.secrets import scrub

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
    # Looking up a page whose request was cut off (conversations.history / .replies).
    "history": "give the app the channels:history scope (groups:history for a private "
    "channel), reinstall it, and keep the bot a member of {channel}: then a page whose "
    "request was cut off by a crash is looked up instead of sent again",
    "channel_name": "set the channel as an ID (C0123456789, channel name > About): "
    "conversations.history does not take names",
    "webhook_lookup": "use a bot token with channels:history instead of a webhook for "
    "exactly-once pages across crashes",
}
# Lookup errors after which the dispatcher sends the in-doubt page again (at least once).
LOOKUP_UNAVAILABLE_ERRORS = frozenset(
    {
        "missing_scope",
        "not_allowed_token_type",
        "not_in_channel",
        "channel_not_found",
        "thread_not_found",
        "method_not_supported_for_channel_type",
        "unknown_method",
    }
)


def retry_after(headers: Any) -> float | None:
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


def network_code(exc: BaseException) -> str:
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


def api_error(
    method: str, status: int, data: Any, headers: Any, hint: Callable[[str], str]
) -> DeliveryError:
    """The failure kind of a Web API answer: HTTP ``status``, JSON ``data`` (or not)."""
    code = data.get("error", "") if isinstance(data, dict) else ""
    if not isinstance(code, str) or not ERROR_CODE.fullmatch(code):
        code = f"http_{status}"  # a non-JSON body (a proxy's HTML page, ...)
    http = f" (HTTP {status})" if status != 200 else ""
    message = scrub(f"Slack {method} failed: {code}{http}")
    if status == 429 or code == "ratelimited":
        return TransientDeliveryError(
            message, code="ratelimited", hint=hint("ratelimited"), retry_after=retry_after(headers)
        )
    if status >= 500:
        return TransientDeliveryError(message, code=code)
    if code in PERMANENT_API_ERRORS:
        return PermanentDeliveryError(message, code=code, hint=hint(code))
    if code in MESSAGE_API_ERRORS:
        return MessageRejectedError(message, code=code)
    return TransientDeliveryError(message, code=code)


def network_error(method: str, exc: BaseException, hint: str) -> TransientDeliveryError:
    """A transient error for ``exc``; ``maybe_delivered`` unless urllib failed before or
    while sending (it wraps those in ``URLError``)."""
    code = network_code(exc)
    message = scrub(f"Slack {method} failed: {code} ({exc})")
    return TransientDeliveryError(
        message, code=code, hint=hint, maybe_delivered=not isinstance(exc, URLError)
    )


def lookup_unavailable(error: DeliveryError, hint: str) -> DeliveryError:
    """``error`` of a history lookup as ``LookupUnavailableError`` when retrying cannot help."""
    if error.code not in LOOKUP_UNAVAILABLE_ERRORS:
        return error
    return LookupUnavailableError(str(error), code=error.code, hint=hint)
