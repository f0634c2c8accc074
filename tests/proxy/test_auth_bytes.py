"""An ``Authorization`` value that is not UTF-8 is a wrong key: a 401 in vLLM's shape on every
route that checks keys (the client keys, the admin key, the admin API), never a 500, an ERROR
record or the key's bytes in the log."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest

from proxy.config.tenants import Tenants
from proxy.pools import PoolSettings
from tests.proxy.conftest import ProxyFactory

BAD_KEYS = [b"Bearer \xff\xfe", b"Bearer k1\x80", b"bEaReR \xc3\x28", b"\xff\xfe"]
"""Not UTF-8: a lone continuation byte, an invalid pair, a stray byte after a valid key, no scheme."""


async def _ask(port: int, method: str, path: str, authorization: bytes,
               body: bytes = b"") -> tuple[int, bytes]:
    """One request written as raw bytes on a new connection; the status and the body."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n".encode() +
                     b"Authorization: " + authorization + b"\r\n" +
                     (b"Content-Type: application/json\r\n" if body else b"") +
                     f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        await writer.drain()
        raw = await asyncio.wait_for(reader.read(), 10.0)  # the server closes: Connection: close
    finally:
        writer.close()
    head, _, payload = raw.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), payload


GENERATE = json.dumps({"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 2}}).encode()
ABORT = json.dumps({"request_ids": ["r1"]}).encode()
ROUTES = [("POST", "/inference/v1/generate", GENERATE), ("POST", "/inference/v1/abort_requests", ABORT),
          ("POST", "/abort_requests", ABORT), ("GET", "/debug/requests", b""), ("GET", "/debug/runtime", b""),
          ("GET", "/admin/workers", b"")]


@pytest.mark.parametrize(("method", "path", "body"), ROUTES, ids=[p for _, p, _ in ROUTES])
async def test_a_key_that_is_not_utf8_is_a_401_on_every_route_that_checks_keys(
        proxy_factory: ProxyFactory, caplog: pytest.LogCaptureFixture, method: str, path: str,
        body: bytes) -> None:
    client, _ = await proxy_factory(["http://127.0.0.1:9"], ["http://127.0.0.1:9"], api_key="k1",
                                    pools=PoolSettings.plain(admin_key="adm"))
    assert client.port is not None
    caplog.set_level(logging.DEBUG)
    for key in BAD_KEYS:
        status, payload = await _ask(client.port, method, path, key, body)
        assert status == 401, (key, payload)
        assert json.loads(payload) == {"error": "Unauthorized"}  # vLLM's 401
    # (the pools' background learners may warn about these test workers: not the request's doing)
    assert not [r for r in caplog.records
                if r.levelno >= logging.WARNING and not r.name.startswith("proxy.pools")], caplog.text
    assert "\udcff" not in caplog.text and "\\xff" not in caplog.text and "xff" not in caplog.text


async def test_health_with_a_key_that_is_not_utf8_answers_without_the_admin_view(
        proxy_factory: ProxyFactory, caplog: pytest.LogCaptureFixture) -> None:
    """``/health`` is open; the admin key only adds the pools' detail: a key that is not UTF-8
    gets the open answer."""
    client, _ = await proxy_factory(["http://127.0.0.1:9"], ["http://127.0.0.1:9"],
                                    pools=PoolSettings.plain(admin_key="adm"))
    assert client.port is not None
    caplog.set_level(logging.DEBUG)
    status, payload = await _ask(client.port, "GET", "/health", b"Bearer \xff\xfe")
    assert status in (200, 503) and "pools" not in json.loads(payload)
    status, payload = await _ask(client.port, "GET", "/health", b"Bearer adm")
    assert "pools" in json.loads(payload)  # the admin key still opens it
    # (the pools' background learners may warn about these test workers: not the request's doing)
    assert not [r for r in caplog.records
                if r.levelno >= logging.WARNING and not r.name.startswith("proxy.pools")], caplog.text


def test_tenants_take_a_value_decoded_with_surrogates_as_a_wrong_key() -> None:
    """aiohttp hands a header's bytes that are not UTF-8 on as surrogates (``surrogateescape``)."""
    tenants = Tenants([(None, "k1"), ("b", "k2")])
    for raw in BAD_KEYS:
        assert tenants.identify(raw.decode("utf-8", "surrogateescape")) is None
    assert tenants.identify("Bearer k1") is not None
