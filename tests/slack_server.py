"""A local fake of the parts of Slack mechwatch talks to, for tests (no internet).

``FakeSlack`` serves ``/api/auth.test``, ``/api/chat.postMessage`` and an incoming-webhook
path on 127.0.0.1 (ephemeral port). It checks the bearer token and the channel like Slack
does, records every request, and can be scripted: the next answers of a method can be a
429 with Retry-After, a 500, or any Slack error, and the whole server can go down
(connection refused) and come back up on the same port.

    with FakeSlack() as slack:
        slack.script("chat.postMessage", Reply.ratelimited(1), Reply.server_error())
        ...  # point WebClient(base_url=slack.base_url, token=slack.token) at it
        slack.posts()  # the JSON bodies of accepted chat.postMessage calls
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs

TOKEN = "xoxb-1111111111-2222222222-FAKEfakeFAKEfakeTOKEN0"
WEBHOOK_PATH = "/services/T0000TEST/B0000TEST/WEBHOOKsecretPATH123456"
CHANNEL_ID = "C0TESTCHAN"


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
    ) -> None:
        self.token = token
        self.channels = set(channels)
        self.webhook_path = webhook_path
        self.requests: list[Request] = []
        self._scripts: dict[str, deque[Reply]] = {}
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._ts = 0
        self.port = 0

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> FakeSlack:
        self.up()
        return self

    def up(self) -> None:
        """Listen (again) on the same port."""
        assert self._server is None, "already up"
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
        if method not in ("auth.test", "chat.postMessage"):
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
        if body.get("channel") not in self.channels:
            return Reply.error("channel_not_found")
        if not body.get("text") and not body.get("blocks"):
            return Reply.error("no_text")
        if len(body.get("blocks") or []) > 50:
            return Reply.error("invalid_blocks")
        with self._lock:
            self._ts += 1
            ts = f"1700000000.{self._ts:06d}"
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
                if method == "webhook" and isinstance(reply.body, dict):
                    payload = str(reply.body.get("error", "ok")).encode()
                    ctype_out = "text/plain"
                elif isinstance(reply.body, dict):
                    payload = json.dumps(reply.body).encode()
                    ctype_out = "application/json; charset=utf-8"
                else:
                    payload = reply.body.encode()
                    ctype_out = "text/plain" if method == "webhook" else "text/html"
                self.send_response(reply.status)
                self.send_header("Content-Type", ctype_out)
                self.send_header("Content-Length", str(len(payload)))
                for key, value in reply.headers.items():
                    self.send_header(key, value)
                self.end_headers()
                self.wfile.write(payload)

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
    fake: FakeSlack, *, token: str | None = None, channel: str = "#alerts", delivery: Any = None
) -> Any:
    """A SlackNotifier (bot token) pointed at ``fake``."""
    from agent.notify.config import SlackConfig, resolve_slack
    from agent.notify.slack import SlackNotifier

    config = SlackConfig(
        bot_token=token or fake.token,
        channel=channel,
        base_url=fake.base_url,
        timeout_s=2,
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
