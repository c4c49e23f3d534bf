"""A full disk while checkpointing: the cause is named once, nothing is left behind, the good
checkpoints survive, and the recovery is reported.

The disk is made full at the lowest layer the checkpoint code owns: ``atomic.open_tmp``, which
every payload and manifest write goes through, is replaced by ``FullDisk.open``, whose files
take at most ``capacity`` bytes each and then fail the way the kernel does (the bytes that fit
are written, then OSError ENOSPC). One test uses a real 1 MiB tmpfs where mounting is allowed.
"""

from __future__ import annotations

import errno
import io
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, BinaryIO

import pytest
import torch

from agent.checkpoints import CheckpointManager, atomic

HEALTHY = {"healthy": True, "firing": []}


class _FullFile:
    """A real file (buffered, as ``open`` returns it) that takes at most ``capacity`` bytes."""

    def __init__(self, file: BinaryIO, capacity: int, error: int) -> None:
        self._file = file
        self._room = capacity
        self._error = error

    def write(self, data: bytes) -> int:
        if len(data) > self._room:
            self._file.write(bytes(data[: self._room]))
            self._room = 0
            raise OSError(self._error, os.strerror(self._error))
        self._room -= len(data)
        return self._file.write(data)

    def flush(self) -> None:
        self._file.flush()

    def fileno(self) -> int:
        return self._file.fileno()

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> _FullFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class FullDisk:
    """Stands in for ``atomic.open_tmp``. ``capacity`` None: no limit; ``suffix``: only files
    whose name ends with it are limited (".json.tmp": only the manifests); ``error``: the errno
    a refused write raises."""

    def __init__(self) -> None:
        self.capacity: int | None = None
        self.suffix = ""
        self.error = errno.ENOSPC
        self.opened: list[str] = []

    def open(self, path: Path) -> Any:
        self.opened.append(path.name)
        file = open(path, "wb")  # noqa: SIM115 - closed by atomic.write_tmp
        if self.capacity is None or not path.name.endswith(self.suffix):
            return file
        return _FullFile(file, self.capacity, self.error)


@pytest.fixture
def disk(monkeypatch: pytest.MonkeyPatch) -> FullDisk:
    disk = FullDisk()
    monkeypatch.setattr(atomic, "open_tmp", disk.open)
    return disk


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 8))


def set_weights(model: torch.nn.Module, step: int) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float(step))


def save(manager: CheckpointManager, step: int) -> None:
    set_weights(manager.model, step)
    assert manager.save(step, health=HEALTHY)
    assert manager.flush(timeout_s=30)


def assert_loads_with_weights(manager: CheckpointManager, steps: list[int]) -> None:
    assert [i.step for i in manager.checkpoints()] == steps
    for info in manager.checkpoints():
        payload = manager.load(info)
        assert payload["step"] == info.step
        assert all(bool((t == float(info.step)).all()) for t in payload["model"].values())


def failure_warnings(manager: CheckpointManager) -> list[str]:
    return [w for w in manager.warnings if " not saved: " in w]


def test_torch_save_hides_enospc_behind_an_opaque_runtime_error() -> None:
    # Why the hashing writer must remember the OSError: torch.save replaces it.
    full = _FullFile(io.BytesIO(), capacity=1000, error=errno.ENOSPC)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError) as caught:
        torch.save({"w": torch.zeros(64, 64)}, full)
    assert "ENOSPC" not in str(caught.value) and "No space" not in str(caught.value)


@pytest.mark.parametrize(
    "where, capacity, suffix",
    [
        ("first bytes of the payload", 10, ".pt.tmp"),
        ("inside torch.save", 6000, ".pt.tmp"),
        ("the manifest, after the data file's rename", 0, ".json.tmp"),
    ],
)
def test_full_disk_is_named_once_and_good_checkpoints_survive(
    tmp_path: Path,
    disk: FullDisk,
    caplog: pytest.LogCaptureFixture,
    where: str,
    capacity: int,
    suffix: str,
) -> None:
    reports: list[tuple[str, str]] = []
    manager = CheckpointManager(
        tmp_path,
        model=make_model(),
        every_n_steps=1,
        keep_last=2,
        keep_known_good=0,
        pin_memory=False,
        report=lambda kind, message: reports.append((kind, message)),
    )
    save(manager, 1)
    save(manager, 2)
    assert (tmp_path / "ckpt-2.pt").stat().st_size > 2 * 6000  # the cut is inside the payload
    disk.capacity, disk.suffix = capacity, suffix
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="agent.checkpoints"):
        for step in range(3, 13):  # ten saves, every one refused
            save(manager, step)
    assert manager.saves_failed == 10 and manager.saves_completed == 2

    # Named once: one warning, one log record, one report, each naming ENOSPC and the place.
    (warning,) = failure_warnings(manager)
    logged = [r.getMessage() for r in caplog.records if " not saved: " in r.getMessage()]
    assert len(logged) == 1
    assert [kind for kind, _ in reports] == ["checkpoint"]
    message = reports[0][1]
    for text in (warning, message):
        assert text.startswith("checkpoint at step 3 not saved: ENOSPC (No space left on device)")
        assert f"bytes free in {tmp_path}" in text
    assert "ckpt-3." in message  # the file whose write was refused
    assert manager.last_error is not None and "step 12 not saved: ENOSPC" in manager.last_error

    # Nothing left behind, no failed save counted: retention (keep_last=2) kept 1 and 2.
    assert sorted(os.listdir(tmp_path)) == ["ckpt-1.json", "ckpt-1.pt", "ckpt-2.json", "ckpt-2.pt"]
    assert_loads_with_weights(manager, [2, 1])
    assert manager.newest_verified().step == 2

    # Space again: the next save works and the recovery is reported once.
    disk.capacity = None
    save(manager, 13)
    save(manager, 14)
    assert reports[1:] == [
        (
            "checkpoint recovered",
            "checkpoint saving recovered at step 13 after 10 failed save(s) (ENOSPC)",
        )
    ]
    assert_loads_with_weights(manager, [14, 13])
    manager.close()  # never raises because of the failures


def test_each_cause_is_named_once_and_again_after_a_recovery(
    tmp_path: Path, disk: FullDisk
) -> None:
    reports: list[str] = []
    manager = CheckpointManager(
        tmp_path,
        model=make_model(),
        every_n_steps=1,
        pin_memory=False,
        report=lambda kind, message: reports.append(message),
    )
    save(manager, 1)
    disk.capacity = 100
    for step in range(2, 10):  # ENOSPC and EIO, alternating
        disk.error = errno.ENOSPC if step % 2 == 0 else errno.EIO
        save(manager, step)
    assert [w.split(" not saved: ")[1].split(" (")[0] for w in failure_warnings(manager)] == [
        "ENOSPC",
        "EIO",
    ]
    assert len(reports) == 2 and "EIO (Input/output error)" in reports[1]
    disk.capacity = None
    save(manager, 10)
    assert (
        reports[2] == "checkpoint saving recovered at step 10 after 8 failed save(s) (ENOSPC, EIO)"
    )
    disk.capacity, disk.error = 100, errno.ENOSPC
    save(manager, 11)  # a new episode: named again
    save(manager, 12)
    assert len(reports) == 4 and reports[3].startswith("checkpoint at step 11 not saved: ENOSPC")
    assert len(failure_warnings(manager)) == 3
    assert [i.step for i in manager.checkpoints()] == [10, 1]


def test_a_failing_report_callback_never_breaks_saving(tmp_path: Path, disk: FullDisk) -> None:
    def broken_report(kind: str, message: str) -> None:
        raise ConnectionError("event log gone")

    manager = CheckpointManager(
        tmp_path, model=make_model(), every_n_steps=1, pin_memory=False, report=broken_report
    )
    disk.capacity = 10
    save(manager, 1)
    disk.capacity = None
    save(manager, 2)
    assert manager.saves_failed == 1 and manager.saves_completed == 1
    assert_loads_with_weights(manager, [2])
    manager.close()


# --------------------------------------------------------------------------------------------
# A real full file system


@pytest.fixture
def tiny_tmpfs(tmp_path: Path) -> Path:
    """A 1 MiB tmpfs mounted for the test; skipped where mounting is not permitted."""
    if not sys.platform.startswith("linux") or shutil.which("mount") is None:
        pytest.skip("needs Linux mount(8)")
    mount_point = tmp_path / "tmpfs"
    mount_point.mkdir()
    cmd = ["mount", "-t", "tmpfs", "-o", "size=1m,mode=0700", "tmpfs", str(mount_point)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    try:
        yield mount_point
    finally:
        if subprocess.run(["umount", str(mount_point)], timeout=30).returncode != 0:
            subprocess.run(["umount", "-l", str(mount_point)], timeout=30)


def test_real_enospc_on_a_full_tmpfs(tiny_tmpfs: Path) -> None:
    reports: list[str] = []
    model = torch.nn.Linear(256, 256)  # ~257 KiB of fp32 weights
    manager = CheckpointManager(
        tiny_tmpfs,
        model=model,
        every_n_steps=1,
        keep_last=1,
        keep_known_good=0,
        pin_memory=False,
        report=lambda kind, message: reports.append(message),
    )
    save(manager, 1)
    size = (tiny_tmpfs / "ckpt-1.pt").stat().st_size
    st = os.statvfs(tiny_tmpfs)
    ballast = st.f_bavail * st.f_frsize - size // 2  # leaves half a checkpoint free
    (tiny_tmpfs / "ballast").write_bytes(b"\0" * ballast)
    for step in range(2, 7):
        save(manager, step)
    assert manager.saves_failed == 5
    assert len(reports) == 1 and len(failure_warnings(manager)) == 1
    assert reports[0].startswith("checkpoint at step 2 not saved: ENOSPC (No space left on device)")
    assert f"bytes free in {tiny_tmpfs}" in reports[0]
    assert sorted(os.listdir(tiny_tmpfs)) == ["ballast", "ckpt-1.json", "ckpt-1.pt"]
    assert_loads_with_weights(manager, [1])

    (tiny_tmpfs / "ballast").unlink()
    save(manager, 7)
    assert reports[1] == "checkpoint saving recovered at step 7 after 5 failed save(s) (ENOSPC)"
    assert_loads_with_weights(manager, [7])
    manager.close()
