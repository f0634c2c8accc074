"""proxy.front: the generate and abort calls in their plain form on the proxy's own protocol, every
other request handed with its connection to aiohttp's server, and both answering alike. (The rest
of the suite goes through the front too: every test that posts a generate call.)"""

from __future__ import annotations

import asyncio
import gzip
import json
import logging
import ssl
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from proxy.app import build_app
from proxy.cli import parse_args
from proxy.front import FRONT_BODY_BYTES, FrontRoute, FrontServer, Head, parse_head
from proxy.hop_wire import HopConnection
from proxy.pools import PoolSettings
from proxy.relay import StreamBuffer
from proxy.settings import ProxySettings
from proxy.tls import server_context
from tests.proxy.conftest import PD, PDFactory, req
from tests.reliability.harness import start_world

GENERATE = "/inference/v1/generate"
KEY = "sk-front-test"


async def _no_handler(_: web.Request) -> web.StreamResponse:
    raise AssertionError("not called")


ROUTES = {GENERATE: FrontRoute(_no_handler)}
PLAIN = b"POST /inference/v1/generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"


def _parse(head: bytes, body: bytes = b"{}") -> Head | str | None:
    return parse_head(bytearray(head + b"\r\n" + body), ROUTES, FRONT_BODY_BYTES)


def test_a_plain_head_is_served_with_its_headers_and_length() -> None:
    head = _parse(PLAIN + b"X-Request-Id:  abc \t\r\nx-request-id: d\xc3\xa9f\r\nContent-Length: 2\r\n")
    assert isinstance(head, Head)
    assert (head.path, head.length, head.keep_alive) == (GENERATE, 2, True)
    assert head.headers.getall("X-REQUEST-ID") == ["abc", "déf"]
    assert head.headers["content-type"] == "application/json"
    assert head.body_start == len(PLAIN) + len(b"X-Request-Id:  abc \t\r\nx-request-id: d\xc3\xa9f\r\n"
                                               b"Content-Length: 2\r\n\r\n")
    closing = _parse(PLAIN + b"Connection: keep-alive, Close\r\nContent-Length: 2\r\n")
    assert isinstance(closing, Head) and closing.keep_alive is False


def test_a_value_keeps_its_inner_blanks_and_loses_the_outer_ones_whatever_their_length() -> None:
    """Outer spaces and tabs are not the value's (RFC 9112 5), inner ones are; a long run of
    them is parsed like a short one (a lazy value before the trailing blanks once backtracked
    over it: 8,000 blanks took ~96 ms of the event loop, before any key check;
    ``benchmarks/internals/front_head.py``)."""
    for n in (1, 100, 2600):  # three runs of 2,600: the head stays under the front's 8 KiB
        blanks = b" \t" * (n // 2) + b" " * (n % 2)
        value = blanks + b"a" + blanks + b"b" + blanks
        head = _parse(PLAIN + b"X-Pad:" + value + b"\r\nContent-Length: 2\r\n")
        assert isinstance(head, Head)
        assert head.headers["X-Pad"] == "a" + blanks.decode() + "b"


def test_an_unfinished_head_waits_and_an_endless_one_is_handed_off() -> None:
    assert parse_head(bytearray(PLAIN), ROUTES, FRONT_BODY_BYTES) is None
    assert parse_head(bytearray(PLAIN + b"X-A: " + b"a" * 9000), ROUTES, FRONT_BODY_BYTES) == "hand off"


@pytest.mark.parametrize("head", [
    b"POST /inference/v1/generate HTTP/1.0\r\nContent-Length: 2\r\n",          # HTTP/1.0
    b"GET /inference/v1/generate HTTP/1.1\r\nContent-Length: 2\r\n",           # another method
    b"POST /inference/v1/generate?x=1 HTTP/1.1\r\nContent-Length: 2\r\n",      # a query string
    b"POST /inference/v1%2Fgenerate HTTP/1.1\r\nContent-Length: 2\r\n",        # another path
    b"POST /health HTTP/1.1\r\nContent-Length: 2\r\n",
    PLAIN + b"Transfer-Encoding: chunked\r\n",
    PLAIN + b"Content-Length: 2\r\nContent-Encoding: gzip\r\n",
    PLAIN + b"Content-Length: 2\r\nExpect: 100-continue\r\n",
    PLAIN + b"Content-Length: 2\r\nUpgrade: websocket\r\n",
    PLAIN + b"Content-Length: 2\r\nConnection: Upgrade\r\n",
    PLAIN,                                                                      # no length
    PLAIN + b"Content-Length: 2\r\nContent-Length: 2\r\n",                      # two lengths
    PLAIN + b"Content-Length: +2\r\n",
    PLAIN + b"Content-Length: 2 2\r\n",
    PLAIN + b"Content-Length: " + str(FRONT_BODY_BYTES + 1).encode() + b"\r\n",  # aiohttp's large path
    PLAIN + b"Content-Length : 2\r\n",                                          # space before the colon
    PLAIN + b"Content-Length: 2\r\n folded\r\n",                                # obs-fold
    PLAIN + b"Content-Length: 2\r\nX-A: a\x01b\r\n",                            # a control byte
    PLAIN + b"Content-Length: 2\r\nX-A: a\nb\r\n",                              # a bare LF
    PLAIN + b"Content-Length: 2\r\nX A: b\r\n",                                 # not a field name
    PLAIN.replace(b"\r\n", b"\n"),
], ids=lambda h: h.decode(errors="replace")[:60])
def test_anything_but_the_plain_form_is_handed_to_aiohttp(head: bytes) -> None:
    assert _parse(head) == "hand off"


Answer = tuple[int, dict[str, str], bytes]


async def _exchange(port: int, data: bytes, answers: int, *, limit: float = 5.0) -> list[Answer]:
    """``data`` written at once on one connection; ``answers`` responses read back (each framed by
    its Content-Length, or chunked): status, headers (names lower-cased), body."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    out: list[Answer] = []
    try:
        writer.write(data)
        await writer.drain()
        for _ in range(answers):
            status_line = await asyncio.wait_for(reader.readline(), limit)
            headers: dict[str, str] = {}
            while (line := await asyncio.wait_for(reader.readline(), limit)) not in (b"\r\n", b""):
                name, _, value = line.decode().partition(":")
                headers[name.strip().lower()] = value.strip()
            if headers.get("transfer-encoding") == "chunked":
                body = b""
                while size := int(await asyncio.wait_for(reader.readline(), limit), 16):
                    body += await asyncio.wait_for(reader.readexactly(size + 2), limit)
                    body = body[:-2]
                await reader.readline()
            else:
                body = await asyncio.wait_for(reader.readexactly(int(headers["content-length"])), limit)
            out.append((int(status_line.split()[1]), headers, body))
        return out
    finally:
        writer.close()


def _paced(itl_ms: float) -> dict[str, Any]:
    """A decode worker that sends a token every ``itl_ms`` and spends no other time."""
    return {"zero_latency": False, "itl_ms": itl_ms, "prefill_base_ms": 0, "prefill_per_token_ms": 0,
            "transfer_per_block_ms": 0}


def _port(pd: PD) -> int:
    """The proxy's port on loopback."""
    port = pd.client.port
    assert port is not None
    return port


def _post(path: str, body: bytes, extra: str = "", version: str = "1.1") -> bytes:
    return (f"POST {path} HTTP/{version}\r\nHost: x\r\nContent-Type: application/json\r\n{extra}"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


def _gen(request_id: str, extra: str = "", **kw: Any) -> bytes:
    return _post(GENERATE, json.dumps(req(request_id=request_id, **kw)).encode(), extra)


def _count_hand_offs(server: object, monkeypatch: pytest.MonkeyPatch) -> list[web.RequestHandler]:
    """The aiohttp request handlers ``server`` (the app's ``FrontServer``) hands connections to."""
    assert isinstance(server, FrontServer)
    handed: list[web.RequestHandler] = []
    original = server.aiohttp_protocol

    def counting() -> web.RequestHandler:
        handed.append(original())
        return handed[-1]

    monkeypatch.setattr(server, "aiohttp_protocol", counting)
    return handed


async def _counted_pd(pd_factory: PDFactory, monkeypatch: pytest.MonkeyPatch) -> tuple[PD, list[Any], int]:
    """A P/D pair behind the proxy; the hand-offs counted; the proxy's port."""
    pd = await pd_factory()
    assert pd.client.server is not None and pd.client.server.runner is not None
    return pd, _count_hand_offs(pd.client.server.runner.server, monkeypatch), _port(pd)


async def test_the_hot_calls_stay_on_the_front_and_others_go_to_aiohttp(
        pd_factory: PDFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    pd, handed, port = await _counted_pd(pd_factory, monkeypatch)
    # Two generate calls, an abort and a health check pipelined on one connection: the front
    # answers the first three in order, then hands the connection over for the fourth.
    abort = _post("/inference/v1/abort_requests", b'{"request_ids": ["generate-tokens-nobody"]}')
    got = await _exchange(port, _gen("p-1") + _gen("p-2", sp={"max_tokens": 3}) + abort +
                          b"GET /livez HTTP/1.1\r\nHost: x\r\n\r\n", 4)
    assert [status for status, _, _ in got] == [200, 200, 200, 200]
    first, second = json.loads(got[0][2]), json.loads(got[1][2])
    assert first["request_id"] == "generate-tokens-p-1" and len(first["choices"][0]["token_ids"]) == 8
    assert second["request_id"] == "generate-tokens-p-2" and len(second["choices"][0]["token_ids"]) == 3
    assert got[0][1]["x-request-id"] == "p-1" and "server-timing" in got[0][1]
    assert json.loads(got[3][2]) == {"status": "ok"}
    assert len(handed) == 1
    # The test client's pooled connections: generate calls never leave the front
    status, body, _ = await pd.gen(req(request_id="c-1"))
    assert status == 200 and body["request_id"] == "generate-tokens-c-1"
    status, events, _ = await pd.stream(req(request_id="c-2"))
    assert status == 200 and events[-1] == "[DONE]"
    assert len(handed) == 1
    await pd.quiet()


async def test_a_request_not_in_the_plain_form_is_served_by_aiohttp_alike(
        pd_factory: PDFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    pd, handed, port = await _counted_pd(pd_factory, monkeypatch)
    body = json.dumps(req(request_id="h")).encode()
    chunked = (b"POST /inference/v1/generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Transfer-Encoding: chunked\r\n\r\n" + f"{len(body):x}\r\n".encode() + body +
               b"\r\n0\r\n\r\n")
    compressed = gzip.compress(body)
    for data in (_post(GENERATE, body, version="1.0"), chunked,
                 _post(GENERATE, compressed, "Content-Encoding: gzip\r\n"),
                 _post(GENERATE + "?x=1", body)):
        (status, headers, raw), = await _exchange(port, data, 1)
        assert status == 200 and json.loads(raw)["request_id"] == "generate-tokens-h", data[:60]
        assert headers["x-request-id"] == "h"
    assert len(handed) == 4
    await pd.quiet()


async def test_connection_close_is_answered_and_the_connection_closed(pd_factory: PDFactory) -> None:
    pd = await pd_factory()
    port = _port(pd)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(_gen("cc", "Connection: close\r\n"))
        raw = await asyncio.wait_for(reader.read(), 5.0)  # to the end: the server closes
    finally:
        writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK\r\n") and b"\r\nConnection: close" in head
    assert json.loads(body)["request_id"] == "generate-tokens-cc"
    await pd.quiet()


async def test_an_idle_connection_is_closed_after_the_keepalive_timeout(
        sim_factory: Any, aiohttp_client: Any) -> None:
    ps = [await sim_factory(role=role, zero_latency=True) for role in ("prefill", "decode")]
    app = build_app(ProxySettings(prefill_urls=(ps[0].url,), decode_urls=(ps[1].url,),
                                  pools=PoolSettings.plain()))
    server = TestServer(app)
    await server.start_server(keepalive_timeout=0.3)  # as pd-proxy's --header-timeout sets it
    pd = PD(await aiohttp_client(server), app, ps[:1], ps[1:])
    port = _port(pd)
    for first in (b"", PLAIN):  # nothing sent; a head that never ends
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(first)
            assert await asyncio.wait_for(reader.read(), 10.0) == b""
        finally:
            writer.close()
    # and after an answer: the connection is kept for a next request, then closed when idle
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(_gen("idle"))
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5.0)
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        await asyncio.wait_for(reader.readexactly(length), 5.0)
        assert await asyncio.wait_for(reader.read(), 10.0) == b""
    finally:
        writer.close()
    await pd.quiet()


async def test_a_client_gone_mid_request_cancels_it_and_frees_the_kv(pd_factory: PDFactory) -> None:
    pd = await pd_factory(decode=_paced(50))  # 200 tokens: 10 s
    port = _port(pd)
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(_gen("gone", sp={"max_tokens": 200}))
    await writer.drain()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 5.0
    while not len(pd.serving.table):  # the request is in flight on the front
        assert loop.time() < deadline
        await asyncio.sleep(0.01)
    writer.close()
    await pd.quiet(10.0)
    metrics = await (await pd.client.get("/metrics")).text()
    assert 'pd_proxy_requests_total{outcome="aborted"} 1.0' in metrics


def _comparable(answer: Answer) -> tuple[int, dict[str, str], Any]:
    status, headers, body = answer
    kept = {k: v for k, v in headers.items() if k not in ("date", "server-timing")}
    if headers.get("content-type", "").startswith("text/event-stream"):
        # a stream: its events in order ([DONE] last); the hops' ids and times left as they are
        assert body.endswith(b"\n\n")
        return status, kept, [e.removeprefix(b"data: ").decode() for e in body[:-2].split(b"\n\n")]
    data = json.loads(body) if body else None
    if isinstance(data, dict) and "created" in data:
        data["created"] = 0
    return status, kept, data


async def test_both_fronts_answer_alike(pd_factory: PDFactory) -> None:
    """The same requests through ``--front own`` and ``--front aiohttp``: the same status, headers
    (but the date and the hops' timings) and body; streams (P's token first, or D's stream alone;
    a client that closes after it) with the same events."""
    answers: dict[str, list[Any]] = {}
    for front in ("own", "aiohttp"):
        pd = await pd_factory(front=front, api_key=KEY, max_body_bytes=4000)
        assert pd.client.server is not None and pd.client.server.runner is not None
        assert isinstance(pd.client.server.runner.server, FrontServer) is (front == "own")
        port = _port(pd)
        auth = f"Authorization: Bearer {KEY}\r\n"
        requests = [
            _gen("same", auth),
            _gen("bad", auth, sp={"max_tokens": -1}),
            _gen("nokey"),
            _post(GENERATE, b"{" * 4001, auth),
            _post(GENERATE, b"not json", auth),
            _post("/inference/v1/abort_requests", b'{"request_ids": ["generate-tokens-x"]}', auth),
            _post("/inference/v1/abort_requests", b'{}', auth),
            _gen("stream", auth, stream=True, stream_options={"include_usage": True}),
            _gen("text", auth, stream=True, output_mode="text"),
            _gen("one", auth + "Connection: close\r\n", stream=True, sp={"max_tokens": 1}),
        ]
        answers[front] = [_comparable((await _exchange(port, r, 1))[0]) for r in requests]
        await pd.quiet()
    for own, theirs in zip(answers["own"], answers["aiohttp"], strict=True):
        assert own == theirs
    assert [a[0] for a in answers["own"]] == [200, 400, 401, 413, 400, 200, 400, 200, 200, 200]
    stream, text, one = answers["own"][-3:]
    assert stream[1]["transfer-encoding"] == "chunked" and "connection" not in stream[1]
    assert one[1]["connection"] == "close"
    assert stream[2][-1] == text[2][-1] == one[2][-1] == "[DONE]"
    assert json.loads(stream[2][-2])["usage"]["completion_tokens"] == 8  # the usage chunk
    assert len(stream[2]) == 8 + 2 and len(one[2]) == 2


def test_the_front_is_a_setting() -> None:
    urls = ["--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"]
    assert parse_args(urls).front == "own"
    assert parse_args([*urls, "--front", "aiohttp"]).front == "aiohttp"
    with pytest.raises(SystemExit):
        parse_args([*urls, "--front", "uvicorn"])


async def test_over_tls_the_front_serves_and_hands_off(certs: dict[str, Path],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A TLS connection: generate calls on the front, then a health check handed to aiohttp on the
    same connection (the TLS transport changes protocol), then a generate call served by aiohttp."""
    w = await start_world(server_kwargs={"ssl_context": server_context(str(certs["server"]),
                                                                      str(certs["server_key"]))})
    try:
        handed = _count_hand_offs(w.runner.server, monkeypatch)
        trust = ssl.create_default_context(cafile=str(certs["server"]))
        connector = aiohttp.TCPConnector(limit=1, ssl=trust)  # one connection for all three
        async with aiohttp.ClientSession(connector=connector) as session:
            async with session.post(w.url + GENERATE, json=req(request_id="t-1")) as r:
                assert r.status == 200 and (await r.json())["request_id"] == "generate-tokens-t-1"
            assert handed == []
            async with session.get(w.url + "/livez") as r:
                assert r.status == 200 and await r.json() == {"status": "ok"}
            assert len(handed) == 1
            async with session.post(w.url + GENERATE, json=req(request_id="t-2")) as r:
                assert r.status == 200 and (await r.json())["request_id"] == "generate-tokens-t-2"
            assert len(handed) == 1 and handed[0]._request_count == 2  # the same connection, aiohttp's
        await w.wait_clean()
    finally:
        await w.close()


async def test_a_head_arriving_byte_by_byte_is_served(pd_factory: PDFactory) -> None:
    pd = await pd_factory()
    port = _port(pd)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        data = _gen("slow")
        for i in range(len(data)):  # a line end split across writes, every way
            writer.write(data[i:i + 1])
            await writer.drain()
            await asyncio.sleep(0)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5.0)
        assert head.startswith(b"HTTP/1.1 200 OK\r\n")
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        body = json.loads(await asyncio.wait_for(reader.readexactly(length), 5.0))
        assert body["request_id"] == "generate-tokens-slow"
    finally:
        writer.close()
    await pd.quiet()


async def test_a_response_that_cannot_be_written_closes_its_connection_only(
        pd_factory: PDFactory, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    pd = await pd_factory()
    port = _port(pd)
    generate = pd.serving.generate

    async def injected(request: web.Request, *args: Any) -> web.StreamResponse:
        if request.headers.get("X-Request-Id") == "bad":
            return web.Response(body=b"{}", headers={"X-Injected": "a\r\nSet-Cookie: x=1"})
        return await generate(request, *args)

    monkeypatch.setattr(pd.serving, "generate", injected)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(_gen("b", "X-Request-Id: bad\r\n"))
        assert await asyncio.wait_for(reader.read(), 5.0) == b""  # closed, nothing written
    finally:
        writer.close()
    assert "unexpected ValueError while answering POST /inference/v1/generate" in caplog.text
    (status, _, body), = await _exchange(port, _gen("after"), 1)  # the server goes on
    assert status == 200 and json.loads(body)["request_id"] == "generate-tokens-after"
    await pd.quiet()


@pytest.mark.parametrize("front", ["own", "aiohttp"])
async def test_a_paced_streams_events_are_written_as_they_are_read(
        pd_factory: PDFactory, monkeypatch: pytest.MonkeyPatch, front: str) -> None:
    """Each of D's events (one a read, 5 ms apart) is handed to the decode reader from the hop
    connection's callback (``Upstream.pipe``): the reader waits once for all of D's reads, not
    once a read. With the front it is written to the client there too: the handler's relay
    waits once, for the stream's end, not once per event (``StreamBuffer.direct``); on aiohttp's
    server the relay is woken for each. The client gets the same stream."""
    takes: list[bool] = []
    take = StreamBuffer.take
    waits: list[str] = []
    wait = HopConnection.wait

    async def counted(self: StreamBuffer, *, merge: bool) -> tuple[list[bytes], bool]:
        takes.append(merge)
        return await take(self, merge=merge)

    async def counted_wait(self: HopConnection, deadline: float | None) -> None:
        waits.append(self.origin.key)
        await wait(self, deadline)

    monkeypatch.setattr(StreamBuffer, "take", counted)
    monkeypatch.setattr(HopConnection, "wait", counted_wait)
    pd = await pd_factory(front=front, decode=_paced(5))
    status, events, _ = await pd.stream(req(request_id="paced", stream=True, sp={"max_tokens": 12}))
    assert status == 200 and events[-1] == "[DONE]"
    tokens = [t for e in events[:-1] for t in e["choices"][0]["token_ids"]]
    assert len(tokens) == 12 and len(events) == 13  # P's token, D's eleven, one a chunk
    assert len(takes) == 1 if front == "own" else len(takes) >= 8
    decode_waits = [k for k in waits if k.endswith(f":{pd.d.port}")]
    assert 1 <= len(decode_waits) <= 3  # its head (once or twice) and the body's one; a wait a read: 11+
    await pd.quiet()


async def test_a_client_gone_mid_paced_stream_is_aborted_and_nothing_held(pd_factory: PDFactory) -> None:
    """The client leaves while D's events are written to it by the task reading D: the request
    is aborted on D and nothing stays held (the same end as a stream the relay writes)."""
    pd = await pd_factory(decode=_paced(20))
    reader, writer = await asyncio.open_connection("127.0.0.1", _port(pd))
    try:
        writer.write(_gen("left", stream=True, sp={"max_tokens": 200}))
        got = b""
        while got.count(b"data: ") < 4:  # P's token and a few of D's
            data = await asyncio.wait_for(reader.read(4096), 5.0)
            assert data, "the stream ended early"
            got += data
    finally:
        writer.close()
    await pd.quiet(10.0)
    metrics = await (await pd.client.get("/metrics")).text()
    assert 'pd_proxy_requests_total{outcome="aborted"} 1.0' in metrics
    assert len(pd.serving.table) == 0


async def _raw_head(port: int, data: bytes) -> tuple[list[str], bytes]:
    """One answer's header names in the order written (lower-cased), and its body."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5.0)
        lines = head.decode().split("\r\n")[1:-2]
        names = [line.partition(":")[0].lower() for line in lines]
        length = int(next(line for line in lines if line.lower().startswith("content-length:")).split(":")[1])
        return names, await asyncio.wait_for(reader.readexactly(length), 5.0)
    finally:
        writer.close()


async def test_a_full_answer_is_written_by_the_walk_with_aiohttps_head(pd_factory: PDFactory) -> None:
    """A non-stream answer on the front is written by the walk (``FrontRequest.reply``) with the
    head aiohttp writes for the same answer: the same header lines in the same order, the
    connection's end announced when the client asked for it."""
    heads: dict[str, list[list[str]]] = {}
    for front in ("own", "aiohttp"):
        pd = await pd_factory(front=front)
        port = _port(pd)
        heads[front] = []
        for extra in ("", "Connection: close\r\n"):
            names, body = await _raw_head(port, _gen("h", extra))
            assert json.loads(body)["request_id"] == "generate-tokens-h"
            heads[front].append(names)
        await pd.quiet()
    assert heads["own"] == heads["aiohttp"]
    kept, closed = heads["own"]
    assert kept == ["x-request-id", "server-timing", "content-type", "content-length", "date", "server"]
    assert closed == [*kept, "connection"]


async def test_a_failure_after_the_answer_went_out_closes_the_connection_only(
        pd_factory: PDFactory, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The walk's accounting after a non-stream answer is written (the lease's end, the request
    done) raising (a bug): the client has its whole answer, no second one follows on the
    connection, which is closed; the error is logged; the server goes on."""
    pd = await pd_factory()
    port = _port(pd)
    answered = pd.serving.full._answered
    calls: list[str] = []

    def failing(f: Any) -> None:
        calls.append(f.client_id)
        if f.client_id == "late":
            raise RuntimeError("accounting failed")
        answered(f)

    monkeypatch.setattr(pd.serving.full, "_answered", failing)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(_gen("late"))
        raw = await asyncio.wait_for(reader.read(), 5.0)  # to the end: the server closes
    finally:
        writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK\r\n") and b"\r\nConnection: close" not in head
    assert json.loads(body)["request_id"] == "generate-tokens-late"  # one answer, whole
    assert calls == ["late"]
    assert "unexpected RuntimeError while serving POST /inference/v1/generate after its answer" in caplog.text
    (status, _, after), = await _exchange(port, _gen("after"), 1)
    assert status == 200 and json.loads(after)["request_id"] == "generate-tokens-after"
    await pd.quiet()


@pytest.mark.parametrize("front", ["own", "aiohttp"])
async def test_a_head_aiohttps_parser_refuses_is_answered_in_vllms_shape_and_its_bytes_never_logged(
        pd_factory: PDFactory, front: str, caplog: pytest.LogCaptureFixture) -> None:
    """A control byte after the key in ``Authorization``: the front hands the head to aiohttp,
    whose parser refuses it. aiohttp alone logged its message at ERROR, with the raw line (the
    key in it) and a traceback, and answered plain text that echoed the line."""
    pd = await pd_factory(front=front, api_key=KEY)
    caplog.set_level(logging.DEBUG)
    bad = _gen("bad", f"Authorization: Bearer {KEY}\x01\r\n")
    (status, headers, body), = await _exchange(_port(pd), bad, 1)
    assert status == 400 and headers["content-type"].startswith("application/json")
    error = json.loads(body)["error"]
    assert error["code"] == 400 and error["type"] == "Bad Request"
    assert error["message"].startswith("malformed HTTP request")
    assert KEY.encode() not in body
    assert KEY not in caplog.text and "Traceback" not in caplog.text
    assert "refused a malformed HTTP request" in caplog.text
    await pd.quiet()


async def test_a_key_refused_before_the_body_arrived_lets_the_client_send_it_and_read_the_401(
        pd_factory: PDFactory) -> None:
    """No key, and a body that comes in two parts: the front answers 401 when the head is in
    (the key first, as the lean front), then drops the rest of the body as it comes and closes.
    A client that writes its whole body before reading gets its 401. Before, the front closed at
    once: the client's further writes met a reset."""
    pd = await pd_factory(api_key=KEY, max_body_bytes=4 << 20)
    # 900 KB: under the front's own limit (1 MiB), above what loopback's socket buffers take
    body = b'{"token_ids": [' + b"1," * 450_000 + b'1], "sampling_params": {"max_tokens": 1}}'
    data = _post(GENERATE, body)
    reader, writer = await asyncio.open_connection("127.0.0.1", _port(pd))
    try:
        writer.write(data[:50_000])
        await writer.drain()
        await asyncio.sleep(0.2)  # the 401 is out, the connection still open
        writer.write(data[50_000:])
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), 5)  # to EOF: the front closes once all is in
    finally:
        writer.close()
    head, _, payload = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 401 ")
    assert json.loads(payload) == {"error": "Unauthorized"}
    await pd.quiet()
