"""proxy.http.lean: the generate and abort calls skip the router and the middleware chain, and answer
exactly as the full path does (keys before bodies, body limits, 404/405 and every error in vLLM's
shape). Disconnects on the lean path: ``test_aborts.py`` (every test there goes through it)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from proxy.http.app import DRAINING, SERVING
from proxy.http.lean import LeanApplication
from tests.proxy.conftest import PDFactory, req

LEAN = ("/inference/v1/generate", "/inference/v1/abort_requests", "/abort_requests")
KEY = "sk-lean-test"
SECRET = "secret " + "prompt text"  # built, so the traceback's source line does not hold it


async def _raw(port: int, head: str, body: bytes = b"", *,
               limit: float = 3.0) -> tuple[int, dict[str, str], Any]:
    """One request on its own connection; the status, headers and JSON body of the answer."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(head.encode() + b"\r\n" + body)
        await writer.drain()
        status_line = await asyncio.wait_for(reader.readline(), limit)
        headers: dict[str, str] = {}
        while (line := await asyncio.wait_for(reader.readline(), limit)) not in (b"\r\n", b""):
            name, _, value = line.decode().partition(":")
            headers[name.strip().lower()] = value.strip()
        data = await asyncio.wait_for(reader.readexactly(int(headers["content-length"])), limit)
        return int(status_line.split()[1]), headers, json.loads(data)
    finally:
        writer.close()


async def test_the_hot_calls_skip_the_router(pd_factory: PDFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    pd = await pd_factory(api_key=KEY)
    assert isinstance(pd.app, LeanApplication)
    resolved: list[str] = []
    resolve = pd.app.router.resolve

    async def counting(request: Any) -> Any:
        resolved.append(request.path)
        return await resolve(request)

    monkeypatch.setattr(pd.app.router, "resolve", counting)
    auth = {"Authorization": f"Bearer {KEY}"}
    status, body, _ = await pd.gen(req(request_id="lean-1"), headers=auth)
    assert status == 200 and body["request_id"] == "generate-tokens-lean-1"
    for path in LEAN[1:]:
        r = await pd.client.post(path, json={"request_ids": ["generate-tokens-x"]}, headers=auth)
        assert r.status == 200
    r = await pd.client.get("/livez")
    assert r.status == 200
    assert resolved == ["/livez"]
    await pd.quiet()


async def test_other_methods_and_near_paths_answer_as_the_router_does(pd_factory: PDFactory) -> None:
    pd = await pd_factory()
    for path in LEAN:
        r = await pd.client.get(path)
        assert r.status == 405 and await r.json() == {"detail": "Method Not Allowed"}
        assert r.headers["Allow"] == "POST"
    port = pd.client.port
    assert port is not None
    for path in ("/inference/v1%2Fgenerate", "/inference/v1/generate/", "/Inference/v1/generate"):
        status, _, body = await _raw(port, f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n", b"{}")
        assert (status, body) == (404, {"detail": "Not Found"}), path
    status, body, _ = await pd.gen(req(request_id="q"), params={"x": "1"})  # a query string: served
    assert status == 200 and body["request_id"] == "generate-tokens-q"
    await pd.quiet()


async def test_keys_are_checked_before_the_body_is_read(pd_factory: PDFactory) -> None:
    pd = await pd_factory(api_key=KEY)
    port = pd.client.port
    assert port is not None
    for path in LEAN:
        for auth in ("", "Authorization: Bearer wrong\r\n"):
            # 100 bytes announced, none sent: answered at once, the body never waited for
            head = f"POST {path} HTTP/1.1\r\nHost: x\r\n{auth}Content-Length: 100\r\n"
            status, _, body = await _raw(port, head)
            assert (status, body) == (401, {"error": "Unauthorized"}), path
    metrics = await (await pd.client.get("/metrics")).text()
    assert 'pd_proxy_requests_total{outcome="client_error"} 2.0' in metrics  # the generate calls


async def test_body_limits_hold_on_the_lean_paths(pd_factory: PDFactory) -> None:
    pd = await pd_factory(max_body_bytes=2000, body_timeout=0.2)
    port = pd.client.port
    assert port is not None
    for path in LEAN:
        r = await pd.client.post(path, data=b"x" * 2001, headers={"Content-Type": "application/json"})
        assert r.status == 413
        assert await r.json() == {"error": {
            "message": "Request body too large: 2001 bytes, the limit is 2000",
            "type": "Request Entity Too Large", "param": None, "code": 413}}
        status, _, body = await _raw(port, f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n", b"{")
        assert status == 408
        assert body["error"]["message"] == "the request body did not arrive within 0.2 s"


async def test_an_expect_100_continue_call_is_served(pd_factory: PDFactory) -> None:
    pd = await pd_factory()
    status, body, _ = await pd.gen(req(request_id="ex"), expect100=True)
    assert status == 200 and body["request_id"] == "generate-tokens-ex"
    await pd.quiet()


async def test_an_unexpected_error_is_a_500_in_vllms_shape(
        pd_factory: PDFactory, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    pd = await pd_factory()

    async def broken(*_: Any, **__: Any) -> Any:
        raise RuntimeError(SECRET)

    monkeypatch.setattr(pd.app[SERVING], "generate", broken)
    status, body, _ = await pd.gen(req())
    assert status == 500
    assert body == {"error": {"message": "Internal server error", "type": "InternalServerError",
                              "param": None, "code": 500}}
    assert "unexpected RuntimeError while serving POST /inference/v1/generate" in caplog.text
    assert SECRET not in caplog.text


async def test_a_generate_call_while_draining_is_a_503(pd_factory: PDFactory) -> None:
    pd = await pd_factory()
    pd.app[DRAINING].set()
    status, body, _ = await pd.gen(req())
    assert status == 503 and body["error"]["type"] == "ServiceUnavailableError"
    metrics = await (await pd.client.get("/metrics")).text()
    assert 'pd_proxy_requests_total{outcome="rejected"} 1.0' in metrics
