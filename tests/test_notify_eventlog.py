"""EventLog: JSONL records, torn-line tolerance, thread safety, fsync policy, no secrets."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from agent.eventlog import EventLog, iter_jsonl, read_events
from agent.notify.secrets import MASK, register_secret


def test_records_have_time_kind_step_and_payload(tmp_path: Path) -> None:
    path = tmp_path / "run" / "events.jsonl"  # parent is created
    with EventLog(path) as log:
        assert log.write("metric", 3, metric="loss", value=2.5)
        assert log.write("alert", 4, rule="r1", labels={"layer": "l0"}, value=np.float32(0.25))
    records = read_events(path)
    assert [r["kind"] for r in records] == ["metric", "alert"]
    assert records[0]["step"] == 3 and records[0]["value"] == 2.5
    assert records[1]["value"] == 0.25 and records[1]["labels"] == {"layer": "l0"}
    assert all(isinstance(r["time"], float) and r["time"] > 1.6e9 for r in records)
    assert read_events(path, "alert") == [records[1]]
    assert read_events(path, ("metric", "page")) == [records[0]]
    # Each line is flushed: visible to a reader before close.
    log2 = EventLog(path)
    log2.write("page", 5, text="x")
    assert read_events(path)[-1]["kind"] == "page"
    log2.close()


def test_bad_payloads_are_value_errors(tmp_path: Path) -> None:
    log = EventLog(tmp_path / "e.jsonl")
    with pytest.raises(ValueError, match="reserved"):
        log.write("metric", 1, time=3.0)
    with pytest.raises(ValueError, match="not JSON"):
        log.write("metric", 1, value=object())
    with pytest.raises(ValueError, match="non-empty"):
        log.write("", 1)
    log.close()
    with pytest.raises(ValueError, match="closed"):
        log.write("metric", 1)
    with pytest.raises(ValueError, match="fsync_interval_s"):
        EventLog(tmp_path / "f.jsonl", fsync_interval_s=-1)


def test_torn_last_line_is_skipped_and_terminated_on_reopen(tmp_path: Path) -> None:
    path = tmp_path / "e.jsonl"
    with EventLog(path) as log:
        log.write("metric", 1, value=1.0)
        log.write("metric", 2, value=2.0)
    with open(path, "ab") as f:  # a writer killed mid-record
        f.write(b'{"time": 1.0, "kind": "metric", "st')
    assert [r["step"] for r in read_events(path)] == [1, 2]
    with EventLog(path) as log:  # the next writer starts on a fresh line
        log.write("metric", 3, value=3.0)
    assert [r["step"] for r in read_events(path)] == [1, 2, 3]
    # The torn fragment is now a bad line in the middle: skipped, with its line number.
    lines = [n for n, _ in iter_jsonl(path)]
    assert lines == [1, 2, 4]


def test_missing_file_reads_as_empty(tmp_path: Path) -> None:
    assert read_events(tmp_path / "nope.jsonl") == []


def test_concurrent_writers_never_interleave_lines(tmp_path: Path) -> None:
    path = tmp_path / "e.jsonl"
    log = EventLog(path, fsync_interval_s=0.0)
    payload = "x" * 2000  # long lines make interleaving likely if writes were not locked

    def writer(k: int) -> None:
        for i in range(50):
            log.write("metric", i, writer=k, blob=payload)

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    log.close()
    records = read_events(path)
    assert len(records) == 200 and log.written == 200
    for k in range(4):
        assert [r["step"] for r in records if r["writer"] == k] == list(range(50))
    raw = path.read_text().splitlines()
    assert all(json.loads(line)["blob"] == payload for line in raw)


def test_fsync_at_most_every_interval(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import agent.eventlog as eventlog

    calls: list[int] = []
    real_fsync = eventlog.os.fsync
    monkeypatch.setattr(
        eventlog.os, "fsync", lambda fd: calls.append(threading.get_ident()) or real_fsync(fd)
    )
    clock = [100.0]
    monkeypatch.setattr(eventlog.time, "monotonic", lambda: clock[0])
    log = EventLog(tmp_path / "e.jsonl", fsync_interval_s=5.0)
    for _ in range(10):
        log.write("metric", 1)
    assert calls == []  # 0 s elapsed since open
    clock[0] += 5.0
    log.write("metric", 2)  # due: the sync thread fsyncs, the writer does not wait for it
    deadline = time.perf_counter() + 10.0
    while not calls and time.perf_counter() < deadline:
        time.sleep(0.005)
    assert len(calls) == 1 and calls[0] != threading.get_ident()  # not on the writer's thread
    log.write("metric", 3)
    time.sleep(0.05)
    assert len(calls) == 1
    log.flush()
    assert len(calls) == 2
    log.close()
    assert len(calls) == 3
    assert log._syncer is not None
    log._syncer.join(timeout=5.0)
    assert not log._syncer.is_alive()  # the sync thread ends with the log


def test_secrets_never_reach_the_file(tmp_path: Path) -> None:
    secret = "xoxb-9999-8888-SECRETtokenVALUE"
    register_secret(secret)
    path = tmp_path / "e.jsonl"
    with EventLog(path) as log:
        log.write("error", 1, message=f"Slack said no to {secret}")
        log.write("error", 2, message="unregistered token xoxp-1234-abcd-EFGH leaks?")
    text = path.read_text()
    assert secret not in text and "xoxp-1234-abcd-EFGH" not in text
    assert text.count(MASK) == 2
