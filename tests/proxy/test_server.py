"""proxy.http.server: one server process, its settings handed to aiohttp (the listener's TLS, the
header timer, the drain) and to the shared socket of ``--workers N``."""

from __future__ import annotations

import asyncio
import socket
import ssl
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from proxy.cli import parse_args
from proxy.http.server import serve


def test_cli_wires_listening_tls(monkeypatch: pytest.MonkeyPatch, certs: dict[str, Path]) -> None:
    seen: dict[str, Any] = {}
    monkeypatch.setattr(web, "run_app", lambda app, **kw: seen.update(kw))
    monkeypatch.setattr(asyncio, "set_event_loop", lambda loop: None)
    serve(parse_args(["--prefill", "http://127.0.0.1:1", "--decode", "https://127.0.0.1:2",
                      "--tls-cert-file", str(certs["server"]), "--tls-key-file", str(certs["server_key"])]))
    seen["loop"].close()
    ctx = seen["ssl_context"]
    assert isinstance(ctx, ssl.SSLContext) and ctx.minimum_version >= ssl.TLSVersion.TLSv1_2


def test_header_timeout_is_the_servers_keepalive_timer(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--header-timeout`` reaches aiohttp as ``keepalive_timeout`` (the timer that closes a
    connection whose request head has not arrived)."""
    seen: dict[str, Any] = {}
    monkeypatch.setattr(web, "run_app", lambda app, **kw: seen.update(kw))
    monkeypatch.setattr(asyncio, "set_event_loop", lambda loop: None)
    serve(parse_args(["--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2",
                          "--header-timeout", "2.5"]))
    seen["loop"].close()
    assert seen["keepalive_timeout"] == 2.5
    assert seen["handler_cancellation"] is True


def test_a_shared_socket_replaces_host_and_port_and_the_drain_is_the_shutdown_timeout(
        monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {}
    monkeypatch.setattr(web, "run_app", lambda app, **kw: seen.update(kw))
    monkeypatch.setattr(asyncio, "set_event_loop", lambda loop: None)
    sock = socket.socket()
    try:
        serve(parse_args(["--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2",
                          "--drain-timeout", "7"]), sock)
        seen["loop"].close()
    finally:
        sock.close()
    assert seen["sock"] is sock and "host" not in seen and "port" not in seen
    assert seen["shutdown_timeout"] == 7.0 and seen["ssl_context"] is None and seen["access_log"] is None
