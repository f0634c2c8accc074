"""``pd-proxy`` warns at start-up when it listens beyond loopback with no client API key: anyone who can
reach the port can then generate and abort. Nothing listens here: ``serve`` is replaced, and the hosts
are only strings given to the CLI."""

from __future__ import annotations

import logging

import pytest

from proxy import cli
from proxy.config.settings import ProxySettings

WORKERS = ["--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"]
KEY = "client-key-Wq93"


def start(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
          *args: str) -> list[logging.LogRecord]:
    """Run ``pd-proxy ARGS`` up to the point it would serve; the WARNING records it logged."""
    served: list[ProxySettings] = []
    monkeypatch.setattr(cli, "serve", lambda settings, sock=None: served.append(settings))
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        cli.main([*WORKERS, *args])
    assert len(served) == 1
    return [r for r in caplog.records if r.levelno == logging.WARNING]


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "proxy.example.internal"])
def test_warns_when_listening_beyond_loopback_without_a_key(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, host: str) -> None:
    monkeypatch.delenv("PD_PROXY_API_KEY", raising=False)
    (record,) = start(monkeypatch, caplog, "--host", host)
    message = record.getMessage()
    assert record.name == "proxy.cli"
    assert host in message and "--api-key" in message and "PD_PROXY_API_KEY" in message


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "localhost"])
def test_no_warning_on_loopback(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
                                host: str) -> None:
    monkeypatch.delenv("PD_PROXY_API_KEY", raising=False)
    assert start(monkeypatch, caplog, "--host", host) == []


def test_no_warning_with_a_key_from_the_flag_or_the_environment(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.delenv("PD_PROXY_API_KEY", raising=False)
    # The flag guards the port; it only earns the warning about keys on the command line
    (record,) = start(monkeypatch, caplog, "--host", "0.0.0.0", "--api-key", KEY)
    assert record.getMessage().startswith("--api-key on the command line")
    monkeypatch.setenv("PD_PROXY_API_KEY", KEY)
    assert start(monkeypatch, caplog, "--host", "0.0.0.0") == []
    # An empty key guards nothing (the app adds no auth for it): still a warning.
    monkeypatch.setenv("PD_PROXY_API_KEY", "")
    assert len(start(monkeypatch, caplog, "--host", "0.0.0.0")) == 1


@pytest.mark.parametrize(("args", "flags"), [
    (["--api-key", KEY], ["--api-key"]),
    ([f"--upstream-api-key={KEY}"], ["--upstream-api-key"]),
    (["--api-key", KEY, "--api-key", KEY + "2", "--upstream-api-key", KEY],
     ["--api-key", "--upstream-api-key"]),
])
def test_a_key_on_the_command_line_is_warned_about_without_the_key(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, args: list[str],
        flags: list[str]) -> None:
    records = start(monkeypatch, caplog, *args)
    messages = [r.getMessage() for r in records if "on the command line" in r.getMessage()]
    assert [m.split(" ", 1)[0] for m in messages] == flags
    assert all("ps" in m and KEY not in m for m in messages)


def test_keys_from_the_environment_are_not_warned_about(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("PD_PROXY_API_KEY", KEY)
    monkeypatch.setenv("PD_PROXY_UPSTREAM_API_KEY", KEY)
    assert [r for r in start(monkeypatch, caplog) if "command line" in r.getMessage()] == []
