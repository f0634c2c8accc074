"""A streamed answer piped to a sink (``HopResponse.pipe``, ``Upstream.pipe``): each read handed
over as it arrives, from the connection's callback, with no wait (future, timer, task wake-up) per
read; the sink ends it, its errors told apart from the hop's, the read limit a limit on each wait
for bytes, a failed or cancelled pipe leaves nothing behind."""

from __future__ import annotations

import asyncio
import contextvars
from typing import cast

import aiohttp
import pytest

from proxy.upstream.client import Upstream
from proxy.upstream.hop import HopDisconnected, SinkError
from proxy.upstream.hop_wire import HopConnection, parse_origin
from proxy.wire.errors import UpstreamTimeout, UpstreamUnavailable
from tests.proxy.hop_servers import serving, until

HEAD = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Type: text/event-stream\r\n\r\n"


def chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


def event(i: int) -> bytes:
    return b"data: %d\n\n" % i


class Paced:
    """A worker that sends its answer's events one write at a time, each only once the client
    took the one before (``taken``): each event is a read of its own. ``end``: the last chunk
    (kept alive), ``"close"`` (the connection closed with no last chunk) or ``"stall"``
    (nothing more sent, the connection left open)."""

    def __init__(self, events: int, *, end: str = "chunk", gap: float = 0.0) -> None:
        self.events, self.end, self.gap = events, end, gap
        self.taken = asyncio.Event()

    async def handler(self, r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        while True:
            try:
                await r.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError:
                return  # the client closed the connection
            await r.readexactly(2)  # the body, {}
            w.write(HEAD)
            for i in range(self.events):
                self.taken.clear()
                w.write(chunk(event(i)))
                await w.drain()
                await asyncio.wait_for(self.taken.wait(), 10)
                if self.gap:
                    await asyncio.sleep(self.gap)
            if self.end == "close":
                return
            if self.end == "stall":
                await r.read()  # until the client closes
                return
            w.write(b"0\r\n\r\n")
            await w.drain()


class Sink:
    def __init__(self, paced: Paced, *, stop_after: int | None = None, fail_at: int | None = None) -> None:
        self.paced, self.stop_after, self.fail_at = paced, stop_after, fail_at
        self.reads: list[bytes] = []

    def __call__(self, data: bytes) -> bool:
        self.reads.append(data)
        if self.fail_at is not None and len(self.reads) == self.fail_at:
            raise RuntimeError("the sink broke")
        self.paced.taken.set()
        return self.stop_after is None or len(self.reads) < self.stop_after


async def test_each_read_goes_to_the_sink_as_it_arrives_with_one_wait_for_the_whole_body(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """20 events, each a read of its own: the sink gets each as it arrives (the worker sends the
    next only then), the pipe's caller waits once for all of them, and the connection is kept."""
    paced = Paced(20)
    waits = 0
    wait = HopConnection.wait

    async def counted(self: HopConnection, deadline: float | None) -> None:
        nonlocal waits
        waits += 1
        await wait(self, deadline)

    async with serving(paced.handler) as (_, url, client):
        loop = asyncio.get_running_loop()
        resp = await client.request(url, "/g", b"", b"{}", deadline=loop.time() + 30, read_limit=10,
                                    stream=True)
        sink = Sink(paced)
        monkeypatch.setattr(HopConnection, "wait", counted)
        await resp.pipe(sink)
        assert sink.reads == [event(i) for i in range(20)]
        assert waits == 1  # reading the body as read_any does waits once a read: 20
        resp.close()
        assert client.counts() == {"in_use": 0, "idle": 1}


async def test_a_sink_that_says_stop_gets_nothing_more_and_closing_tells_the_worker() -> None:
    paced = Paced(10)
    async with serving(paced.handler) as (_, url, client):
        resp = await client.request(url, "/g", b"", b"{}", deadline=None, read_limit=10, stream=True)
        sink = Sink(paced, stop_after=3)
        await resp.pipe(sink)
        assert sink.reads == [event(0), event(1), event(2)]
        conn = resp._conn
        assert conn is not None and conn.sink is None
        resp.close()  # mid-answer: closed, not kept
        assert client.counts() == {"in_use": 0, "idle": 0}


async def test_what_the_sink_raises_is_its_own_error_not_the_hops() -> None:
    paced = Paced(10)
    async with serving(paced.handler) as (_, url, client):
        resp = await client.request(url, "/g", b"", b"{}", deadline=None, read_limit=10, stream=True)
        sink = Sink(paced, fail_at=2)
        with pytest.raises(SinkError) as raised:
            await resp.pipe(sink)
        assert isinstance(raised.value.error, RuntimeError) and len(sink.reads) == 2
        resp.close()
        assert client.counts() == {"in_use": 0, "idle": 0}

        # Upstream.pipe raises it as it is; the hop's own failures it translates
        up = Upstream(cast(aiohttp.ClientSession, None), api_key=None, connect_timeout=5, hops=client)
        resp = await client.request(url, "/g", b"", b"{}", deadline=None, read_limit=10, stream=True)
        with pytest.raises(RuntimeError, match="the sink broke"):
            await up.pipe("decode", url, resp, Sink(paced, fail_at=1))
        resp.close()


async def test_the_read_limit_bounds_each_wait_for_bytes_not_the_body() -> None:
    """Reads 0.05 s apart for 2 s under a 1.5 s read limit go through (each wait 30 times shorter
    than the limit: a loaded machine does not stretch it that far); the worker then stops sending:
    the wait for the next read times out (``UpstreamTimeout`` through ``Upstream``)."""
    paced = Paced(40, end="stall", gap=0.05)
    async with serving(paced.handler) as (_, url, client):
        up = Upstream(cast(aiohttp.ClientSession, None), api_key=None, connect_timeout=5, hops=client)
        loop = asyncio.get_running_loop()
        resp = await client.request(url, "/g", b"", b"{}", deadline=loop.time() + 60, read_limit=1.5,
                                    stream=True)
        sink = Sink(paced)
        with pytest.raises(UpstreamTimeout, match="stream stalled"):
            await up.pipe("decode", url, resp, sink)
        assert sink.reads == [event(i) for i in range(40)]
        resp.close()
        assert client.counts() == {"in_use": 0, "idle": 0}


async def test_a_connection_lost_mid_body_fails_the_pipe_and_is_not_kept() -> None:
    paced = Paced(3, end="close")  # no last chunk
    async with serving(paced.handler) as (_, url, client):
        resp = await client.request(url, "/g", b"", b"{}", deadline=None, read_limit=10, stream=True)
        sink = Sink(paced)
        with pytest.raises(HopDisconnected):
            await resp.pipe(sink)
        assert sink.reads == [event(i) for i in range(3)]
        resp.close()
        assert client.counts() == {"in_use": 0, "idle": 0}

        up = Upstream(cast(aiohttp.ClientSession, None), api_key=None, connect_timeout=5, hops=client)
        resp = await client.request(url, "/g", b"", b"{}", deadline=None, read_limit=10, stream=True)
        with pytest.raises(UpstreamUnavailable, match="stream broken"):
            await up.pipe("decode", url, resp, Sink(paced))
        resp.close()


async def test_a_cancelled_pipe_hands_nothing_more_to_its_sink() -> None:
    paced = Paced(10)
    async with serving(paced.handler) as (_, url, client):
        resp = await client.request(url, "/g", b"", b"{}", deadline=None, read_limit=10, stream=True)
        conn = resp._conn
        assert conn is not None
        got: list[bytes] = []

        def sink(data: bytes) -> bool:
            got.append(data)
            if len(got) < 2:
                paced.taken.set()  # the second event is sent; the pipe is cancelled after it
            return True

        task = asyncio.create_task(resp.pipe(sink))
        await until(lambda: len(got) == 2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert conn.sink is None
        paced.taken.set()  # the worker sends the third event: nobody is handed it
        await asyncio.sleep(0.05)
        assert len(got) == 2
        resp.close()
        assert conn.closed and client.counts() == {"in_use": 0, "idle": 0}


async def test_the_sink_runs_in_the_context_of_the_pipes_caller() -> None:
    """A pooled connection was opened by some other request: the sink still sees the context
    variables of the task that pipes (a trace's span, say), and so do the tasks it starts."""
    var: contextvars.ContextVar[str] = contextvars.ContextVar("var", default="none")
    paced = Paced(3)
    async with serving(paced.handler) as (_, url, client):
        resp = await client.request(url, "/g", b"", b"{}", deadline=None, read_limit=10, stream=True)
        await resp.pipe(Sink(paced))
        resp.close()  # read whole: the connection back in the pool, opened in this context
        assert client.counts() == {"in_use": 0, "idle": 1}
        seen: list[str] = []
        spawned: list[asyncio.Task[str]] = []

        async def read_var() -> str:
            return var.get()

        def sink(data: bytes) -> bool:
            seen.append(var.get())
            spawned.append(asyncio.get_running_loop().create_task(read_var()))
            paced.taken.set()
            return True

        async def other_request() -> None:
            var.set("other")
            resp = await client.request(url, "/g", b"", b"{}", deadline=None, read_limit=10, stream=True)
            await resp.pipe(sink)
            resp.close()

        await asyncio.get_running_loop().create_task(other_request())
        assert client.counts() == {"in_use": 0, "idle": 1}  # the same connection, reused
        assert seen == ["other"] * 3
        assert await asyncio.gather(*spawned) == ["other"] * 3


async def test_what_one_loop_turn_brings_goes_to_the_sink_as_one() -> None:
    """Two reads in the same turn of the loop (D sent faster than the proxy runs) reach the sink
    as one call, so the client gets them in one write; the next turn's read in another."""
    from tests.proxy.test_hop_wire import _Transport  # noqa: PLC0415

    loop = asyncio.get_running_loop()
    conn = HopConnection(loop, parse_origin("http://127.0.0.1:9"))
    conn.connection_made(_Transport())  # type: ignore[arg-type]
    conn.begin(stream=True)
    conn.data_received(HEAD)
    got: list[bytes] = []

    def sink(data: bytes) -> bool:
        got.append(data)
        return True

    task = loop.create_task(conn.pipe(sink, None, 10.0))
    await asyncio.sleep(0)  # the pipe waits
    conn.data_received(chunk(event(0)))
    conn.data_received(chunk(event(1)))
    await asyncio.sleep(0)
    assert got == [event(0) + event(1)]
    conn.data_received(chunk(event(2)) + b"0\r\n\r\n")
    await asyncio.wait_for(task, 10)
    assert got == [event(0) + event(1), event(2)]
    assert conn.sink is None and conn.finished
