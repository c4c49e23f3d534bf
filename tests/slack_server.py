"""A local fake of the parts of Slack mechwatch talks to, for tests (no internet).

``FakeSlack`` serves ``/api/auth.test``, ``/api/chat.postMessage``,
``/api/conversations.history``, ``/api/conversations.replies`` and an incoming-webhook path on
127.0.0.1 (ephemeral port). It checks the bearer token, the channel and (for the history
methods) the bot's scopes like Slack does, keeps the messages it accepted with their
metadata, and records every request. It can be scripted: the next answers of a method can be
a 429 with Retry-After, a 500, or any Slack error; the answer to a method can be held back
for a while after the message was stored (a request in flight, for kill tests); and the whole
server can go down (connection refused) and come back up on the same port.

    with FakeSlack() as slack:
        slack.script("chat.postMessage", Reply.ratelimited(1), Reply.server_error())
        slack.hold("chat.postMessage", 30.0)  # store the next message, answer 30 s later
        ...  # point WebClient(base_url=slack.base_url, token=slack.token) at it
        slack.posts()  # the JSON bodies of accepted chat.postMessage calls

Message timestamps (``ts``) are the server's unix time in microseconds, as Slack's are.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

TOKEN = "xoxb-1111111111-2222222222-FAKEfakeFAKEfakeTOKEN0"
WEBHOOK_PATH = "/services/T0000TEST/B0000TEST/WEBHOOKsecretPATH123456"
CHANNEL_ID = "C0TESTCHAN"
# A bot with these may post (chat:write) and read its channel's history (*:history).
ALL_SCOPES = ("chat:write", "channels:history", "groups:history")
HISTORY_METHODS = ("conversations.history", "conversations.replies")


@dataclass
class Reply:
    """One scripted answer."""

    status: int = 200
    body: dict[str, Any] | str = field(default_factory=lambda: {"ok": True})
    headers: dict[str, str] = field(default_factory=dict)

    @staticmethod
    def error(code: str, status: int = 200) -> Reply:
        """A Slack Web API error (HTTP 200, ok=false), or a webhook error with ``status``."""
        return Reply(status=status, body={"ok": False, "error": code})

    @staticmethod
    def normal() -> Reply:
        """Answer as Slack would (checks token and channel, returns a ts)."""
        return Reply(status=0)

    @staticmethod
    def ratelimited(retry_after: int = 1) -> Reply:
        return Reply(
            status=429,
            body={"ok": False, "error": "ratelimited"},
            headers={"Retry-After": str(retry_after)},
        )

    @staticmethod
    def server_error(status: int = 500) -> Reply:
        return Reply(status=status, body="<html>internal server error</html>")


@dataclass
class Request:
    """One request the server saw."""

    method: str  # "chat.postMessage", "auth.test", "webhook", or the raw path
    path: str
    headers: dict[str, str]
    body: dict[str, Any]
    time: float  # time.monotonic() on arrival
    status: int = 0  # what the server answered


class FakeSlack:
    def __init__(
        self,
        token: str = TOKEN,
        channels: tuple[str, ...] = (CHANNEL_ID, "#alerts"),
        webhook_path: str = WEBHOOK_PATH,
        scopes: tuple[str, ...] = ALL_SCOPES,
    ) -> None:
        self.token = token
        self.channels = set(channels)
        self.webhook_path = webhook_path
        self.scopes = set(scopes)
        self.requests: list[Request] = []
        # Accepted messages, oldest first: ts, thread_ts, text, metadata, reply_broadcast.
        self.messages: list[dict[str, Any]] = []
        self._scripts: dict[str, deque[Reply]] = {}
        self._holds: dict[str, deque[float]] = {}
        self.holding = threading.Event()  # set when a held answer is being held back
        self._release = threading.Event()  # set by ``down``: held answers go out at once
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._last_us = 0
        self.port = 0

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> FakeSlack:
        self.up()
        return self

    def up(self) -> None:
        """Listen (again) on the same port."""
        assert self._server is None, "already up"
        self._release.clear()
        server = ThreadingHTTPServer(("127.0.0.1", self.port), self._handler_class())
        server.daemon_threads = True
        self.port = server.server_address[1]
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()

    def down(self) -> None:
        """Stop listening: clients get 'connection refused' until ``up``."""
        if self._server is None:
            return
        self._release.set()
        self._server.shutdown()
        self._server.server_close()
        assert self._thread is not None
        self._thread.join(5)
        self._server = None

    stop = down

    def __enter__(self) -> FakeSlack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.down()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/api/"

    @property
    def webhook_url(self) -> str:
        return f"http://127.0.0.1:{self.port}{self.webhook_path}"

    # ------------------------------------------------------------------ scripting

    def script(self, method: str, *replies: Reply) -> None:
        """The next answers of ``method`` ("chat.postMessage", "auth.test", "webhook")."""
        with self._lock:
            self._scripts.setdefault(method, deque()).extend(replies)

    def clear_scripts(self) -> None:
        with self._lock:
            self._scripts.clear()

    def hold(self, method: str, *seconds: float) -> None:
        """Hold back the answers to the next requests of ``method``, one duration (seconds,
        0: answer at once) per request.

        The request is processed first (a posted message is stored and visible in the
        history), so a client killed or timed out meanwhile has delivered without knowing it.
        """
        with self._lock:
            self._holds.setdefault(method, deque()).extend(seconds)

    def requests_for(self, method: str) -> list[Request]:
        with self._lock:
            return [r for r in self.requests if r.method == method]

    def posts(self) -> list[dict[str, Any]]:
        """Bodies of accepted (HTTP 200, ok) chat.postMessage calls, in arrival order."""
        return [
            r.body
            for r in self.requests_for("chat.postMessage")
            if r.status == 200 and r.body.get("_accepted")
        ]

    def webhook_posts(self) -> list[dict[str, Any]]:
        return [r.body for r in self.requests_for("webhook") if r.status == 200]

    # ------------------------------------------------------------------ behaviour

    def _answer(self, method: str, headers: dict[str, str], body: dict[str, Any]) -> Reply:
        with self._lock:
            queue = self._scripts.get(method)
            scripted = queue.popleft() if queue else None
        if scripted is not None and scripted.status != 0:
            return scripted
        if method == "webhook":
            return Reply(body="ok")
        if method not in ("auth.test", "chat.postMessage", *HISTORY_METHODS):
            return Reply(status=404, body={"ok": False, "error": "unknown_method"})
        auth = headers.get("authorization", "")
        if not auth:
            return Reply.error("not_authed")
        if auth != f"Bearer {self.token}":
            return Reply.error("invalid_auth")
        if method == "auth.test":
            return Reply(
                body={
                    "ok": True,
                    "url": "https://mechwatch-test.slack.com/",
                    "team": "mechwatch-test",
                    "user": "mechwatch",
                    "team_id": "T0000TEST",
                    "user_id": "U0000TEST",
                    "bot_id": "B0000TEST",
                }
            )
        if method in HISTORY_METHODS:
            return self._history(method, body)
        if body.get("channel") not in self.channels:
            return Reply.error("channel_not_found")
        if not body.get("text") and not body.get("blocks"):
            return Reply.error("no_text")
        if len(body.get("blocks") or []) > 50:
            return Reply.error("invalid_blocks")
        with self._lock:
            self._last_us = max(int(time.time() * 1e6), self._last_us + 1)
            ts = f"{self._last_us // 10**6}.{self._last_us % 10**6:06d}"
            self.messages.append(
                {
                    "type": "message",
                    "user": "U0000TEST",
                    "text": body.get("text", ""),
                    "ts": ts,
                    "thread_ts": body.get("thread_ts"),
                    "reply_broadcast": bool(body.get("reply_broadcast")),
                    "metadata": body.get("metadata"),
                }
            )
        body["_accepted"] = True
        body["_ts"] = ts
        return Reply(
            body={
                "ok": True,
                "channel": CHANNEL_ID,
                "ts": ts,
                "message": {"text": body.get("text", ""), "ts": ts},
            }
        )

    def _history(self, method: str, body: dict[str, Any]) -> Reply:
        """conversations.history / .replies over the stored messages, as Slack pages them."""
        if "channels:history" not in self.scopes:
            return Reply(
                body={
                    "ok": False,
                    "error": "missing_scope",
                    "needed": "channels:history",
                    "provided": ",".join(sorted(self.scopes)),
                }
            )
        if body.get("channel") != CHANNEL_ID:  # these methods take IDs only, never names
            return Reply.error("channel_not_found")
        oldest = float(body.get("oldest") or 0)
        with self._lock:
            messages = [m for m in self.messages if float(m["ts"]) > oldest]
        if method == "conversations.history":  # the channel: top level and broadcasts, newest first
            found = [m for m in reversed(messages) if not m["thread_ts"] or m["reply_broadcast"]]
        else:  # one thread, oldest first
            parent = body.get("ts")
            found = [m for m in messages if parent in (m["ts"], m["thread_ts"])]
        start = int(body.get("cursor") or 0)
        limit = int(body.get("limit") or 100)
        page = found[start : start + limit]
        with_metadata = str(body.get("include_all_metadata", "")).lower() in ("1", "true")
        out = [
            {k: v for k, v in m.items() if v is not None and (k != "metadata" or with_metadata)}
            for m in page
        ]
        more = start + limit < len(found)
        return Reply(
            body={
                "ok": True,
                "messages": out,
                "has_more": more,
                "response_metadata": {"next_cursor": str(start + limit) if more else ""},
            }
        )

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                pass

            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                arrived = time.monotonic()
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length).decode("utf-8") if length else ""
                ctype = self.headers.get("Content-Type", "")
                if "json" in ctype:
                    body = json.loads(raw) if raw else {}
                else:
                    body = {k: v[0] for k, v in parse_qs(raw).items()}
                headers = {k.lower(): v for k, v in self.headers.items()}
                if self.path.startswith("/api/"):
                    method = self.path[len("/api/") :].split("?")[0]
                elif self.path == fake.webhook_path:
                    method = "webhook"
                else:
                    method = self.path
                request = Request(method, self.path, headers, body, arrived)
                with fake._lock:
                    fake.requests.append(request)
                reply = fake._answer(method, headers, body)
                if method.startswith("/"):  # an unknown webhook path
                    reply = Reply(status=404, body="no_service")
                request.status = reply.status
                with fake._lock:
                    holds = fake._holds.get(method)
                    held = holds.popleft() if holds else 0.0
                if held:
                    fake.holding.set()
                    fake._release.wait(held)
                if method == "webhook" and isinstance(reply.body, dict):
                    payload = str(reply.body.get("error", "ok")).encode()
                    ctype_out = "text/plain"
                elif isinstance(reply.body, dict):
                    payload = json.dumps(reply.body).encode()
                    ctype_out = "application/json; charset=utf-8"
                else:
                    payload = reply.body.encode()
                    ctype_out = "text/plain" if method == "webhook" else "text/html"
                try:
                    self.send_response(reply.status)
                    self.send_header("Content-Type", ctype_out)
                    self.send_header("Content-Length", str(len(payload)))
                    for key, value in reply.headers.items():
                        self.send_header(key, value)
                    self.end_headers()
                    self.wfile.write(payload)
                except OSError:  # the client is gone (killed or timed out while held)
                    pass

        return Handler


# ---------------------------------------------------------------------- test helpers


def fast_delivery(**overrides: Any) -> Any:
    """A DeliveryConfig with short delays, for tests."""
    from agent.notify.config import DeliveryConfig

    values: dict[str, Any] = dict(
        retry_initial_s=0.05, retry_max_s=0.2, max_attempts=50, recheck_s=60.0, connection_retries=0
    )
    values.update(overrides)
    return DeliveryConfig(**values)


def bot_notifier(
    fake: FakeSlack,
    *,
    token: str | None = None,
    channel: str = "#alerts",
    delivery: Any = None,
    timeout_s: float = 2,
) -> Any:
    """A SlackNotifier (bot token) pointed at ``fake``."""
    from agent.notify.config import SlackConfig, resolve_slack
    from agent.notify.slack import SlackNotifier

    config = SlackConfig(
        bot_token=token or fake.token,
        channel=channel,
        base_url=fake.base_url,
        timeout_s=timeout_s,
        use_env=False,
    )
    settings = resolve_slack(config)
    return SlackNotifier(settings, delivery or fast_delivery())


def webhook_notifier(fake: FakeSlack, *, delivery: Any = None) -> Any:
    from agent.notify.config import SlackConfig, resolve_slack
    from agent.notify.slack import SlackNotifier

    config = SlackConfig(webhook_url=fake.webhook_url, timeout_s=2, use_env=False)
    return SlackNotifier(resolve_slack(config), delivery or fast_delivery())


def wait_until(predicate: Any, timeout: float = 5.0, interval: float = 0.01) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


# ---------------------------------------------------------------------- a process to kill

# A dispatcher on run_dir (Slack at base_url) that submits the example incident's three events,
# prints SUBMITTED once they are in the outbox, then idles until it is killed.
PAGING_CHILD = """
import sys, time
from agent.notify.config import DeliveryConfig, SlackConfig, resolve_slack
from agent.notify.dispatcher import PageDispatcher
from agent.notify.example_page import example_incident_events
from agent.notify.slack import SlackNotifier

run_dir, base_url, token, channel = sys.argv[1:5]
delivery = DeliveryConfig(retry_initial_s=0.05, retry_max_s=0.1, max_attempts=10_000,
                          connection_retries=0)
settings = resolve_slack(SlackConfig(bot_token=token, channel=channel, base_url=base_url,
                                     timeout_s=60, use_env=False))
pages = PageDispatcher([SlackNotifier(settings, delivery)], run_dir, delivery=delivery)
for event in example_incident_events():
    pages.submit(event)
print("SUBMITTED", flush=True)
time.sleep(120)
"""


def start_paging_child(
    run_dir: Path, fake: FakeSlack, channel: str = "#alerts"
) -> subprocess.Popen[str]:
    """Run ``PAGING_CHILD``; returns once its three events are in the outbox."""
    child = subprocess.Popen(
        [sys.executable, "-c", PAGING_CHILD, str(run_dir), fake.base_url, fake.token, channel],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None
    line = child.stdout.readline()  # blocks until the events are in the outbox
    assert line.strip() == "SUBMITTED", child.stderr.read() if child.stderr else line
    return child


def kill_child(child: subprocess.Popen[str]) -> None:
    """SIGKILL: no handler, no flush, no atexit; whatever was in flight is cut off."""
    os.kill(child.pid, signal.SIGKILL)
    child.wait(10)
    assert child.returncode == -signal.SIGKILL
