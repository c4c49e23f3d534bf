"""Never lose a page, never send one twice: the outbox across SIGKILL and restarts, the lock,
the console and JSONL notifiers. (Requests in flight at a kill: test_notify_in_doubt.py.)"""

from __future__ import annotations

import io
import json
import time
from pathlib import Path

import pytest
from slack_server import (
    FakeSlack,
    Reply,
    bot_notifier,
    fast_delivery,
    kill_child,
    start_paging_child,
    wait_until,
)

from agent.eventlog import EventLog, read_events
from agent.incidents import IncidentEvent
from agent.notify.base import TransientDeliveryError
from agent.notify.console import ConsoleNotifier
from agent.notify.dispatcher import PageDispatcher
from agent.notify.example_page import example_incident_events
from agent.notify.jsonl import JsonlNotifier
from agent.notify.outbox import Outbox, OutboxLockedError


def _event_ids(posts: list[dict]) -> list[str]:
    return [p["metadata"]["event_payload"]["event_id"] for p in posts]


def test_pages_survive_sigkill_and_are_sent_once(fake: FakeSlack, tmp_path: Path) -> None:
    fake.down()  # nothing can be delivered while the first process lives
    child = start_paging_child(tmp_path, fake)
    kill_child(child)
    fake.up()
    events = example_incident_events()
    with PageDispatcher(
        [bot_notifier(fake)], tmp_path, delivery=fast_delivery(), start=False
    ) as pages:
        assert pages.pending() == 3  # what the killed process left in the outbox
        pages.start()
        assert pages.flush(5)
        for event in events:  # the restarted agent re-emits them: ignored
            pages.submit(event)
        assert pages.flush(1) and pages.pending() == 0
    posts = fake.posts()
    assert _event_ids(posts) == [e.event_id for e in events]
    assert [p.get("thread_ts") for p in posts] == [None, posts[0]["_ts"], posts[0]["_ts"]]
    # A third agent on the same run dir has nothing to send.
    with PageDispatcher([bot_notifier(fake)], tmp_path, delivery=fast_delivery()) as pages:
        assert pages.pending() == 0
        for event in events:
            pages.submit(event)
        assert pages.flush(1)
    assert len(fake.requests_for("chat.postMessage")) == 3


def test_replies_after_restart_go_to_the_first_process_thread(
    fake: FakeSlack, tmp_path: Path
) -> None:
    # The opening page gets through, then Slack fails until the process is killed.
    fake.script("chat.postMessage", Reply.normal(), *[Reply.server_error()] * 1000)
    child = start_paging_child(tmp_path, fake)
    assert wait_until(lambda: len(fake.requests_for("chat.postMessage")) >= 3, timeout=10)
    kill_child(child)
    opened = fake.posts()
    assert _event_ids(opened) == ["fa_precision-0001:opened:0"]
    fake.clear_scripts()  # Slack is healthy again
    with PageDispatcher(
        [bot_notifier(fake)], tmp_path, delivery=fast_delivery(), start=False
    ) as pages:
        assert pages.pending() == 2
        pages.start()
        assert pages.flush(5)
    posts = fake.posts()
    assert _event_ids(posts) == [
        "fa_precision-0001:opened:0",
        "fa_precision-0001:action:1",
        "fa_precision-0001:resolved:2",
    ]
    assert [p.get("thread_ts") for p in posts] == [None, opened[0]["_ts"], opened[0]["_ts"]]


def test_torn_journal_line_is_tolerated(tmp_path: Path) -> None:
    events = example_incident_events()
    outbox = Outbox(tmp_path, ["a", "b"])
    for event in events:
        assert outbox.add(event)
    outbox.mark_done("a", events[0], ref="#c|1.0")
    outbox._file.write('{"op": "done", "notifier": "b", "id": "fa_prec')  # killed mid-write
    outbox._file.flush()
    outbox._lock_file.close()  # as if the process died
    outbox._file.close()
    outbox = Outbox(tmp_path, ["a", "b"])
    assert outbox.pending() == 3
    assert outbox.pending_for("a") == 2 and outbox.pending_for("b") == 3
    assert outbox.next_for("a") is not None and outbox.next_for("a").event_id == events[1].event_id
    assert outbox.thread_for("a", "fa_precision-0001") == "#c|1.0"
    assert not outbox.add(events[0])  # already known
    outbox.close()
    # Compaction keeps exactly the state: a snapshot plus the 3 pending events.
    lines = (tmp_path / "outbox.jsonl").read_text().splitlines()
    assert len(lines) == 4 and json.loads(lines[0])["op"] == "snapshot"


def test_fully_delivered_events_are_compacted_but_remembered(tmp_path: Path) -> None:
    events = example_incident_events()
    outbox = Outbox(tmp_path, ["a"])
    for event in events:
        outbox.add(event)
        outbox.mark_done("a", event)
    assert outbox.pending() == 0
    outbox.close()
    lines = (tmp_path / "outbox.jsonl").read_text().splitlines()
    assert len(lines) == 1  # only the snapshot: event bodies are gone
    outbox = Outbox(tmp_path, ["a"])
    assert all(outbox.known(e.event_id) and not outbox.add(e) for e in events)
    # A notifier added later gets only what is still pending (nothing here).
    outbox.close()
    outbox = Outbox(tmp_path, ["a", "console"])
    assert outbox.pending() == 0
    outbox.close()


def test_one_live_process_per_outbox(tmp_path: Path) -> None:
    first = PageDispatcher([ConsoleNotifier(io.StringIO())], tmp_path)
    with pytest.raises(OutboxLockedError, match="in use by another live process"):
        PageDispatcher([ConsoleNotifier(io.StringIO())], tmp_path)
    first.close()
    PageDispatcher([ConsoleNotifier(io.StringIO())], tmp_path).close()


def test_slow_slack_does_not_delay_console_or_jsonl(fake: FakeSlack, tmp_path: Path) -> None:
    fake.down()
    console = io.StringIO()
    log = EventLog(tmp_path / "events.jsonl")
    notifiers = [bot_notifier(fake), ConsoleNotifier(console), JsonlNotifier(log)]
    pages = PageDispatcher(notifiers, tmp_path, delivery=fast_delivery())
    events = example_incident_events()
    started = time.perf_counter()
    for event in events:
        pages.submit(event)
    submit_s = (time.perf_counter() - started) / len(events)
    assert wait_until(lambda: console.getvalue().count("[mechwatch page]") == 3)
    assert wait_until(lambda: len(read_events(log.path, "page")) == 3)
    assert pages.pending() == 3  # Slack still owes all three
    assert not pages.close(0.2)
    print(f"submit() with an fsync'd outbox append: {submit_s * 1e3:.2f} ms per event")
    assert submit_s < 0.5
    text = console.getvalue()
    assert "[CRITICAL] fa_precision: biased low-precision attention backward" in text
    assert "[RESOLVED] fa_precision incident fa_precision-0001 at step 6,000" in text
    records = read_events(log.path, "page")
    assert [r["event_id"] for r in records] == [e.event_id for e in events]
    assert records[0]["step"] == 5200 and records[0]["family"] == "fa_precision"
    assert IncidentEvent.from_dict(records[1]["event"]).incident.actions[0].action == (
        "attention_fp32_backward"
    )
    # Restart with Slack up: Slack gets its three, console and JSONL nothing new.
    fake.up()
    console2 = io.StringIO()
    log2 = EventLog(tmp_path / "events.jsonl")
    notifiers = [bot_notifier(fake), ConsoleNotifier(console2), JsonlNotifier(log2)]
    with PageDispatcher(notifiers, tmp_path, delivery=fast_delivery()) as pages:
        assert pages.flush(5)
    assert len(fake.posts()) == 3
    assert console2.getvalue() == ""
    assert len(read_events(log2.path, "page")) == 3
    log.close()


class FlakyNotifier:
    """Fails with a transient error ``failures`` times, then records what it gets."""

    name = "flaky"

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.sent: list[tuple[str, str | None]] = []
        self.events: list[IncidentEvent] = []

    def send(self, event: IncidentEvent, thread: str | None) -> str | None:
        if self.failures:
            self.failures -= 1
            raise TransientDeliveryError("try later", code="flaky", retry_after=0.01)
        self.sent.append((event.event_id, thread))
        self.events.append(event)
        return f"ref-{event.event_id}"

    def close(self) -> None:
        pass


class BrokenNotifier(FlakyNotifier):
    name = "broken"

    def send(self, event: IncidentEvent, thread: str | None) -> str | None:
        raise RuntimeError("a bug in a notifier")


def test_custom_notifier_threads_and_order(tmp_path: Path) -> None:
    flaky = FlakyNotifier(failures=3)
    with PageDispatcher([flaky], tmp_path, delivery=fast_delivery(), start=False) as pages:
        events = example_incident_events()
        for event in events:
            pages.submit(event)
        events[0].incident.severity = "info"  # the caller keeps changing its incident
        pages.start()
        assert pages.flush(5)
    assert flaky.events[0].incident.severity == "critical"  # paged as submitted
    root = "ref-fa_precision-0001:opened:0"
    assert flaky.sent == [
        ("fa_precision-0001:opened:0", None),
        ("fa_precision-0001:action:1", root),
        ("fa_precision-0001:resolved:2", root),
    ]


def test_a_broken_notifier_never_reaches_the_training_thread(tmp_path: Path) -> None:
    console = io.StringIO()
    pages = PageDispatcher(
        [BrokenNotifier(0), ConsoleNotifier(console)],
        tmp_path,
        delivery=fast_delivery(max_attempts=2, retry_initial_s=0.01),
    )
    pages.submit(example_incident_events()[0])  # does not raise
    assert wait_until(lambda: "[mechwatch page]" in console.getvalue())
    assert wait_until(lambda: pages.status()["broken"].parked)
    assert "RuntimeError: a bug in a notifier" in pages.status()["broken"].last_error
    assert not pages.close(0.1)
    pages.submit(example_incident_events()[1])  # after close: logged, not raised


def test_without_run_dir_pages_still_flow(tmp_path: Path) -> None:
    console = io.StringIO()
    with PageDispatcher([ConsoleNotifier(console)], None) as pages:
        pages.submit(example_incident_events()[0])
        assert pages.flush(5)
    assert "[CRITICAL]" in console.getvalue()
    assert not any(tmp_path.iterdir())


def test_dispatcher_arguments_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="at least one notifier"):
        PageDispatcher([], tmp_path)
    with pytest.raises(ValueError, match="unique"):
        PageDispatcher([ConsoleNotifier(), ConsoleNotifier()], tmp_path)
