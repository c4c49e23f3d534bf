"""Crash consistency: a process SIGKILLed at random moments while it checkpoints never leaves a
checkpoint that loads with the wrong step or the wrong weights, and a damaged file is never
loaded.

The killed processes are real: a zygote process imports torch once and forks one trainer per
round; the trainer resumes from the newest checkpoint and saves every step through a
``CheckpointManager`` (background writer on, the writer always busy), with every weight equal
to the step number; the test kills it with ``os.kill(pid, SIGKILL)`` after a seeded random
delay and inspects the directory with a fresh manager, as a restarted run would.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import select
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from agent.checkpoints import CheckpointCorrupt, CheckpointInfo, CheckpointManager

REPO_ROOT = Path(__file__).resolve().parents[1]
KILLS = 25
SEED = 1234

# The zygote reads one command per line: "run <dir>" forks a trainer and answers "pid <pid>";
# "reap <pid>" waits for it and answers "reaped <pid> <signal>". A trainer says "ready <pid>"
# once it has resumed and starts saving.
ZYGOTE = textwrap.dedent(
    """
    import os, sys, traceback
    sys.path.insert(0, {repo!r})
    import torch
    torch.set_num_threads(1)
    from agent.checkpoints import CheckpointManager

    def say(line):
        os.write(1, (line + "\\n").encode())

    def make_model():
        return torch.nn.Sequential(torch.nn.Linear(96, 96), torch.nn.Linear(96, 32))

    def train(directory):
        model = make_model()
        manager = CheckpointManager(directory, model=model, every_n_steps=1, keep_last=3,
                                    keep_known_good=2, known_good_spacing=10, pin_memory=False)
        found = manager.load_newest()
        step = 0 if found is None else manager.restore(found[1])
        say(f"ready {{os.getpid()}}")
        while True:
            step += 1
            with torch.no_grad():
                for p in model.parameters():
                    p.fill_(float(step))
            manager.save(step, health={{"healthy": step % 4 != 0, "firing": []}})

    for command in sys.stdin:
        name, *args = command.split()
        if name == "run":
            pid = os.fork()
            if pid == 0:
                try:
                    train(args[0])
                except BaseException:
                    traceback.print_exc()
                os._exit(1)  # only a kill may end a trainer
            say(f"pid {{pid}}")
        elif name == "reap":
            _, status = os.waitpid(int(args[0]), 0)
            say(f"reaped {{args[0]}} {{os.WTERMSIG(status) if os.WIFSIGNALED(status) else -1}}")
    """
).format(repo=str(REPO_ROOT))


class Zygote:
    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", ZYGOTE],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        self._pending = b""  # bytes read from the zygote's stdout, not yet a whole line

    def ask(self, command: str, answer: str) -> list[str]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self.expect(answer)

    def expect(self, answer: str, timeout_s: float = 60.0) -> list[str]:
        """The next line that starts with ``answer`` (a trainer killed before the test waited
        for its "ready" may have said it anyway). A trainer that died on an exception never
        says "ready": fail after ``timeout_s`` instead of waiting forever (its traceback is in
        the captured stderr)."""
        deadline = time.monotonic() + timeout_s
        while True:
            words = self._line(answer, deadline).split()
            assert words, f"the zygote ended while the test waited for {answer!r}"
            if words[0] == answer:
                return words
            assert words[0] == "ready", f"unexpected line {words!r}"

    def _line(self, answer: str, deadline: float) -> str:
        """The next line of the zygote's output (its own buffer: select sees the pipe only)."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._pending:
            left = deadline - time.monotonic()
            readable, _, _ = select.select([fd], [], [], max(0.0, left))
            assert readable, f"no {answer!r} from the zygote in time (a trainer died?)"
            chunk = os.read(fd, 4096)
            if not chunk:
                return ""  # the zygote ended
            self._pending += chunk
        line, self._pending = self._pending.split(b"\n", 1)
        return line.decode()

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


@pytest.fixture
def zygote() -> Zygote:
    z = Zygote()
    yield z
    z.close()


def model_like_the_trainers() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(96, 96), torch.nn.Linear(96, 32))


def assert_consistent(info: CheckpointInfo, payload: dict[str, Any]) -> None:
    """Payload step, manifest step, file names and weights all say the same step."""
    manifest = json.loads(info.manifest_path.read_text())
    assert payload["step"] == info.step == manifest["step"]
    assert info.path.name == manifest["file"] == f"ckpt-{info.step}.pt"
    assert info.manifest_path.name == f"ckpt-{info.step}.json"
    for name, tensor in payload["model"].items():
        assert bool((tensor == float(info.step)).all()), f"{info.path.name}: {name}"


def test_sigkill_at_random_moments_never_leaves_a_bad_checkpoint_loadable(
    tmp_path: Path, zygote: Zygote
) -> None:
    rng = random.Random(SEED)
    newest_step = 0
    left_tmp = left_orphan = 0
    damaged: set[tuple[int, float]] = set()  # (step, saved_at) of files this test truncated
    started = time.monotonic()
    for kill in range(KILLS):
        pid = int(zygote.ask(f"run {tmp_path}", "pid")[1])
        if kill % 5 == 2:  # while it resumes: loading, verifying, removing leftovers
            time.sleep(rng.uniform(0.0, 0.05))
        else:  # while it saves: capture, serialize, fsync, rename, manifest, retention
            assert zygote.expect("ready") == ["ready", str(pid)]
            time.sleep(rng.uniform(0.0, 0.2))
        os.kill(pid, signal.SIGKILL)
        assert zygote.ask(f"reap {pid}", "reaped")[2] == str(int(signal.SIGKILL))

        names = os.listdir(tmp_path)
        left_tmp += any(n.endswith(".tmp") for n in names)
        described = {n[: -len(".json")] for n in names if n.endswith(".json")}
        left_orphan += any(n.endswith(".pt") and n[: -len(".pt")] not in described for n in names)

        manager = CheckpointManager(tmp_path, model=model_like_the_trainers(), pin_memory=False)
        assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]  # cleaned at start
        # Every checkpoint with a manifest is complete (the manifest is written last), except
        # one this test damaged itself, until a trainer saves that step again.
        infos = manager.checkpoints()
        good = [i for i in infos if (i.step, i.saved_at) not in damaged]
        for info in infos:
            if info in good:
                assert_consistent(info, manager.load(info))
            else:
                with pytest.raises(CheckpointCorrupt):
                    manager.load(info)
        found = manager.load_newest()
        if found is None:
            assert newest_step == 0 and not good, f"kill {kill}: the newest checkpoint vanished"
            continue
        info, payload = found
        assert_consistent(info, payload)
        assert manager.newest_verified() == info == good[0]
        assert info.step >= newest_step, f"kill {kill}: went back from {newest_step}"
        newest_step = info.step

        if kill % 5 == 4 and len(good) > 1:
            # Truncate the newest file as a failing disk would: it must be skipped for the
            # next older verified one, and the next trainer resumes from that one.
            data = info.path.read_bytes()
            info.path.write_bytes(data[: rng.randrange(1, len(data))])
            damaged.add((info.step, info.saved_at))
            skipped: list[str] = []
            older = manager.load_newest(skipped=skipped)
            assert older is not None and older[0] == good[1]
            assert_consistent(*older)
            assert len(skipped) == 1 and skipped[0].startswith(f"{info.path.name}: ")
            newest_step = older[0].step
    elapsed = time.monotonic() - started
    assert newest_step > 0, "the trainers saved nothing between kills"
    assert left_tmp + left_orphan > 0, "no kill landed inside a write: nothing was exercised"
    print(
        f"\n{KILLS} kills in {elapsed:.1f} s: newest step {newest_step}, {left_tmp} left a "
        f".tmp file, {left_orphan} a data file without manifest, {len(damaged)} truncated"
    )


# --------------------------------------------------------------------------------------------
# Damaged files


def _damage(path: Path, how: str, other: Path) -> None:
    data = path.read_bytes()
    if how == "garbage":
        path.write_bytes(os.urandom(len(data)))
    elif how == "truncated":
        path.write_bytes(data[: len(data) // 3])
    elif how == "empty":
        path.write_bytes(b"")
    elif how == "another step's file":
        path.write_bytes(other.read_bytes())
    else:
        raise AssertionError(how)


@pytest.mark.parametrize("how", ["garbage", "truncated", "empty", "another step's file"])
@pytest.mark.parametrize("manifest_matches", [False, True])
def test_a_replaced_or_truncated_file_is_never_loaded(
    tmp_path: Path, how: str, manifest_matches: bool
) -> None:
    model = model_like_the_trainers()
    manager = CheckpointManager(tmp_path, model=model, every_n_steps=1, pin_memory=False)
    for step in (1, 2, 3):
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float(step))
        manager.save(step, health={"healthy": True})
    manager.flush()
    target = tmp_path / "ckpt-3.pt"
    _damage(target, how, other=tmp_path / "ckpt-2.pt")
    if manifest_matches:  # damage that also rewrote the checksum: only the payload can tell
        manifest_path = tmp_path / "ckpt-3.json"
        manifest = json.loads(manifest_path.read_text())
        data = target.read_bytes()
        manifest.update(sha256=hashlib.sha256(data).hexdigest(), size_bytes=len(data))
        manifest_path.write_text(json.dumps(manifest))

    fresh = CheckpointManager(tmp_path, model=model_like_the_trainers(), pin_memory=False)
    newest = fresh.checkpoints()[0]
    assert newest.step == 3
    with pytest.raises(CheckpointCorrupt, match="ckpt-3.pt"):
        fresh.load(newest)
    with pytest.raises(CheckpointCorrupt, match="ckpt-3.pt"):
        fresh.load(target)
    skipped: list[str] = []
    found = fresh.load_newest(skipped=skipped)
    assert found is not None and found[0].step == 2
    assert_consistent(*found)
    assert len(skipped) == 1 and skipped[0].startswith("ckpt-3.pt: ")
    if not manifest_matches:
        assert fresh.newest_verified().step == 2
