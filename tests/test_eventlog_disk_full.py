"""EventLog on a full disk: writes are dropped and counted, nothing raises, and the cause is
named once in the log when writes work again. The disk is really full: the log's descriptor is
pointed at /dev/full (every write fails with ENOSPC) and back, with os.dup2."""

from __future__ import annotations

import errno
import json
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

import agent.eventlog as eventlog
from agent.eventlog import EventLog, read_events


@contextmanager
def disk_full(log: EventLog) -> Iterator[None]:
    """Every write of ``log`` fails with ENOSPC inside the block."""
    fd = log._file.fileno()
    saved = os.dup(fd)
    full = os.open("/dev/full", os.O_WRONLY)
    try:
        os.dup2(full, fd)
        yield
    finally:
        os.dup2(saved, fd)
        os.close(saved)
        os.close(full)


def failing_io(*args: object) -> None:
    raise OSError(errno.EIO, os.strerror(errno.EIO))


def failure_logs(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "mechwatch.eventlog"]


def test_dev_full_drops_and_counts_and_close_does_not_raise(caplog: pytest.LogCaptureFixture):
    log = EventLog("/dev/full")
    assert [log.write("metric", step, value=1.0) for step in range(3)] == [False] * 3
    assert (log.written, log.dropped) == (0, 3)
    log.flush()
    log.close()  # raised OSError(ENOSPC) when the records waited in a buffer for close
    log.close()
    assert log.closed
    logs = failure_logs(caplog)
    assert len(logs) == 1 and "No space left on device" in logs[0]


def test_the_cause_is_named_once_when_writes_work_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
):
    path = tmp_path / "events.jsonl"
    log = EventLog(path, fsync_interval_s=3600.0)
    assert log.write("metric", 1, value=1.0)
    with disk_full(log):
        assert not log.write("metric", 2, value=2.0)
        assert not log.write("alert", 3, rule="r")
        assert not log.write("metric", 4, value=4.0)
        log.flush()
    assert log.write("metric", 5, value=5.0)
    assert log.write("metric", 6, value=6.0)
    log.close()
    assert (log.written, log.dropped) == (3, 3)
    records = read_events(path)
    assert [(r["kind"], r["step"]) for r in records] == [
        ("metric", 1),
        ("error", 2),  # at the step of the first record dropped, before the first that worked
        ("metric", 5),
        ("metric", 6),
    ]
    error = records[1]
    assert {k: error[k] for k in ("what", "errno", "dropped")} == {
        "what": "event log",
        "errno": "ENOSPC",
        "dropped": 3,
    }
    assert "No space left on device" in error["error"]
    logs = failure_logs(caplog)
    assert len(logs) == 2
    assert "write failed" in logs[0] and "writes work again (3 records dropped)" in logs[1]


def test_each_failing_period_is_named_with_its_own_count(tmp_path: Path):
    path = tmp_path / "events.jsonl"
    with EventLog(path) as log:
        with disk_full(log):
            log.write("metric", 1)
        log.write("metric", 2)
        with disk_full(log):
            log.write("metric", 3)
            log.write("metric", 4)
        log.write("metric", 5)
    errors = [(r["step"], r["dropped"]) for r in read_events(path, "error")]
    assert errors == [(1, 1), (3, 2)]


def test_close_names_a_failure_that_no_later_write_reported(tmp_path: Path):
    path = tmp_path / "events.jsonl"
    log = EventLog(path)
    with disk_full(log):
        log.write("metric", 7)
        log.write("metric", 8)
    log.close()  # the disk has room again, but nothing was written since
    assert [(r["kind"], r["step"], r.get("dropped")) for r in read_events(path)] == [
        ("error", 7, 2)
    ]


def test_close_on_a_still_full_disk_does_not_raise(tmp_path: Path):
    path = tmp_path / "events.jsonl"
    log = EventLog(path)
    log.write("metric", 1)
    full = os.open("/dev/full", os.O_WRONLY)
    os.dup2(full, log._file.fileno())  # for good: close() closes it
    os.close(full)
    assert not log.write("metric", 2)
    log.close()
    assert log.closed and log.dropped == 1
    assert [r["step"] for r in read_events(path)] == [1]


@pytest.mark.parametrize("truncate_works", [True, False])
def test_a_partly_written_record_never_tears_a_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, truncate_works: bool
):
    """The disk fills in the middle of a record: the part written is cut back off, or when
    that fails too, the next record starts on a line of its own."""
    path = tmp_path / "events.jsonl"
    log = EventLog(path)
    log.write("metric", 1, value=1.0)
    real_write = os.write
    calls = []

    def write_then_fill(fd: int, data: bytes) -> int:
        calls.append(len(data))
        if len(calls) == 1:
            return real_write(fd, bytes(data[:10]))  # the disk takes 10 bytes
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(eventlog.os, "write", write_then_fill)
    if not truncate_works:
        monkeypatch.setattr(eventlog.os, "ftruncate", failing_io)
    assert not log.write("metric", 2, value=2.0)
    monkeypatch.setattr(eventlog.os, "write", real_write)
    assert log.write("metric", 3, value=3.0)
    log.close()
    lines = path.read_bytes().split(b"\n")
    assert lines[-1] == b""
    parsed = []
    for line in lines[:-1]:
        try:
            parsed.append(json.loads(line)["step"])
        except json.JSONDecodeError:
            parsed.append("torn")
    assert parsed == ([1, 2, 3] if truncate_works else [1, "torn", 2, 3])
    assert [(r["kind"], r["step"]) for r in read_events(path)] == [
        ("metric", 1),
        ("error", 2),
        ("metric", 3),
    ]


def test_fsync_failures_are_logged_once_and_never_raised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
):
    monkeypatch.setattr(eventlog.os, "fsync", failing_io)
    caplog.set_level(logging.ERROR, "mechwatch.eventlog")
    log = EventLog(tmp_path / "events.jsonl", fsync_interval_s=0.0)
    assert log.write("metric", 1) and log.write("metric", 2)
    log.flush()
    log.close()
    assert log.dropped == 0 and log.written == 2
    logs = failure_logs(caplog)
    assert len(logs) == 1 and "fsync failed" in logs[0]
