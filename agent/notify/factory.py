"""Build the notifiers (and the dispatcher) a configuration asks for.

Slack when a destination is configured (config or environment), else the console; the
JSONL notifier whenever an event log is given (or ``notify.event_log`` names one).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TextIO

from agent.eventlog import EventLog
from agent.notify.base import Notifier
from agent.notify.config import NotifyConfig, resolve_slack
from agent.notify.console import ConsoleNotifier
from agent.notify.dispatcher import PageDispatcher
from agent.notify.jsonl import JsonlNotifier
from agent.notify.secrets import get_logger
from agent.notify.slack import SlackNotifier

log = get_logger("mechwatch.notify")


def build_notifiers(
    config: NotifyConfig | None,
    run_dir: str | Path | None,
    *,
    event_log: EventLog | None = None,
    env: Mapping[str, str] | None = None,
    console_stream: TextIO | None = None,
) -> list[Notifier]:
    """Notifiers for ``config``. Raises ``ValueError`` for an incomplete Slack setup.

    ``event_log`` is the agent's own log (left open on close); without it a relative
    ``config.event_log`` is opened under ``run_dir`` and closed with the notifier.
    """
    config = config or NotifyConfig()
    notifiers: list[Notifier] = []
    slack = resolve_slack(config.slack, env)
    if slack is not None:
        notifiers.append(SlackNotifier(slack, config.delivery))
        log.info("pages go to %s", slack.describe())
    if config.console == "always" or (config.console == "auto" and slack is None):
        notifiers.append(ConsoleNotifier(console_stream))
        if slack is None and config.console == "auto":
            log.info(
                "Slack is not configured (set SLACK_BOT_TOKEN and MECHWATCH_SLACK_CHANNEL, "
                "or SLACK_WEBHOOK_URL); pages go to the console"
            )
    if event_log is not None:
        notifiers.append(JsonlNotifier(event_log))
    elif config.event_log is not None:
        path = Path(config.event_log)
        if not path.is_absolute():
            if run_dir is None:
                raise ValueError(
                    f"notify.event_log {str(path)!r} is relative but there is no "
                    "run dir to put it in"
                )
            path = Path(run_dir) / path
        notifiers.append(JsonlNotifier(EventLog(path), owns_log=True))
    if not notifiers:
        log.warning(
            "notify: console is 'never', Slack is not configured and there is no event "
            "log; pages go nowhere"
        )
    return notifiers


def build_dispatcher(
    config: NotifyConfig | None,
    run_dir: str | Path | None,
    *,
    event_log: EventLog | None = None,
    env: Mapping[str, str] | None = None,
    notifiers: Sequence[Notifier] | None = None,
) -> PageDispatcher | None:
    """A started ``PageDispatcher`` over ``notifiers`` (default: ``build_notifiers``); None
    if pages go nowhere."""
    config = config or NotifyConfig()
    if notifiers is None:
        notifiers = build_notifiers(config, run_dir, event_log=event_log, env=env)
    if not notifiers:
        return None
    return PageDispatcher(list(notifiers), run_dir, delivery=config.delivery)
