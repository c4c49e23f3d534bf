"""Keep Slack credentials out of every log line, event log and outbox file.

Tokens and webhook URLs are registered once, when the configuration is resolved; ``scrub``
replaces every registered value, and anything shaped like a Slack token or webhook URL, by
a fixed mask. ``get_logger`` returns a logger whose records are scrubbed before any handler
sees them, because slack-sdk errors and debug traces can echo request data.
"""

from __future__ import annotations

import logging
import re
import threading

MASK = "[REDACTED]"
# Shorter strings are not registered: masking "abc" everywhere would shred unrelated text.
MIN_SECRET_LENGTH = 8

# Slack token families (bot, user, app, config, refresh, legacy) and incoming-webhook URLs.
_SLACK_TOKEN = re.compile(r"xox[abeoprs]-[A-Za-z0-9\-]+|xapp-[A-Za-z0-9\-]+")
_SLACK_WEBHOOK = re.compile(r"hooks\.slack(?:-gov)?\.com/(?:services|workflows|triggers)/\S+")

_lock = threading.Lock()
_secrets: set[str] = set()


def register_secret(value: str | None) -> None:
    """Mask ``value`` (and its URL path, for webhook URLs) in everything ``scrub`` touches."""
    if not value:
        return
    value = value.strip()
    if len(value) < MIN_SECRET_LENGTH:
        return
    with _lock:
        _secrets.add(value)
        # A webhook URL's secret part is its path; some errors print only the path.
        if "://" in value:
            path = value.split("://", 1)[1].partition("/")[2]
            if len(path) >= MIN_SECRET_LENGTH:
                _secrets.add("/" + path)


def scrub(text: str) -> str:
    """``text`` with every registered secret and every Slack-token-shaped string masked."""
    with _lock:
        secrets = sorted(_secrets, key=len, reverse=True)  # longest first: a URL before its path
    for secret in secrets:
        if secret in text:
            text = text.replace(secret, MASK)
    text = _SLACK_TOKEN.sub(MASK, text)
    return _SLACK_WEBHOOK.sub("hooks.slack.com/" + MASK, text)


class ScrubSecretsFilter(logging.Filter):
    """Rewrites a record's message (and exception text) with secrets masked."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a malformed %-format: leave it to the handler to report
            return True
        record.msg = scrub(message)
        record.args = None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = scrub(record.exc_text)
        return True


_SCRUB_FILTER = ScrubSecretsFilter()


def get_logger(name: str) -> logging.Logger:
    """``logging.getLogger(name)`` with the scrubbing filter attached (once)."""
    logger = logging.getLogger(name)
    if _SCRUB_FILTER not in logger.filters:
        logger.addFilter(_SCRUB_FILTER)
    return logger
