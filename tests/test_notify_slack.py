"""Slack delivery with the real slack-sdk against a local fake Slack (tests/slack_server.py):
threads, Retry-After, 5xx, connection refused, permanent errors, webhooks."""

from __future__ import annotations

import copy
import logging
import time
from pathlib import Path

import pytest
from slack_server import (
    CHANNEL_ID,
    FakeSlack,
    Reply,
    bot_notifier,
    fast_delivery,
    wait_until,
    webhook_notifier,
)

from agent.notify.dispatcher import PageDispatcher
from agent.notify.example_page import example_incident_events


def _errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.ERROR and r.name.startswith("mechwatch")
    ]


def test_incident_is_one_thread(fake: FakeSlack, tmp_path: Path) -> None:
    opened, action, resolved = example_incident_events()
    escalated = copy.deepcopy(opened)
    escalated.kind, escalated.seq, escalated.step = "escalated", 3, 5300
    with PageDispatcher([bot_notifier(fake)], tmp_path, delivery=fast_delivery()) as pages:
        for event in (opened, action, escalated, resolved):
            pages.submit(event)
        assert pages.flush(5)
        assert pages.pending() == 0
    posts = fake.posts()
    assert len(posts) == 4 and len(fake.requests) == 4  # no retries, no duplicates
    root = posts[0]
    assert "thread_ts" not in root and root["channel"] == "#alerts"
    assert root["blocks"][0]["type"] == "header" and "CRITICAL" in root["text"]
    assert root["metadata"]["event_payload"]["event_id"] == "fa_precision-0001:opened:0"
    # Every later event is a reply in the opening message's thread, in order.
    assert [p.get("thread_ts") for p in posts[1:]] == [root["_ts"]] * 3
    assert [p["metadata"]["event_payload"]["kind"] for p in posts] == [
        "opened",
        "action",
        "escalated",
        "resolved",
    ]
    # Escalations are broadcast to the channel too; other replies stay in the thread.
    assert [p.get("reply_broadcast") for p in posts[1:]] == [None, True, None]
    assert "Action · attention_fp32_backward" in posts[1]["blocks"][0]["text"]["text"]
    assert "Resolved" in posts[3]["blocks"][0]["text"]["text"]
    assert "Re: incident" not in str(posts[3]["blocks"])  # in a thread it is implied
    # The bearer token was sent as a header, never in the body.
    assert fake.requests[0].headers["authorization"] == f"Bearer {fake.token}"
    assert all(fake.token not in str(r.body) for r in fake.requests)


def test_rate_limit_honours_retry_after(fake: FakeSlack, tmp_path: Path) -> None:
    fake.script("chat.postMessage", Reply.ratelimited(retry_after=1))
    with PageDispatcher([bot_notifier(fake)], tmp_path, delivery=fast_delivery()) as pages:
        pages.submit(example_incident_events()[0])
        assert pages.flush(5)
    attempts = fake.requests_for("chat.postMessage")
    assert [r.status for r in attempts] == [429, 200]
    waited = attempts[1].time - attempts[0].time
    print(f"429 Retry-After 1 s: waited {waited:.3f} s before the retry")
    assert 1.0 <= waited < 1.8
    assert len(fake.posts()) == 1


def test_server_errors_then_success(
    fake: FakeSlack, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="mechwatch")
    fake.script("chat.postMessage", Reply.server_error(500), Reply.server_error(503))
    delivery = fast_delivery(retry_initial_s=0.1)
    with PageDispatcher([bot_notifier(fake)], tmp_path, delivery=delivery) as pages:
        pages.submit(example_incident_events()[0])
        assert pages.flush(5)
        status = pages.status()["slack"]
    attempts = fake.requests_for("chat.postMessage")
    assert [r.status for r in attempts] == [500, 503, 200]
    gaps = [b.time - a.time for a, b in zip(attempts, attempts[1:], strict=False)]
    # Exponential backoff with +-20% jitter: ~0.1 s, then ~0.2 s.
    assert 0.08 <= gaps[0] < 0.6 and 0.16 <= gaps[1] < 0.8, gaps
    assert len(fake.posts()) == 1 and status.delivered == 1 and status.failures == 0
    warnings = [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and r.name.startswith("mechwatch")
    ]
    assert len(warnings) == 1 and "http_500" in warnings[0]  # one warning per outage
    assert any("delivers again" in r.getMessage() for r in caplog.records)


def test_connection_refused_then_up(fake: FakeSlack, tmp_path: Path) -> None:
    notifier = bot_notifier(fake)
    fake.down()
    with PageDispatcher([notifier], tmp_path, delivery=fast_delivery()) as pages:
        for event in example_incident_events():
            pages.submit(event)
        assert wait_until(lambda: pages.status()["slack"].failures >= 2)
        assert pages.status()["slack"].last_code == "connection_refused"
        assert not pages.flush(0.1) and pages.pending() == 3
        fake.up()
        assert pages.flush(5)
    posts = fake.posts()
    assert len(posts) == 3  # nothing lost, nothing twice
    assert [p.get("thread_ts") for p in posts] == [None, posts[0]["_ts"], posts[0]["_ts"]]


@pytest.mark.parametrize(
    ("token", "channel", "code", "hint"),
    [
        ("xoxb-0000-0000-WRONGtokenVALUE", "#alerts", "invalid_auth", "SLACK_BOT_TOKEN"),
        (None, "#no-such-channel", "channel_not_found", "MECHWATCH_SLACK_CHANNEL"),
    ],
)
def test_permanent_error_is_reported_once_without_a_storm(
    fake: FakeSlack,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    token: str | None,
    channel: str,
    code: str,
    hint: str,
) -> None:
    events = example_incident_events()
    delivery = fast_delivery(recheck_s=30)
    notifier = bot_notifier(fake, token=token, channel=channel, delivery=delivery)
    with PageDispatcher([notifier], tmp_path, delivery=delivery, start=False) as pages:
        for event in events:
            pages.submit(event)
        pages.start()
        started = time.monotonic()
        assert not pages.flush(5)  # gives up early: waiting would not help
        assert time.monotonic() - started < 2
        time.sleep(0.5)  # a storm would show up here
        status = pages.status()["slack"]
        assert status.parked and status.last_code == code
        assert pages.pending() == 3
        pages.submit(example_incident_events(incident_id="other")[0])  # no retry on submit
        time.sleep(0.2)
    assert len(fake.requests_for("chat.postMessage")) == 1
    errors = _errors(caplog)
    assert len(errors) == 1, errors
    assert code in errors[0] and "Hint:" in errors[0] and hint in errors[0]
    assert "3 page(s) kept in the outbox" in errors[0]
    # Fixed configuration + restart: everything is delivered, in one thread per incident.
    with PageDispatcher(
        [bot_notifier(fake)], tmp_path, delivery=fast_delivery(), start=False
    ) as pages:
        assert pages.pending() == 4  # loaded from the outbox
        pages.start()
        assert pages.flush(5)
    posts = fake.posts()
    assert [p["metadata"]["event_payload"]["event_id"] for p in posts] == [
        e.event_id for e in events
    ] + ["other:opened:0"]
    assert [p.get("thread_ts") for p in posts] == [None, posts[0]["_ts"], posts[0]["_ts"], None]


def test_parked_notifier_rechecks_and_recovers(fake: FakeSlack, tmp_path: Path) -> None:
    fake.script("chat.postMessage", Reply.error("not_in_channel"))
    delivery = fast_delivery(recheck_s=0.3)
    with PageDispatcher(
        [bot_notifier(fake, delivery=delivery)], tmp_path, delivery=delivery
    ) as pages:
        pages.submit(example_incident_events()[0])
        assert wait_until(lambda: pages.status()["slack"].parked)
        # The bot was invited meanwhile: the recheck delivers without a restart.
        assert wait_until(lambda: pages.pending() == 0, timeout=3)
    attempts = fake.requests_for("chat.postMessage")
    assert [r.status for r in attempts] == [200, 200]
    assert attempts[1].time - attempts[0].time >= 0.25
    assert len(fake.posts()) == 1


def test_retries_used_up_park_the_notifier(
    fake: FakeSlack, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fake.script("chat.postMessage", *[Reply.server_error()] * 10)
    delivery = fast_delivery(max_attempts=3, retry_initial_s=0.01)
    with PageDispatcher(
        [bot_notifier(fake, delivery=delivery)], tmp_path, delivery=delivery
    ) as pages:
        pages.submit(example_incident_events()[0])
        assert not pages.flush(3)
        assert pages.status()["slack"].parked
        time.sleep(0.2)
    assert len(fake.requests_for("chat.postMessage")) == 3
    errors = _errors(caplog)
    assert len(errors) == 1 and "failed 3 times in a row" in errors[0]


def test_malformed_blocks_fall_back_to_text(fake: FakeSlack, tmp_path: Path) -> None:
    fake.script("chat.postMessage", Reply.error("invalid_blocks"))
    with PageDispatcher([bot_notifier(fake)], tmp_path, delivery=fast_delivery()) as pages:
        pages.submit(example_incident_events()[0])
        assert pages.flush(5)
    attempts = fake.requests_for("chat.postMessage")
    assert len(attempts) == 2 and "blocks" in attempts[0].body and "metadata" in attempts[0].body
    assert "blocks" not in attempts[1].body and attempts[1].body["text"].startswith("[CRITICAL]")
    assert "metadata" not in attempts[1].body


def test_rejected_message_is_recorded_and_the_queue_moves_on(
    fake: FakeSlack, tmp_path: Path
) -> None:
    fake.script("chat.postMessage", Reply.error("msg_too_long"), Reply.error("msg_too_long"))
    events = example_incident_events()
    with PageDispatcher([bot_notifier(fake)], tmp_path, delivery=fast_delivery()) as pages:
        for event in events:
            pages.submit(event)
        assert pages.flush(5)
        assert pages.status()["slack"].rejected == 1
    posts = fake.posts()
    # The opening page was lost to Slack; the next one opens the thread and quotes the id.
    assert len(posts) == 2 and "thread_ts" not in posts[0]
    assert "Re: incident `fa_precision-0001`" in str(posts[0]["blocks"])
    assert posts[1]["thread_ts"] == posts[0]["_ts"]


def test_webhook_pages_quote_the_incident(fake: FakeSlack, tmp_path: Path) -> None:
    fake.script("webhook", Reply.server_error(500), Reply.ratelimited(0))
    with PageDispatcher([webhook_notifier(fake)], tmp_path, delivery=fast_delivery()) as pages:
        for event in example_incident_events():
            pages.submit(event)
        assert pages.flush(5)
    assert [r.status for r in fake.requests_for("webhook")] == [500, 429, 200, 200, 200]
    posts = fake.webhook_posts()
    assert len(posts) == 3
    assert all("thread_ts" not in p for p in posts)
    assert "Re: incident" not in str(posts[0]["blocks"])
    assert all("Re: incident `fa_precision-0001`" in str(p["blocks"]) for p in posts[1:])
    assert "[RESOLVED]" in posts[2]["text"]


def test_webhook_permanent_error(
    fake: FakeSlack, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fake.script("webhook", *[Reply.error("no_service", status=404)] * 5)
    with PageDispatcher([webhook_notifier(fake)], tmp_path, delivery=fast_delivery()) as pages:
        pages.submit(example_incident_events()[0])
        assert not pages.flush(3)
        assert pages.status()["slack"].last_code == "no_service"
        time.sleep(0.3)
    assert len(fake.requests_for("webhook")) == 1
    errors = _errors(caplog)
    assert len(errors) == 1 and "create a new webhook URL" in errors[0]


def test_channel_id_in_answer_does_not_break_threads(fake: FakeSlack, tmp_path: Path) -> None:
    # Slack answers with the channel ID even when a name was configured; threads key on the
    # configured channel, so replies still thread.
    assert fake.posts() == []
    with PageDispatcher(
        [bot_notifier(fake, channel=CHANNEL_ID)], tmp_path, delivery=fast_delivery()
    ) as pages:
        for event in example_incident_events()[:2]:
            pages.submit(event)
        assert pages.flush(5)
    posts = fake.posts()
    assert posts[1]["thread_ts"] == posts[0]["_ts"]
    # A restart with another channel starts a new thread there instead of a broken reply.
    with PageDispatcher(
        [bot_notifier(fake, channel="#alerts")], tmp_path, delivery=fast_delivery()
    ) as pages:
        pages.submit(example_incident_events()[2])
        assert pages.flush(5)
    last = fake.posts()[-1]
    assert "thread_ts" not in last and "Re: incident" in str(last["blocks"])
