"""Notification settings: a pydantic model (the ``notify:`` part of the agent's YAML) plus
the environment.

Slack is configured by either a bot token and a channel (threads, ``auth.test``) or an
incoming webhook URL (no threads). Fields left unset in the config are read from the
environment: ``SLACK_BOT_TOKEN``, ``MECHWATCH_SLACK_CHANNEL``, ``SLACK_WEBHOOK_URL`` and
``MECHWATCH_SLACK_BASE_URL``. Tokens are ``SecretStr``: redacted in reprs, dumps and errors.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator

from agent.notify.secrets import get_logger, register_secret

log = get_logger("mechwatch.notify")

ENV_BOT_TOKEN = "SLACK_BOT_TOKEN"
ENV_CHANNEL = "MECHWATCH_SLACK_CHANNEL"
ENV_WEBHOOK_URL = "SLACK_WEBHOOK_URL"
ENV_BASE_URL = "MECHWATCH_SLACK_BASE_URL"
DEFAULT_BASE_URL = "https://slack.com/api/"

EventKindName = Literal["opened", "updated", "escalated", "action", "repeat", "resolved"]


def _check_url(value: str | None, what: str) -> str | None:
    if value is not None and not value.startswith(("http://", "https://")):
        raise ValueError(f"{what} must start with http:// or https://")
    return value


class SlackConfig(BaseModel):
    """Where Slack pages go. Leave everything unset to use the environment only."""

    # hide_input_in_errors: a mistyped key (``bot_tokn: xoxb-...``) must not echo the token.
    model_config = ConfigDict(extra="forbid", hide_input_in_errors=True)

    bot_token: SecretStr | None = Field(
        None, description="Bot token (xoxb-...); prefer SLACK_BOT_TOKEN or token_file."
    )
    token_file: Path | None = Field(
        None, description="File holding the bot token (first line); used if bot_token is unset."
    )
    channel: str | None = Field(
        None, description="Channel ID (C0123...) or name (#alerts) for the bot token path."
    )
    webhook_url: SecretStr | None = Field(
        None, description="Incoming webhook URL (used when no bot token is configured)."
    )
    base_url: str | None = Field(
        None, description="Web API base URL (Slack GovSlack / Enterprise endpoints, tests)."
    )
    proxy: str | None = Field(
        None, description="HTTP(S) proxy URL; slack-sdk also honours HTTPS_PROXY."
    )
    timeout_s: float = Field(10.0, gt=0, description="Timeout of one HTTP request (seconds).")
    broadcast_kinds: list[EventKindName] = Field(
        default_factory=lambda: ["escalated"],
        description="Thread replies of these kinds are also shown in the channel.",
    )
    use_env: bool = Field(
        True, description="Fill unset fields from SLACK_BOT_TOKEN, MECHWATCH_SLACK_CHANNEL, ..."
    )

    @field_validator("base_url")
    @classmethod
    def _base_url_is_http(cls, v: str | None) -> str | None:
        return _check_url(v, "base_url")

    @field_validator("channel")
    @classmethod
    def _channel_not_blank(cls, v: str | None) -> str | None:
        if v is not None and not v.strip():
            raise ValueError("channel must not be blank")
        return v.strip() if v is not None else None


class DeliveryConfig(BaseModel):
    """How hard the sender thread tries. Delays are in seconds."""

    model_config = ConfigDict(extra="forbid")

    retry_initial_s: float = Field(
        1.0, gt=0, description="First backoff delay after a 5xx or network error."
    )
    retry_max_s: float = Field(300.0, gt=0, description="Largest backoff delay.")
    max_attempts: int = Field(
        8, ge=1, description="Failed tries in a row before a notifier is parked until recheck_s."
    )
    recheck_s: float = Field(
        900.0,
        gt=0,
        description="A parked notifier (permanent error, retries used up) retries after this.",
    )
    max_retry_after_s: float = Field(900.0, gt=0, description="Cap on a server's Retry-After.")
    connection_retries: int = Field(
        1,
        ge=0,
        description="Immediate in-client retries (slack-sdk) of a connection that failed before "
        "the request was sent.",
    )
    connection_retry_interval_s: float = Field(
        0.5, ge=0, description="Pause before an in-client connection retry."
    )


class NotifyConfig(BaseModel):
    """Everything about pages. Embedded in the agent config as ``notify:``."""

    model_config = ConfigDict(extra="forbid", hide_input_in_errors=True)

    slack: SlackConfig = Field(default_factory=SlackConfig)
    console: Literal["auto", "always", "never"] = Field(
        "auto", description="Console pages: 'auto' = only when Slack is not configured."
    )
    event_log: str | None = Field(
        None, description="JSONL event log file (relative to the run dir) for page records."
    )
    delivery: DeliveryConfig = Field(default_factory=DeliveryConfig)
    repeat_every_steps: int | None = Field(
        None, ge=1, description="Page again about a still-firing incident after this many steps."
    )
    repeat_every_s: float | None = Field(
        3600.0, gt=0, description="... or after this many seconds, whichever comes first."
    )
    symptom_wait_steps: int = Field(
        50,
        ge=0,
        description="Hold a new incident that only non-critical symptoms (loss, grad norm) "
        "support this many steps before it opens (its page and its rules' actions wait too), "
        "so that a mechanism alert that follows names the fault in the first page (0: at once).",
    )


@dataclass(frozen=True)
class SlackSettings:
    """Resolved Slack destination: exactly one of (token, channel) or webhook_url."""

    mode: Literal["bot", "webhook"]
    token: SecretStr | None
    channel: str | None
    webhook_url: SecretStr | None
    base_url: str
    timeout_s: float
    proxy: str | None
    broadcast_kinds: tuple[str, ...]
    source: str  # where the credential came from, for messages (never the credential)

    def describe(self) -> str:
        if self.mode == "bot":
            return f"Slack bot token ({self.source}) -> {self.channel} via {self.base_url}"
        return f"Slack incoming webhook ({self.source})"


def _read_token_file(path: Path) -> str:
    try:
        text = path.expanduser().read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"notify.slack.token_file: {path} does not exist") from None
    except OSError as exc:
        raise ValueError(f"notify.slack.token_file: cannot read {path}: {exc.strerror}") from None
    token = text.strip().splitlines()[0].strip() if text.strip() else ""
    if not token:
        raise ValueError(f"notify.slack.token_file: {path} is empty")
    return token


def resolve_slack(
    config: SlackConfig | None = None, env: Mapping[str, str] | None = None
) -> SlackSettings | None:
    """Combine config and environment. None when Slack is not configured at all.

    Raises ``ValueError`` naming the field or variable when the configuration is incomplete
    (a token without a channel, a channel without a token or webhook, an unreadable file).
    """
    config = config or SlackConfig()
    env = os.environ if env is None else env

    def from_env(name: str) -> str | None:
        if not config.use_env:
            return None
        value = env.get(name, "").strip()
        return value or None

    token: str | None = None
    source = ""
    if config.bot_token is not None and config.bot_token.get_secret_value().strip():
        token, source = config.bot_token.get_secret_value().strip(), "notify.slack.bot_token"
    elif config.token_file is not None:
        token, source = _read_token_file(config.token_file), f"token_file {config.token_file}"
    elif from_env(ENV_BOT_TOKEN):
        token, source = from_env(ENV_BOT_TOKEN), ENV_BOT_TOKEN
    channel = config.channel or from_env(ENV_CHANNEL)
    webhook = config.webhook_url.get_secret_value().strip() if config.webhook_url else None
    webhook_source = "notify.slack.webhook_url"
    if not webhook and from_env(ENV_WEBHOOK_URL):
        webhook, webhook_source = from_env(ENV_WEBHOOK_URL), ENV_WEBHOOK_URL
    base_url = _check_url(config.base_url or from_env(ENV_BASE_URL), ENV_BASE_URL)
    base_url = base_url or DEFAULT_BASE_URL
    if not base_url.endswith("/"):
        base_url += "/"
    register_secret(token)
    register_secret(webhook)
    _check_url(webhook, f"Slack webhook URL ({webhook_source})")

    common = dict(
        base_url=base_url,
        timeout_s=config.timeout_s,
        proxy=config.proxy,
        broadcast_kinds=tuple(config.broadcast_kinds),
    )
    if token:
        if not channel:
            raise ValueError(
                f"a Slack bot token is set ({source}) but no channel: set {ENV_CHANNEL} "
                "or notify.slack.channel (a channel ID like C0123456789 is safest)"
            )
        if not token.startswith(("xoxb-", "xoxp-")):
            log.warning("the Slack token from %s does not look like a bot token (xoxb-...)", source)
        if webhook:
            log.info(
                "both a Slack bot token and a webhook URL are set; using the bot token "
                "(it can thread replies)"
            )
        return SlackSettings(
            mode="bot",
            token=SecretStr(token),
            channel=channel,
            webhook_url=None,
            source=source,
            **common,
        )
    if webhook:
        return SlackSettings(
            mode="webhook",
            token=None,
            channel=None,
            webhook_url=SecretStr(webhook),
            source=webhook_source,
            **common,
        )
    if channel:
        raise ValueError(
            f"a Slack channel is set ({channel!r}) but no credential: set {ENV_BOT_TOKEN} "
            f"(or notify.slack.token_file), or {ENV_WEBHOOK_URL}"
        )
    return None
