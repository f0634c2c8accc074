"""Every answer a worker sends is bounded and read strictly, end to end: a decode worker (a raw
socket, ``hop_servers.Server``) whose answer passes a limit or breaks a line end fails the hop at
once as its protocol error. The client gets a 502 in vLLM's shape (or the in-band error event
once its stream has started), the connection to the worker is dropped and the next hop opens
another, the failure counts on the worker's breaker, and the proxy reads no more of the answer
than the limit (counted on the hop connection's reads)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from proxy.http.app import SERVING
from proxy.pools import PoolSettings
from proxy.pools.breaker import CircuitState
from proxy.upstream.hop_wire import HopConnection
from tests.proxy.conftest import ProxyFactory, req, sse_datas
from tests.proxy.hop_servers import Server, chunked, until
from tests.proxy.scripted import Scripted, ScriptedFactory, prefill_reply

BODY_LIMIT = 1 << 20
ERROR_LIMIT = 64 << 10
SLACK = 512 << 10
"""What one read may bring past a limit (asyncio reads at most 256 KiB at a time)."""
_CHUNK = 64 << 10
_ENDLESS = 16 << 20
"""What an endless body sends at most (if the proxy read it all, far past the limits)."""


def _event(token: int) -> bytes:
    return (b'data: {"request_id":"generate-tokens-x","usage":null,"output_mode":"tokens","choices":'
            b'[{"index":0,"finish_reason":null,"stop_reason":null,"token_ids":[%d],"logprobs":null}]}'
            b"\n\n" % token)


def _framed(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def _endless_chunks(w: asyncio.StreamWriter) -> None:
    """Chunks until the proxy closes the connection (at most ``_ENDLESS`` bytes, then the end)."""
    piece = _framed(b"x" * _CHUNK)
    for _ in range(_ENDLESS // _CHUNK):
        w.write(piece)
        await w.drain()
    w.write(b"0\r\n\r\n")
    await w.drain()


Answer = Callable[[asyncio.StreamWriter], Awaitable[None]]


def _bytes(data: bytes) -> Answer:
    async def write(w: asyncio.StreamWriter) -> None:
        w.write(data)
        await w.drain()
    return write


def _then(head: bytes, rest: Answer) -> Answer:
    async def write(w: asyncio.StreamWriter) -> None:
        w.write(head)
        await rest(w)
    return write


_CHUNKED_200 = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Type: application/json\r\n\r\n"
_CHUNKED_400 = _CHUNKED_200.replace(b"200 OK", b"400 Bad Request")
_ERROR = b'{"error":{"message":"no","type":"BadRequestError","param":null,"code":400}}'


class Worker:
    """A decode worker on a raw socket: each generate call gets ``answer``, and its connection is
    then held open (the proxy must not wait for its end); the connections that carried generate
    calls (``hops``) and those of them the proxy closed (``closed``) are noted. Any other call
    (the proxy's scrapes, aborts) gets a 404."""

    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self.server = Server(self.handle)
        self.hops: list[int] = []
        self.closed: list[int] = []

    async def handle(self, r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        try:
            while True:
                try:
                    head = await r.readuntil(b"\r\n\r\n")
                except asyncio.IncompleteReadError:
                    break
                lines = head.split(b"\r\n")
                length = next((int(line.split(b":")[1]) for line in lines
                               if line.lower().startswith(b"content-length:")), 0)
                await r.readexactly(length)
                if b"/inference/v1/generate" not in lines[0]:
                    w.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
                    continue
                if n not in self.hops:
                    self.hops.append(n)
                await self.answer(w)
        except ConnectionError:
            pass
        if n in self.hops:
            self.closed.append(n)


@contextlib.asynccontextmanager
async def decode_worker(answer: Answer) -> AsyncIterator[tuple[Worker, str]]:
    worker = Worker(answer)
    url = await worker.server.start()
    try:
        yield worker, url
    finally:
        await worker.server.close()


def count_reads(monkeypatch: pytest.MonkeyPatch, url: str) -> list[int]:
    """The sizes of the reads of the hop connections to ``url``."""
    reads: list[int] = []
    original = HopConnection.data_received

    def counted(self: HopConnection, data: bytes) -> None:
        if url.endswith(f":{self.origin.port}"):
            reads.append(len(data))
        original(self, data)

    monkeypatch.setattr(HopConnection, "data_received", counted)
    return reads


async def _proxy(scripted_factory: ScriptedFactory, proxy_factory: ProxyFactory, d_url: str,
                 **settings: Any) -> tuple[Any, Any]:
    p: Scripted = await scripted_factory(lambda b, r: prefill_reply(b))
    return await proxy_factory([p.url], [d_url], max_upstream_body_bytes=BODY_LIMIT,
                               max_upstream_error_bytes=ERROR_LIMIT, decode_timeout=1000.0,
                               stream_idle_timeout=1000.0,
                               pools=PoolSettings.plain(breaker_failures=2), **settings)


async def _post(client: Any, body: dict[str, Any]) -> tuple[int, bytes]:
    async def call() -> tuple[int, bytes]:
        r = await client.post("/inference/v1/generate", json=body)
        return r.status, await r.read()
    # a bound (the hop's own timeouts are 1,000 s here), not a timing assertion
    return await asyncio.wait_for(call(), 30)


async def _closed(worker: Worker, n: int) -> None:
    """``n`` hops came, each on a connection of its own, and the proxy closed them all."""
    await until(lambda: len(worker.closed) >= n)
    assert len(worker.hops) == n and sorted(worker.closed) == worker.hops


async def _fails_twice_as_the_workers_protocol_error(client: Any, app: Any, worker: Worker, url: str,
                                                     says: str) -> None:
    """Two requests: each a 502 in vLLM's shape naming the decode worker, each on a connection of
    its own that the proxy closed; the second opens the worker's circuit (2 failures)."""
    for i in range(2):
        status, raw = await _post(client, req())
        assert status == 502, raw[:200]
        error = json.loads(raw)["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert (error["type"], error["code"]) == ("BadGatewayError", 502)
        assert f"decode worker {url}" in error["message"] and says in error["message"], error
        await _closed(worker, i + 1)
    assert app[SERVING].decode_pool.workers[0].breaker.state is CircuitState.OPEN


@pytest.mark.parametrize(("answer", "says"), [
    (_bytes(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n{" % (200 << 20)), "--max-upstream-body-bytes"),
    (_then(_CHUNKED_200, _endless_chunks), "--max-upstream-body-bytes"),
    (_then(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n",
           _endless_chunks), "--max-upstream-body-bytes"),  # until the connection's end (no framing)
    (_bytes(b"HTTP/1.1 400 Bad Request\r\nContent-Length: %d\r\n\r\n{" % (100 << 20)),
     "--max-upstream-error-bytes"),
    (_then(_CHUNKED_400, _endless_chunks), "--max-upstream-error-bytes"),
    (_bytes(b"HTTP/1.1 200 OK\r\n" + b"X-Pad: p\r\n" * 10_000), "--max-upstream-header-bytes"),
], ids=["200-length", "200-chunked", "200-until-close", "400-length", "400-chunked", "head"])
async def test_an_answer_past_its_limit_is_a_502_and_no_more_of_it_is_read(
        scripted_factory: ScriptedFactory, proxy_factory: ProxyFactory, monkeypatch: pytest.MonkeyPatch,
        answer: Answer, says: str) -> None:
    """Item 5 of issue 44: a 200 MiB answer grew the proxy by 335 MiB, a 400 with 100 MiB was
    read whole and relayed to the client."""
    async with decode_worker(answer) as (worker, url):
        reads = count_reads(monkeypatch, url)
        client, app = await _proxy(scripted_factory, proxy_factory, url)
        await _fails_twice_as_the_workers_protocol_error(client, app, worker, url, says)
        limit = ERROR_LIMIT if "error" in says else BODY_LIMIT
        assert sum(reads) <= 2 * (limit + SLACK), sum(reads)  # two hops, each stopped at its limit


async def test_a_cr_alone_in_a_workers_header_is_a_502_not_a_dropped_connection(
        scripted_factory: ScriptedFactory, proxy_factory: ProxyFactory) -> None:
    """Item 6: the 4xx was passed on with the worker's Content-Type, which aiohttp refused to
    write: the client's connection was dropped with no answer."""
    answer = (b"HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\rX-Evil: 1\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (len(_ERROR), _ERROR))
    async with decode_worker(_bytes(answer)) as (worker, url):
        client, app = await _proxy(scripted_factory, proxy_factory, url)
        await _fails_twice_as_the_workers_protocol_error(client, app, worker, url, "a CR or LF alone")


@pytest.mark.parametrize("answer", [
    _CHUNKED_200 + b"2\n{}\n0\n\n",
    _CHUNKED_400 + b"%x\n%s\n0\n\n" % (len(_ERROR), _ERROR),
    b"HTTP/1.1 200 OK\nContent-Length: 2\n\n{}",
], ids=["chunk-lines", "error-chunk-lines", "head"])
async def test_lf_only_lines_fail_the_hop_at_once_not_at_the_decode_timeout(
        scripted_factory: ScriptedFactory, proxy_factory: ProxyFactory, answer: bytes) -> None:
    """Item 7: the worker keeps its connection open after LF-only lines; the hop waited for the
    decode timeout (1,000 s here; the request is awaited for at most 30 s)."""
    async with decode_worker(_bytes(answer)) as (worker, url):
        client, app = await _proxy(scripted_factory, proxy_factory, url)
        await _fails_twice_as_the_workers_protocol_error(client, app, worker, url, "a CR or LF alone")


async def test_a_malformed_chunk_once_the_stream_started_is_an_in_band_error_and_the_connection_is_dropped(
        scripted_factory: ScriptedFactory, proxy_factory: ProxyFactory) -> None:
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Type: text/event-stream\r\n\r\n"
    answer = head + _framed(_event(7)) + _framed(_event(5)) + b"5\nhello\n"
    async with decode_worker(_bytes(answer)) as (worker, url):
        client, app = await _proxy(scripted_factory, proxy_factory, url)
        for i in range(2):
            status, raw = await _post(client, {**req(), "stream": True})
            events = sse_datas(raw)
            assert status == 200 and [e["choices"][0]["token_ids"] for e in events[:2]] == [[7], [5]]
            error = events[2]["error"]
            assert (error["type"], error["code"]) == ("BadGatewayError", 502)
            assert f"decode worker {url}" in error["message"] and "a CR or LF alone" in error["message"]
            assert events[3:] == ["[DONE]"]
            await _closed(worker, i + 1)
            breaker = app[SERVING].decode_pool.workers[0].breaker
        await until(lambda: breaker.state is CircuitState.OPEN)  # (the attempt ends after the stream)
        assert breaker.state is CircuitState.OPEN


async def test_an_answer_within_the_limits_is_served(scripted_factory: ScriptedFactory,
                                                     proxy_factory: ProxyFactory) -> None:
    """The limits refuse nothing a worker may send: a chunked answer just under the body limit."""
    reply = prefill_reply({"request_id": "x", "token_ids": [1]}, kv={})
    reply["pad"] = "x" * (BODY_LIMIT - 4096)
    body = json.dumps(reply).encode()
    half = len(body) // 2
    async with decode_worker(_bytes(chunked(body[:half], body[half:]))) as (_, url):
        client, _ = await _proxy(scripted_factory, proxy_factory, url)
        status, raw = await _post(client, req())
        assert status == 200 and len(raw) > BODY_LIMIT - 4096


def test_the_limits_are_flags_with_sane_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    from proxy.cli import parse_args  # noqa: PLC0415

    urls = ["--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"]
    s = parse_args(urls)
    assert (s.max_upstream_body_bytes, s.max_upstream_error_bytes, s.max_upstream_header_bytes) == (
        64 << 20, 1 << 20, 64 << 10)
    s = parse_args([*urls, "--max-upstream-body-bytes", "5", "--max-upstream-error-bytes", "6",
                    "--max-upstream-header-bytes", "7"])
    assert (s.max_upstream_body_bytes, s.max_upstream_error_bytes, s.max_upstream_header_bytes) == (5, 6, 7)
    with pytest.raises(SystemExit):
        parse_args([*urls, "--max-upstream-error-bytes", "0"])
    assert "--max-upstream-error-bytes" in capsys.readouterr().err
