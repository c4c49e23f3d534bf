"""Configuration (config object and environment), the factory, ``mechwatch slack-test``, and
the token never showing up anywhere."""

from __future__ import annotations

import io
import logging
import time
from pathlib import Path

import pytest
from pydantic import SecretStr, ValidationError
from slack_server import WEBHOOK_PATH, FakeSlack, Reply, bot_notifier, fast_delivery

from agent.eventlog import EventLog, read_events
from agent.notify.config import DEFAULT_BASE_URL, NotifyConfig, SlackConfig, resolve_slack
from agent.notify.console import ConsoleNotifier
from agent.notify.dispatcher import PageDispatcher
from agent.notify.example_page import example_incident_events
from agent.notify.factory import build_dispatcher, build_notifiers
from agent.notify.jsonl import JsonlNotifier
from agent.notify.slack import SlackNotifier
from agent.notify.slack_test import cli_slack_test

TOKEN = "xoxb-5555555555-6666666666-ConfigTestTOKENvalue"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (
        "HTTPS_PROXY",
        "https_proxy",
        "HTTP_PROXY",
        "http_proxy",
        "SLACK_BOT_TOKEN",
        "MECHWATCH_SLACK_CHANNEL",
        "SLACK_WEBHOOK_URL",
        "MECHWATCH_SLACK_BASE_URL",
    ):
        monkeypatch.delenv(name, raising=False)


# ---------------------------------------------------------------------------- config


def test_environment_configures_a_bot() -> None:
    env = {
        "SLACK_BOT_TOKEN": TOKEN,
        "MECHWATCH_SLACK_CHANNEL": "C0123",
        "MECHWATCH_SLACK_BASE_URL": "https://slack-gov.com/api",
    }
    settings = resolve_slack(SlackConfig(), env)
    assert settings is not None and settings.mode == "bot"
    assert settings.token.get_secret_value() == TOKEN and settings.channel == "C0123"
    assert settings.base_url == "https://slack-gov.com/api/"  # trailing slash added
    assert settings.source == "SLACK_BOT_TOKEN"
    assert TOKEN not in repr(settings) and TOKEN not in settings.describe()


def test_config_wins_over_environment_and_token_file(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    env = {"SLACK_BOT_TOKEN": "xoxb-from-env-0000", "MECHWATCH_SLACK_CHANNEL": "#env"}
    settings = resolve_slack(SlackConfig(token_file=token_file, channel="#cfg"), env)
    assert settings.token.get_secret_value() == TOKEN and settings.channel == "#cfg"
    assert settings.base_url == DEFAULT_BASE_URL
    # use_env=False ignores the environment entirely.
    assert resolve_slack(SlackConfig(use_env=False), env) is None


def test_webhook_from_environment_and_bot_preferred() -> None:
    url = "https://hooks.slack.com/services/T1/B1/abcdefghijkl"
    settings = resolve_slack(SlackConfig(), {"SLACK_WEBHOOK_URL": url})
    assert settings.mode == "webhook" and settings.webhook_url.get_secret_value() == url
    both = resolve_slack(
        SlackConfig(),
        {"SLACK_WEBHOOK_URL": url, "SLACK_BOT_TOKEN": TOKEN, "MECHWATCH_SLACK_CHANNEL": "C1"},
    )
    assert both.mode == "bot"


def test_nothing_configured_is_none() -> None:
    assert resolve_slack(SlackConfig(), {}) is None


@pytest.mark.parametrize(
    ("config", "env", "match"),
    [
        (SlackConfig(), {"SLACK_BOT_TOKEN": TOKEN}, "no channel: set MECHWATCH_SLACK_CHANNEL"),
        (SlackConfig(channel="#a"), {}, "no credential: set SLACK_BOT_TOKEN"),
        (
            SlackConfig(token_file=Path("/nonexistent/token"), channel="#a"),
            {},
            "token_file: /nonexistent/token does not exist",
        ),
        (
            SlackConfig(),
            {
                "SLACK_BOT_TOKEN": TOKEN,
                "MECHWATCH_SLACK_CHANNEL": "#a",
                "MECHWATCH_SLACK_BASE_URL": "slack.com/api",
            },
            "MECHWATCH_SLACK_BASE_URL must start with http",
        ),
        (
            SlackConfig(webhook_url=SecretStr("hooks.slack.com/services/x/y/zzzzzzzz")),
            {},
            "webhook URL .*must start with http",
        ),
    ],
)
def test_incomplete_configuration_names_the_field(
    config: SlackConfig, env: dict, match: str
) -> None:
    with pytest.raises(ValueError, match=match) as info:
        resolve_slack(config, env)
    assert TOKEN not in str(info.value) and "zzzzzzzz" not in str(info.value)


def test_empty_token_file(tmp_path: Path) -> None:
    (tmp_path / "t").write_text("\n\n")
    with pytest.raises(ValueError, match="is empty"):
        resolve_slack(SlackConfig(token_file=tmp_path / "t", channel="#a"), {})


def test_config_model_rejects_unknown_keys_without_echoing_secrets() -> None:
    with pytest.raises(ValidationError) as info:
        NotifyConfig.model_validate({"slack": {"bot_tokn": TOKEN}})
    assert "slack.bot_tokn" in str(info.value) and TOKEN not in str(info.value)
    with pytest.raises(ValidationError, match="base_url"):
        SlackConfig(base_url="ftp://x")
    with pytest.raises(ValidationError, match="retry_initial_s"):
        NotifyConfig.model_validate({"delivery": {"retry_initial_s": 0}})
    config = NotifyConfig.model_validate({"slack": {"bot_token": TOKEN, "channel": "#a"}})
    assert TOKEN not in repr(config) and TOKEN not in config.model_dump_json()


# ---------------------------------------------------------------------------- factory


def test_factory_console_by_default_jsonl_with_event_log(tmp_path: Path) -> None:
    notifiers = build_notifiers(None, tmp_path, env={})
    assert [type(n) for n in notifiers] == [ConsoleNotifier]
    log = EventLog(tmp_path / "events.jsonl")
    notifiers = build_notifiers(NotifyConfig(), tmp_path, event_log=log, env={})
    assert [type(n) for n in notifiers] == [ConsoleNotifier, JsonlNotifier]
    notifiers = build_notifiers(
        NotifyConfig(event_log="pages.jsonl", console="never"), tmp_path, env={}
    )
    assert [type(n) for n in notifiers] == [JsonlNotifier]
    assert notifiers[0].event_log.path == tmp_path / "pages.jsonl"
    notifiers[0].close()
    with pytest.raises(ValueError, match="relative but there is no run dir"):
        build_notifiers(NotifyConfig(event_log="pages.jsonl"), None, env={})
    log.close()


def test_factory_slack_when_configured(fake: FakeSlack, tmp_path: Path) -> None:
    env = {
        "SLACK_BOT_TOKEN": fake.token,
        "MECHWATCH_SLACK_CHANNEL": "#alerts",
        "MECHWATCH_SLACK_BASE_URL": fake.base_url,
    }
    notifiers = build_notifiers(NotifyConfig(), tmp_path, env=env)
    assert [type(n) for n in notifiers] == [SlackNotifier]
    assert [
        type(n) for n in build_notifiers(NotifyConfig(console="always"), tmp_path, env=env)
    ] == [SlackNotifier, ConsoleNotifier]
    config = NotifyConfig.model_validate({"delivery": {"retry_initial_s": 0.05}})
    pages = build_dispatcher(config, tmp_path, env=env)
    assert isinstance(pages, PageDispatcher)
    for event in example_incident_events():
        pages.submit(event)
    assert pages.close(5)
    assert len(fake.posts()) == 3
    assert build_dispatcher(NotifyConfig(console="never"), tmp_path, env={}) is None


# ---------------------------------------------------------------------------- slack-test


def _cli_env(monkeypatch: pytest.MonkeyPatch, fake: FakeSlack, **overrides: str) -> None:
    env = {
        "SLACK_BOT_TOKEN": fake.token,
        "MECHWATCH_SLACK_CHANNEL": "#alerts",
        "MECHWATCH_SLACK_BASE_URL": fake.base_url,
        **overrides,
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)


def test_slack_test_ok(
    fake: FakeSlack, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _cli_env(monkeypatch, fake)
    assert cli_slack_test([]) == 0
    out = capsys.readouterr().out
    assert "ok: auth.test: bot 'mechwatch'" in out and "mechwatch-test" in out
    assert "ok: test page posted to #alerts" in out
    assert "ok: reply posted in the page's thread" in out
    assert [r.method for r in fake.requests] == [
        "auth.test",
        "chat.postMessage",
        "chat.postMessage",
    ]
    posts = fake.posts()
    assert "TEST page" in str(posts[0]["blocks"]) and posts[1]["thread_ts"] == posts[0]["_ts"]


@pytest.mark.parametrize(
    ("setup", "expected"),
    [
        (
            "bad_token",
            [
                "FAILED: auth.test (is the token valid?): invalid_auth",
                "hint: the bot token is not valid",
            ],
        ),
        (
            "bad_channel",
            [
                "FAILED: posting the test page: channel_not_found",
                "hint: Slack knows no channel #nowhere",
            ],
        ),
        (
            "down",
            [
                "FAILED: auth.test (is the token valid?): connection_refused",
                "hint: nothing accepts connections at http://127.0.0.1:",
            ],
        ),
        (
            "rate_limited_for_an_hour",
            [
                "FAILED: posting the test page: ratelimited",
                "Slack asked to wait 3600 s (Retry-After); try again after ",
                "hint: Slack is rate-limiting this app",
            ],
        ),
    ],
)
def test_slack_test_says_what_is_wrong(
    fake: FakeSlack,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    setup: str,
    expected: list[str],
) -> None:
    if setup == "bad_token":
        _cli_env(monkeypatch, fake, SLACK_BOT_TOKEN="xoxb-0-0-WRONGwrongWRONG")
    elif setup == "bad_channel":
        _cli_env(monkeypatch, fake, MECHWATCH_SLACK_CHANNEL="#nowhere")
    elif setup == "down":
        _cli_env(monkeypatch, fake)
        fake.down()
    else:
        _cli_env(monkeypatch, fake)
        fake.script("chat.postMessage", Reply.ratelimited(3600))
    started = time.monotonic()
    assert cli_slack_test([]) == 1
    assert time.monotonic() - started < 2  # an hour's Retry-After is reported, not slept
    err = capsys.readouterr().err
    for line in expected:
        assert line in err, err
    assert len(fake.requests) <= 2  # one try each, no retry loop in an interactive check


def test_slack_test_waits_out_a_short_rate_limit(
    fake: FakeSlack, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _cli_env(monkeypatch, fake)
    fake.script("chat.postMessage", Reply.ratelimited(1))
    assert cli_slack_test([]) == 0
    out = capsys.readouterr().out
    assert "waiting 1 s as Slack asks (retry 1 of at most 3)" in out
    assert "ok: test page posted to #alerts" in out and "ok: reply posted in the page's" in out
    attempts = fake.requests_for("chat.postMessage")
    assert [r.status for r in attempts] == [429, 200, 200]
    waited = attempts[1].time - attempts[0].time
    assert 1.0 <= waited < 1.8, waited
    assert len(fake.posts()) == 2


def test_slack_test_rate_limit_retries_are_bounded(
    fake: FakeSlack, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _cli_env(monkeypatch, fake)
    fake.script("chat.postMessage", *[Reply.ratelimited(0)] * 10)
    assert cli_slack_test([]) == 1
    err = capsys.readouterr().err
    assert "FAILED: posting the test page: ratelimited" in err
    assert "Slack asked to wait 0 s (Retry-After)" in err
    assert len(fake.requests_for("chat.postMessage")) == 4  # the try and 3 retries


def test_slack_test_not_configured_and_bad_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli_slack_test([]) == 2
    assert "Slack is not configured" in capsys.readouterr().err
    bad = tmp_path / "agent.yaml"
    bad.write_text("notify:\n  slack:\n    chanel: '#a'\n")
    assert cli_slack_test(["--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "FAILED: configuration" in err and "slack.chanel" in err
    assert cli_slack_test(["--config", str(tmp_path / "missing.yaml")]) == 2
    assert "no such file" in capsys.readouterr().err


def test_slack_test_webhook_from_yaml(
    fake: FakeSlack, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "agent.yaml"
    config.write_text(f"notify:\n  slack:\n    webhook_url: {fake.webhook_url}\n")
    assert cli_slack_test(["--config", str(config)]) == 0
    out = capsys.readouterr().out
    assert "ok: test page posted via the webhook" in out
    assert "as a new message (webhooks cannot thread)" in out
    assert len(fake.webhook_posts()) == 2
    assert WEBHOOK_PATH not in out


# ---------------------------------------------------------------------------- secrets


def test_token_never_appears_in_any_output(
    fake: FakeSlack,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
) -> None:
    caplog.set_level(logging.DEBUG)
    # Turn slack-sdk's own request tracing on: the webhook client logs its URL.
    sdk_logger = logging.getLogger("mechwatch.notify.slack_sdk")
    monkeypatch.setattr(sdk_logger, "level", sdk_logger.level)  # restored after the test
    sdk_logger.setLevel(logging.DEBUG)  # setLevel also clears the logger's level cache
    wrong = "xoxb-0000000000-0000000000-WrongButSecret"
    console = io.StringIO()
    log = EventLog(tmp_path / "events.jsonl")
    events = example_incident_events()
    # 1. A bot with a wrong token, then the right one, with outages in between.
    with PageDispatcher(
        [bot_notifier(fake, token=wrong), ConsoleNotifier(console), JsonlNotifier(log)],
        tmp_path,
        delivery=fast_delivery(),
    ) as pages:
        for event in events:
            pages.submit(event)
        pages.flush(2)
    fake.script("chat.postMessage", Reply.server_error(), Reply.ratelimited(0))
    with PageDispatcher(
        [bot_notifier(fake), ConsoleNotifier(console), JsonlNotifier(log)],
        tmp_path,
        delivery=fast_delivery(),
    ) as pages:
        assert pages.flush(5)
    # 2. A webhook, failing permanently once.
    from slack_server import webhook_notifier

    fake.script("webhook", Reply.error("invalid_token", status=403))
    with PageDispatcher(
        [webhook_notifier(fake)], tmp_path / "hook", delivery=fast_delivery()
    ) as pages:
        pages.submit(events[0])
        pages.flush(1)
    # 3. slack-test with a wrong token and with the server down.
    _cli_env(monkeypatch, fake, SLACK_BOT_TOKEN=wrong)
    cli_slack_test([])
    fake.down()
    _cli_env(monkeypatch, fake)
    cli_slack_test([])
    log.close()
    captured = capsys.readouterr()
    outputs = {
        "logs": caplog.text,
        "stdout": captured.out,
        "stderr": captured.err,
        "console": console.getvalue(),
    }
    for path in tmp_path.rglob("*"):
        if path.is_file():
            outputs[str(path)] = path.read_text(errors="replace")
    assert len(read_events(log.path, "page")) == 3
    assert "invalid_auth" in caplog.text and "invalid_token" in caplog.text  # errors logged
    assert "WEBHOOKsecretPATH" not in caplog.text
    for secret in (fake.token, wrong, WEBHOOK_PATH, "WEBHOOKsecretPATH123456"):
        leaks = [name for name, text in outputs.items() if secret in text]
        assert leaks == [], f"{secret[:8]}... leaked into {leaks}"
