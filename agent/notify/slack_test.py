"""``mechwatch slack-test``: send a test page with the configured Slack destination and say
clearly what is wrong when it fails.

With a bot token it first calls ``auth.test`` (is the token valid, which bot and workspace),
then posts the example ``fa_precision`` page and a threaded reply (does the channel exist, may
the bot post there, do threads work). With a webhook it posts the example page. Exit status:
0 delivered, 1 Slack refused or was unreachable, 2 not configured or misconfigured.
The token is never printed.

A rate limit (429) is waited out as Slack's Retry-After asks, at most ``MAX_RETRY_WAIT_S``
per wait and ``MAX_RETRIES`` times in all: a person is waiting for the verdict. Beyond that
it fails at once and says what Slack asked for and when to try again.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from pathlib import Path
from typing import TextIO, TypeVar

from pydantic import ValidationError

from agent.incidents import RunContext
from agent.notify.base import DeliveryError, TransientDeliveryError
from agent.notify.config import (
    ENV_BASE_URL,
    ENV_BOT_TOKEN,
    ENV_CHANNEL,
    ENV_WEBHOOK_URL,
    DeliveryConfig,
    NotifyConfig,
    resolve_slack,
)
from agent.notify.example_page import example_incident_events
from agent.notify.secrets import scrub
from agent.notify.slack import SlackNotifier
from agent.rules.yaml_source import YamlSyntaxError, parse_located_yaml, read_yaml_file

NOT_CONFIGURED = f"""Slack is not configured. Either
  - a bot token and a channel (threads; needs the chat:write scope):
      export {ENV_BOT_TOKEN}=xoxb-...   {ENV_CHANNEL}=C0123456789
  - or an incoming webhook (no threads):
      export {ENV_WEBHOOK_URL}=https://hooks.slack.com/services/...
  or the same under notify.slack in the agent's YAML config. See docs/slack.md."""

# Longest wait for one Retry-After (seconds) and most rate-limit retries in one run.
MAX_RETRY_WAIT_S = 10.0
MAX_RETRIES = 3

T = TypeVar("T")


def _load_config(path: Path) -> NotifyConfig:
    try:
        data = parse_located_yaml(read_yaml_file(path)).data or {}
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file") from None
    except (YamlSyntaxError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping at the top level")
    section = data.get("notify", data)
    try:
        return NotifyConfig.model_validate(section)
    except ValidationError as exc:
        where = "notify" if "notify" in data else "top level"
        raise ValueError(f"{path} ({where}): {exc}") from None


def _fail(out: TextIO, what: str, exc: DeliveryError) -> None:
    print(f"FAILED: {what}: {exc.code}", file=out)
    print(f"  {scrub(str(exc))}", file=out)
    wait = exc.retry_after if isinstance(exc, TransientDeliveryError) else None
    if wait is not None:
        again = (datetime.now() + timedelta(seconds=wait)).strftime("%H:%M:%S")
        print(f"  Slack asked to wait {wait:g} s (Retry-After); try again after {again}", file=out)
    if exc.hint:
        print(f"  hint: {scrub(exc.hint)}", file=out)


class _RateLimitBudget:
    """Retries of rate-limited calls, shared by every call of one ``slack-test`` run."""

    def __init__(self, out: TextIO, sleep: Callable[[float], None] = time.sleep) -> None:
        self.out = out
        self.sleep = sleep
        self.retries = 0

    def call(self, fn: Callable[[], T]) -> T:
        """``fn()``, again after each 429 whose Retry-After fits the bounds; else raises."""
        while True:
            try:
                return fn()
            except TransientDeliveryError as exc:
                wait = exc.retry_after
                if wait is None or wait > MAX_RETRY_WAIT_S or self.retries >= MAX_RETRIES:
                    raise
                self.retries += 1
                print(
                    f"  rate-limited ({exc.code}); waiting {wait:g} s as Slack asks "
                    f"(retry {self.retries} of at most {MAX_RETRIES})",
                    file=self.out,
                )
                self.sleep(wait)


def cli_slack_test(argv: list[str]) -> int:
    """Entry point of ``mechwatch slack-test``; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="mechwatch slack-test",
        description="Send a test page to the configured Slack destination.",
    )
    parser.add_argument("--config", type=Path, help="agent YAML config (its notify: section)")
    parser.add_argument("--channel", help=f"channel to post to (overrides {ENV_CHANNEL})")
    parser.add_argument("--base-url", help=f"Slack Web API base URL (overrides {ENV_BASE_URL})")
    parser.add_argument("--timeout", type=float, default=None, help="HTTP timeout in seconds")
    args = parser.parse_args(argv)
    out, err = sys.stdout, sys.stderr

    try:
        config = _load_config(args.config) if args.config else NotifyConfig()
        slack_cfg = config.slack
        updates = {}
        if args.channel:
            updates["channel"] = args.channel
        if args.base_url:
            updates["base_url"] = args.base_url
        if args.timeout:
            updates["timeout_s"] = args.timeout
        if updates:
            slack_cfg = type(slack_cfg).model_validate({**slack_cfg.model_dump(), **updates})
        settings = resolve_slack(slack_cfg, os.environ)
    except (ValueError, ValidationError) as exc:
        print(f"FAILED: configuration: {scrub(str(exc))}", file=err)
        return 2
    if settings is None:
        print(NOT_CONFIGURED, file=err)
        return 2

    print(f"Slack destination: {settings.describe()}", file=out)
    # Quick tries: this is interactive, a person is waiting for the verdict.
    notifier = SlackNotifier(settings, DeliveryConfig(connection_retries=0))
    budget = _RateLimitBudget(out)
    if settings.mode == "bot":
        try:
            who = budget.call(notifier.auth_test)
        except DeliveryError as exc:
            _fail(err, "auth.test (is the token valid?)", exc)
            return 1
        print(
            f"ok: auth.test: bot {who.get('user', '?')!r} (user {who.get('user_id', '?')}) "
            f"in workspace {who.get('team', '?')!r} {who.get('url', '')}",
            file=out,
        )

    context = RunContext(run_name="mechwatch slack-test")
    opened, _action, resolved = example_incident_events(context, incident_id="slack-test-0001")
    opened.message = "This is a TEST page from `mechwatch slack-test`; no run is affected."
    try:
        ref = budget.call(lambda: notifier.send(opened, None))
    except DeliveryError as exc:
        _fail(err, "posting the test page", exc)
        return 1
    where = f"to {settings.channel}" if settings.mode == "bot" else "via the webhook"
    print(f"ok: test page posted {where}", file=out)
    try:
        budget.call(lambda: notifier.send(resolved, ref))
    except DeliveryError as exc:
        _fail(err, "posting the threaded reply", exc)
        return 1
    print(
        "ok: reply posted "
        + ("in the page's thread" if ref else "as a new message (webhooks cannot thread)"),
        file=out,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(cli_slack_test(sys.argv[1:]))
