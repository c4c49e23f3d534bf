"""A page whose request was in flight when the process died (or timed out waiting for the
answer) is looked up in Slack before it is sent again: exactly once with the history scope,
at least once (sent again, one warning naming the scope) without it.

The local Slack (tests/slack_server.py) stores a posted message and then holds its answer
back; a child process paging through it is SIGKILLed meanwhile."""

from __future__ import annotations

import json
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
    kill_child,
    start_paging_child,
    wait_until,
    webhook_notifier,
)

import agent.notify.slack as slack_module
from agent.incidents import IncidentEvent
from agent.notify.base import LookupUnavailableError
from agent.notify.dispatcher import PageDispatcher
from agent.notify.example_page import example_incident_events
from agent.notify.outbox import JOURNAL_NAME, OUTBOX_DIRNAME, Outbox
from agent.notify.slack import LOOKUP_MARGIN_S

INCIDENT = "fa_precision-0001"
IDS = [e.event_id for e in example_incident_events()]  # opened, action, resolved


def _event_ids(posts: list[dict]) -> list[str]:
    return [p["metadata"]["event_payload"]["event_id"] for p in posts]


def _kill_while_posting(run_dir: Path, fake: FakeSlack, in_flight: int) -> None:
    """A child pages the three events; it is killed while post ``in_flight`` (0-based) waits
    for its answer, which the server holds back after storing (or refusing) the message."""
    fake.hold("chat.postMessage", *[0.0] * in_flight, 60.0)
    child = start_paging_child(run_dir, fake, channel=CHANNEL_ID)
    assert wait_until(fake.holding.is_set, timeout=15), "the child never posted"
    kill_child(child)
    assert len(fake.requests_for("chat.postMessage")) == in_flight + 1


def _restart(run_dir: Path, fake: FakeSlack, pending: int) -> None:
    """A new dispatcher on the same run dir delivers the ``pending`` events the child left."""
    notifier = bot_notifier(fake, channel=CHANNEL_ID)
    with PageDispatcher([notifier], run_dir, delivery=fast_delivery(), start=False) as pages:
        assert pages.pending() == pending
        pages.start()
        assert pages.flush(5)


def _snapshot(outbox_dir: Path) -> dict:
    """The compacted outbox journal's first record (after a clean close)."""
    return json.loads((outbox_dir / JOURNAL_NAME).read_text().splitlines()[0])


@pytest.mark.parametrize(
    ("in_flight", "lookup"), [(0, "conversations.history"), (1, "conversations.replies")]
)
def test_page_in_flight_at_sigkill_is_delivered_once(
    fake: FakeSlack, tmp_path: Path, in_flight: int, lookup: str
) -> None:
    _kill_while_posting(tmp_path, fake, in_flight)
    root_ts = fake.posts()[0]["_ts"]
    attempted = time.time()
    _restart(tmp_path, fake, pending=3 - in_flight)
    posts = fake.posts()
    assert _event_ids(posts) == IDS  # the in-flight page exactly once, nothing lost
    assert [p.get("thread_ts") for p in posts] == [None, root_ts, root_ts]
    # One lookup, where the page would be: the channel, or the incident's thread.
    history = fake.requests_for("conversations.history")
    replies = fake.requests_for("conversations.replies")
    looked = history + replies
    assert [r.method for r in looked] == [lookup]
    body = looked[0].body
    assert body["channel"] == CHANNEL_ID and body["include_all_metadata"] in ("1", "true")
    assert attempted - LOOKUP_MARGIN_S - 30 < float(body["oldest"]) < float(root_ts)
    if lookup == "conversations.replies":
        assert body["ts"] == root_ts
    # The outbox marks it done with the ts Slack gave the message: the thread is kept.
    snapshot = _snapshot(tmp_path / OUTBOX_DIRNAME)
    assert snapshot["threads"]["slack"][INCIDENT] == f"{CHANNEL_ID}|{root_ts}"
    assert sorted(snapshot["done"]["slack"]) == sorted(IDS) and snapshot["attempts"] == {}
    # Later events of the same incident still reply in that thread.
    later = example_incident_events()[2]
    later.kind, later.seq = "repeat", 3
    with PageDispatcher(
        [bot_notifier(fake, channel=CHANNEL_ID)], tmp_path, delivery=fast_delivery()
    ) as pages:
        pages.submit(later)
        assert pages.flush(5)
    assert fake.posts()[-1]["thread_ts"] == root_ts and len(fake.posts()) == 4
    assert len(fake.requests_for("conversations.history")) == len(history)  # no more lookups


def test_in_doubt_page_that_never_arrived_is_sent_once(fake: FakeSlack, tmp_path: Path) -> None:
    # Slack fails the opening page (nothing stored), but the answer never reaches the child.
    fake.script("chat.postMessage", Reply.server_error())
    _kill_while_posting(tmp_path, fake, 0)
    assert fake.posts() == []
    _restart(tmp_path, fake, pending=3)
    posts = fake.posts()
    assert _event_ids(posts) == IDS
    assert [p.get("thread_ts") for p in posts] == [None, posts[0]["_ts"], posts[0]["_ts"]]
    assert len(fake.requests_for("conversations.history")) == 1  # looked, found nothing
    assert (
        _snapshot(tmp_path / OUTBOX_DIRNAME)["threads"]["slack"][INCIDENT]
        == f"{CHANNEL_ID}|{posts[0]['_ts']}"
    )


def test_timed_out_request_is_looked_up_not_repeated(fake: FakeSlack, tmp_path: Path) -> None:
    fake.hold("chat.postMessage", 1.6)  # stored, answered after the client's 1 s timeout
    notifier = bot_notifier(fake, channel=CHANNEL_ID, timeout_s=1)
    with PageDispatcher([notifier], tmp_path, delivery=fast_delivery()) as pages:
        for event in example_incident_events():
            pages.submit(event)
        assert pages.flush(6)
        status = pages.status()["slack"]
    assert status.delivered == 3 and status.failures == 0
    assert [r.status for r in fake.requests_for("chat.postMessage")] == [200, 200, 200]
    posts = fake.posts()
    assert _event_ids(posts) == IDS
    assert [p.get("thread_ts") for p in posts] == [None, posts[0]["_ts"], posts[0]["_ts"]]
    assert len(fake.requests_for("conversations.history")) == 1


def test_without_history_scope_in_doubt_pages_are_sent_again_with_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="mechwatch")
    opened, action, resolved = example_incident_events()
    with FakeSlack(scopes=("chat:write",)) as fake:
        # Two pages time out after Slack stored them; the lookup is refused (missing_scope).
        fake.hold("chat.postMessage", 1.6, 0.0, 1.6)
        notifier = bot_notifier(fake, channel=CHANNEL_ID, timeout_s=1)
        with PageDispatcher([notifier], tmp_path, delivery=fast_delivery()) as pages:
            for event in (opened, action, resolved):
                pages.submit(event)
            assert pages.flush(8)
        lookups = fake.requests_for("conversations.history") + fake.requests_for(
            "conversations.replies"
        )
        posts = fake.posts()
    assert [r.status for r in lookups] == [200, 200]  # both answered ok=false, missing_scope
    # At least once: each in-doubt page shows twice, the rest once; threads keep working.
    assert _event_ids(posts) == [IDS[0], IDS[0], IDS[1], IDS[1], IDS[2]]
    assert [p.get("thread_ts") for p in posts[2:]] == [posts[1]["_ts"]] * 3
    warnings = [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and "got through" in r.getMessage()
    ]
    assert len(warnings) == 1, warnings
    assert "missing_scope" in warnings[0] and "channels:history" in warnings[0]
    assert "sending it again" in warnings[0]


def test_lookup_unavailable_for_webhooks_and_channel_names(fake: FakeSlack) -> None:
    opened = example_incident_events()[0]
    with pytest.raises(LookupUnavailableError, match="webhook") as info:
        webhook_notifier(fake).find_delivered(opened, None, time.time())
    assert "channels:history" in info.value.hint
    named = bot_notifier(fake, channel="#alerts")
    with pytest.raises(LookupUnavailableError, match="is a name") as info:
        named.find_delivered(opened, None, time.time())
    assert "C0123456789" in info.value.hint
    assert fake.requests == []
    # Once Slack has told it the channel's ID (any answered post), the name works too.
    named.send(example_incident_events(incident_id="other")[0], None)
    assert named.find_delivered(opened, None, time.time()) is None
    assert fake.requests_for("conversations.history")[0].body["channel"] == CHANNEL_ID


def test_lookup_matches_the_run_not_just_the_event_id(fake: FakeSlack) -> None:
    # Incident ids repeat across runs: another run's page with the same event id is not ours.
    notifier = bot_notifier(fake, channel=CHANNEL_ID)
    ours = example_incident_events()[0]
    theirs = IncidentEvent.from_dict(ours.to_dict())
    theirs.context.run_name = "another-run"
    started = time.time()
    ref = notifier.send(theirs, None)
    assert notifier.find_delivered(ours, None, started) is None
    assert notifier.find_delivered(theirs, None, started) == ref


def test_lookup_pages_through_a_busy_channel(
    fake: FakeSlack, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(slack_module, "LOOKUP_PAGE", 2)  # 2 messages a call, 5 calls at most
    notifier = bot_notifier(fake, channel=CHANNEL_ID)
    started = time.time()
    events = [example_incident_events(incident_id=f"i{k:03d}")[0] for k in range(5)]
    refs = [notifier.send(e, None) for e in events]
    # Newest first: the oldest message is on the third call.
    assert notifier.find_delivered(events[0], None, started) == refs[0]
    assert len(fake.requests_for("conversations.history")) == 3
    for k in range(10):
        notifier.send(example_incident_events(incident_id=f"j{k:03d}")[0], None)
    with pytest.raises(LookupUnavailableError, match="more than 10 messages"):
        notifier.find_delivered(events[0], None, started)
    assert len(fake.requests_for("conversations.history")) == 3 + 5


def test_attempts_survive_a_crash_and_compaction(tmp_path: Path) -> None:
    opened, action, _ = example_incident_events()
    outbox = Outbox(tmp_path, ["slack", "console"])
    outbox.add(opened)
    outbox.add(action)
    outbox.mark_attempt("slack", opened, 1000.0)
    outbox.mark_attempt("slack", opened, 1005.0)  # a retry: the earliest attempt counts
    outbox.mark_attempt("console", opened, 1001.0)
    outbox.mark_done("console", opened)
    outbox.mark_attempt("slack", action, 1010.0)
    outbox.clear_attempt("slack", action.event_id)  # Slack answered "no": not in doubt
    assert outbox.in_doubt_since("slack", opened.event_id) == 1000.0
    assert outbox.in_doubt_since("console", opened.event_id) is None
    assert outbox.in_doubt_since("slack", action.event_id) is None
    outbox._file.close()  # killed: no compaction, the lock dies with the process
    outbox._lock_file.close()
    outbox = Outbox(tmp_path, ["slack", "console"])  # replays the journal
    assert outbox.in_doubt_since("slack", opened.event_id) == 1000.0
    assert outbox.in_doubt_since("slack", action.event_id) is None
    outbox.close()
    outbox = Outbox(tmp_path, ["slack", "console"])  # loads the compacted snapshot
    assert _snapshot(tmp_path)["attempts"] == {"slack": {opened.event_id: 1000.0}}
    assert outbox.in_doubt_since("slack", opened.event_id) == 1000.0
    outbox.mark_done("slack", opened, ref="C1|1.0")
    assert outbox.in_doubt_since("slack", opened.event_id) is None
    outbox.close()
    assert _snapshot(tmp_path)["attempts"] == {}
