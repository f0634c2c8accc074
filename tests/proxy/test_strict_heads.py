"""Every request is parsed by aiohttp's strict parser: a generate call whose head it refuses is a
400 in vLLM's error shape (``QuietRequestHandler``), logged in one INFO line, and never reaches a
worker."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest

from tests.proxy.conftest import ProxyFactory, req
from tests.proxy.scripted import Scripted, ScriptedFactory, prefill_reply

BODY = json.dumps(req()).encode()
PLAIN = [b"Host: 127.0.0.1", b"Content-Type: application/json"]
HEADS = {
    "no host": [b"Content-Type: application/json"],
    "host twice": [*PLAIN, b"Host: 127.0.0.1"],
    "content-type twice": [*PLAIN, b"Content-Type: text/plain"],
    "user-agent twice": [*PLAIN, b"User-Agent: a", b"User-Agent: b"],
    "max-forwards twice": [*PLAIN, b"Max-Forwards: 1", b"Max-Forwards: 2"],
    "content-location twice": [*PLAIN, b"Content-Location: /a", b"Content-Location: /b"],
    "sec-websocket-key1": [*PLAIN, b"Sec-WebSocket-Key1: 4 @1  46546xW%0l 1 5"],
    "content-length twice": [*PLAIN, f"Content-Length: {len(BODY)}".encode()],
}
"""The headers of each head besides one ``Content-Length`` (on HTTP/1.1)."""


async def _send(port: int, headers: list[bytes]) -> bytes:
    """``POST /inference/v1/generate`` with ``headers`` and a valid body, as raw bytes, on a new
    connection (``Connection: close``); all the server answers."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"POST /inference/v1/generate HTTP/1.1\r\nConnection: close\r\n" +
                     b"".join(h + b"\r\n" for h in headers) +
                     f"Content-Length: {len(BODY)}\r\n\r\n".encode() + BODY)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), 10.0)
    finally:
        writer.close()


@pytest.mark.parametrize("name", list(HEADS))
async def test_a_head_aiohttps_parser_refuses_is_a_400_and_reaches_no_worker(
        scripted_factory: ScriptedFactory, proxy_factory: ProxyFactory, caplog: pytest.LogCaptureFixture,
        name: str) -> None:
    p: Scripted = await scripted_factory(lambda body, request: prefill_reply(body))
    d: Scripted = await scripted_factory(lambda body, request: prefill_reply(body))
    client, _ = await proxy_factory([p.url], [d.url])
    assert client.port is not None
    caplog.set_level(logging.INFO)
    raw = await _send(client.port, HEADS[name])
    head, _, payload = raw.partition(b"\r\n\r\n")
    assert head.split(b" ", 2)[1] == b"400", raw  # (aiohttp answers a head it refused as HTTP/1.0)
    error = json.loads(payload)["error"]
    assert error["code"] == 400 and error["message"].startswith("malformed HTTP request")
    assert p.received == [] and d.received == []
    # (the pools' background learners may warn about these test workers: not the request's doing)
    assert not [r for r in caplog.records
                if r.levelno >= logging.WARNING and not r.name.startswith("proxy.pools")], caplog.text
    ours = [r for r in caplog.records if r.name == "pd_proxy"]
    assert len(ours) == 1 and ours[0].levelno == logging.INFO, caplog.text
    assert ours[0].getMessage().startswith("refused a malformed HTTP request")


async def test_the_same_head_well_formed_is_served(
        scripted_factory: ScriptedFactory, proxy_factory: ProxyFactory) -> None:
    """The control: the plain head of the cases above reaches both workers and is answered."""
    p: Scripted = await scripted_factory(lambda body, request: prefill_reply(body))
    d: Scripted = await scripted_factory(lambda body, request: prefill_reply(body))
    client, _ = await proxy_factory([p.url], [d.url])
    assert client.port is not None
    raw = await _send(client.port, PLAIN)
    assert raw.startswith(b"HTTP/1.1 200 "), raw
    assert len(p.received) == 1 and len(d.received) == 1
