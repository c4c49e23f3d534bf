"""Test-wide settings."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from slack_server import FakeSlack

# One intra-op thread: the suite's training loops are tiny, and OpenMP barriers with two
# threads on a loaded two-core machine can stall a step for seconds. The agent's monitor thread
# then has the other core to itself, as it would beside a GPU training loop.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _no_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    """Slack tests talk to a local server: a proxy from the environment must not intercept."""
    for name in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def fake() -> Iterator[FakeSlack]:
    """A local Slack on 127.0.0.1 (tests/slack_server.py)."""
    with FakeSlack() as server:
        yield server
