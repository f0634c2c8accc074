"""The generate hops' HTTP/1.1 client (``proxy.upstream.hop``) against scripted servers on loopback:
keep-alive reuse, kept-alive connections the worker closed (polled before reuse; never sent twice
silently), the connection cap per worker, timeouts (reads and writes), back-pressure, closing and
cancellation. The framing of answers and the parser: ``test_hop_wire``."""

from __future__ import annotations

import asyncio
import contextlib
import select
import socket
import time
from typing import Any

import pytest

from proxy.upstream import hop
from proxy.upstream.hop import HopConnectTimeout, HopDisconnected, HopStale, header_lines, parse_origin
from tests.proxy.hop_servers import BIG_BODY, chunked, head_only, ok, post, serving, until


async def test_a_kept_alive_connection_carries_the_next_request() -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        while await server.request(r):
            w.write(ok(b'{"n":%d}' % len(server.requests)))
            await w.drain()

    async with serving(handler) as (server, url, client):
        assert await post(client, url, b'{"a":1}') == (200, b'{"n":1}')
        assert await post(client, url) == (200, b'{"n":2}')
        assert server.connections == 1
        assert client.counts() == {"in_use": 0, "idle": 1}
    head = server.requests[0].split(b"\r\n\r\n")[0]
    assert head.startswith(b"POST /inference/v1/generate HTTP/1.1\r\n")
    assert f"Host: 127.0.0.1:{url.rsplit(':', 1)[1]}".encode() in head
    assert b"Content-Length: 7" in head and server.requests[0].endswith(b'{"a":1}')


@pytest.mark.parametrize("split", [False, True])
async def test_reading_a_whole_answer_gives_its_connection_back(split: bool) -> None:
    """``read`` to the end puts the connection back in the pool by itself, whether the body came
    with the head (read at once) or after it."""
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        while await server.request(r):
            answer = ok(b'{"n":%d}' % len(server.requests))
            if split:
                w.write(answer[:-3])
                await w.drain()
                await asyncio.sleep(0.05)
                answer = answer[-3:]
            w.write(answer)
            await w.drain()

    async with serving(handler) as (server, url, client):
        loop = asyncio.get_running_loop()
        for n in (1, 2):
            resp = await client.request(url, "/g", b"", b"{}", deadline=loop.time() + 10, read_limit=5)
            assert await resp.read() == b'{"n":%d}' % n
            assert client.counts() == {"in_use": 0, "idle": 1}  # no close() needed
        assert server.connections == 1


async def test_a_chunked_answer_arrives_as_it_is_sent_and_the_connection_is_reused() -> None:
    go = asyncio.Event()

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        while await server.request(r):
            w.write(chunked(b"data: 1\n\n")[:-5])  # the first event, not the last chunk yet
            await w.drain()
            await go.wait()
            w.write(b"9\r\ndata: 2\n\n\r\n0\r\n\r\n")
            await w.drain()

    async with serving(handler) as (server, url, client):
        loop = asyncio.get_running_loop()
        resp = await client.request(url, "/g", b"", b"{}", deadline=loop.time() + 10, read_limit=5)
        assert resp.status == 200 and resp.headers["content-type"] == "text/event-stream"
        assert await resp.read_any() == b"data: 1\n\n"
        go.set()
        assert await resp.read_any() == b"data: 2\n\n"
        assert await resp.read_any() == b""
        resp.close()
        assert client.counts() == {"in_use": 0, "idle": 1}
        assert (await post(client, url))[0] == 200
        assert server.connections == 1


async def test_a_body_until_the_connection_ends_is_read_whole_and_the_connection_not_kept() -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        await server.request(r)
        w.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n{\"x\":")
        await w.drain()
        w.write(b"1}")
        w.close()

    async with serving(handler) as (server, url, client):
        assert await post(client, url) == (200, b'{"x":1}')
        assert client.counts() == {"in_use": 0, "idle": 0}


@pytest.mark.parametrize("head", [b"HTTP/1.1 200 OK\r\nConnection: close\r\n", b"HTTP/1.0 200 OK\r\n"])
async def test_an_answer_that_closes_its_connection_is_not_kept(head: bytes) -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        while await server.request(r):
            w.write(head + b"Content-Length: 2\r\n\r\n{}")
            await w.drain()

    async with serving(handler) as (server, url, client):
        assert await post(client, url) == (200, b"{}")
        assert await post(client, url) == (200, b"{}")
        assert server.connections == 2


async def test_a_kept_alive_connection_closed_after_the_request_went_out_is_not_sent_again() -> None:
    """The worker closes a kept-alive connection with no answer byte after the request reached
    it. It read the request here (it may have in general): the client does not send it again by
    itself, it raises ``HopStale`` (``Upstream`` aborts the copy first, see test_upstream_hop)."""
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        while await server.request(r):
            if len(server.requests) == 2:
                return  # read it, then closes without answering
            w.write(ok(b"{}"))
            await w.drain()

    async with serving(handler) as (server, url, client):
        assert await post(client, url) == (200, b"{}")
        with pytest.raises(HopStale):
            await post(client, url)
        assert len(server.requests) == 2 and server.connections == 1
        assert client.counts() == {"in_use": 0, "idle": 0}
        assert await post(client, url) == (200, b"{}")  # the next request: a new connection


async def test_a_kept_alive_connection_the_worker_closed_is_found_before_the_request_is_written() -> None:
    """The worker half-closed an idle kept-alive connection (its FIN is in this host's kernel) but
    would still read from it, and the loop has not seen the FIN yet. The pooled socket is polled
    before reuse: the request goes out once, on a new connection, and never reaches the worker
    twice (written on the stale socket, the worker would read it and then get it again)."""
    half_closed: list[socket.socket] = []

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        while await server.request(r):
            if n == 0 and half_closed:
                await r.read()  # read it, cannot answer (its side is shut)
                return
            w.write(ok(b"{}"))
            await w.drain()
            if n == 0:
                sock = w.get_extra_info("socket")
                half_closed.append(sock)

    async with serving(handler) as (server, url, client):
        assert await post(client, url) == (200, b"{}")
        await until(lambda: bool(half_closed) and client.counts()["idle"] == 1)
        idle = client._idle[parse_origin(url).key][0]
        assert idle.transport is not None
        client_fd = idle.transport.get_extra_info("socket").fileno()
        half_closed[0].shutdown(socket.SHUT_WR)
        # Block (no loop turn, so the protocol hears nothing) until the FIN is in the kernel.
        poller = select.poll()
        poller.register(client_fd, select.POLLIN)
        assert poller.poll(5000), "the FIN did not arrive"
        assert not idle.closed  # the loop has not run: only the kernel knows
        assert await post(client, url) == (200, b"{}")
        assert server.connections == 2
        assert len(server.requests) == 2  # the first, then the second once (on connection 1)


async def test_a_new_connection_closed_before_the_answer_is_an_error_not_a_resend() -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        await server.request(r)  # then closes

    async with serving(handler) as (server, url, client):
        with pytest.raises(HopDisconnected):
            await post(client, url)
        assert server.connections == 1
        assert client.counts() == {"in_use": 0, "idle": 0}


async def test_a_connection_lost_mid_body_is_an_error_and_not_kept() -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        await server.request(r)
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n{\"a\"")
        await w.drain()

    async with serving(handler) as (server, url, client):
        with pytest.raises(HopDisconnected):
            await post(client, url)
        assert client.counts() == {"in_use": 0, "idle": 0}


async def test_an_unreachable_worker_is_an_os_error() -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        pass

    async with serving(handler) as (server, url, client):
        await server.close()
        with pytest.raises(OSError):
            await post(client, url)


@pytest.mark.parametrize("where", ["headers", "body"])
@pytest.mark.parametrize("limit", ["deadline", "read_limit"])
async def test_a_silent_worker_times_out_and_its_connection_is_closed(where: str, limit: str) -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        await server.request(r)
        if where == "body":
            w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n")
            await w.drain()
        await r.read()  # until the client closes
        server.closed_by_client.append(n)

    async with serving(handler) as (server, url, client):
        loop = asyncio.get_running_loop()
        with pytest.raises(TimeoutError):
            if limit == "deadline":
                await post(client, url, deadline=loop.time() + 0.2, read_limit=None)
            else:
                await post(client, url, deadline=loop.time() + 60, read_limit=0.2)
        await until(lambda: bool(server.closed_by_client))
        assert server.closed_by_client == [0]
        assert client.counts() == {"in_use": 0, "idle": 0}



@pytest.mark.parametrize("limit", ["write_timeout", "deadline"])
async def test_a_worker_that_stops_reading_the_request_fails_the_hop_it_does_not_hold_it(limit: str) -> None:
    """The worker reads the request's head and then nothing: the write gives up after the write
    timeout (or at the deadline), the connection is closed, nothing stays in use."""
    release = asyncio.Event()

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        await head_only(r)
        await release.wait()
        with contextlib.suppress(ConnectionError):
            while await r.read(1 << 20):
                pass
        server.closed_by_client.append(n)

    write_timeout = 0.3 if limit == "write_timeout" else 60.0
    async with serving(handler, rcvbuf=4096, write_timeout=write_timeout) as (server, url, client):
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (60 if limit == "write_timeout" else 0.3)
        task = asyncio.create_task(post(client, url, b"x" * BIG_BODY, deadline=deadline, read_limit=None))
        done, _ = await asyncio.wait({task}, timeout=20)  # a bound for the old behaviour (it hung)
        assert task in done, "the hop is still writing to a worker that stopped reading"
        assert isinstance(task.exception(), TimeoutError)
        assert client.counts() == {"in_use": 0, "idle": 0}
        release.set()
        await until(lambda: bool(server.closed_by_client))
        assert server.closed_by_client == [0]


async def test_a_worker_that_reads_the_request_slowly_but_steadily_is_not_cut_off() -> None:
    """The write timeout is a limit on a wait without progress, not on the whole body."""
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        left = await head_only(r)
        while left:
            left -= len(await r.read(min(left, 256 << 10)))
            await asyncio.sleep(0.02)
        w.write(ok(b"{}"))
        await w.drain()

    async with serving(handler, rcvbuf=65536, limit=1 << 20, write_timeout=0.5) as (_, url, client):
        assert await post(client, url, b"x" * BIG_BODY, read_limit=None) == (200, b"{}")


@pytest.mark.parametrize("cap", [2, 0])
async def test_connections_to_one_worker_are_capped_and_a_hop_beyond_waits_for_one(cap: int) -> None:
    """At ``max_per_host`` open connections to a worker, a further hop opens none: it waits and
    then takes the first connection that comes back to the pool. 0: no cap."""
    go = asyncio.Event()

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        while await server.request(r):
            await go.wait()
            w.write(ok(b"{}"))
            await w.drain()

    async with serving(handler, max_per_host=cap) as (server, url, client):
        tasks = [asyncio.create_task(post(client, url)) for _ in range(3)]
        await until(lambda: len(server.requests) == (cap or 3))
        await asyncio.sleep(0.05)  # room for a third connection, were one to be opened
        assert len(server.requests) == server.connections == (cap or 3)
        assert client.counts() == {"in_use": cap or 3, "idle": 0}
        go.set()
        assert [await t for t in tasks] == [(200, b"{}")] * 3
        assert server.connections == (cap or 3) and len(server.requests) == 3


async def test_a_hop_waiting_at_the_cap_gives_up_after_the_connect_timeout() -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        await server.request(r)
        await r.read()

    async with serving(handler, max_per_host=1, connect_timeout=0.2) as (server, url, client):
        held = asyncio.create_task(post(client, url))
        await until(lambda: bool(server.requests))
        with pytest.raises(TimeoutError):
            await post(client, url)
        assert server.connections == 1 and not held.done()
        held.cancel()
        with pytest.raises(asyncio.CancelledError):
            await held
        assert client.counts() == {"in_use": 0, "idle": 0}
        assert client._open == {} and client._waiters == {}


async def test_a_connect_that_does_not_complete_is_a_connect_timeout_and_holds_no_place() -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        await server.request(r)
        w.write(ok(b"{}"))
        await w.drain()

    async with serving(handler, max_per_host=1, connect_timeout=0.2) as (server, url, client):
        loop = asyncio.get_running_loop()

        async def never(*args: Any, **kw: Any) -> None:
            await asyncio.Event().wait()

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(loop, "create_connection", never)
            with pytest.raises(HopConnectTimeout, match=r"not connected within 0\.2 s"):
                await post(client, url)
        assert client._open == {} and client.counts() == {"in_use": 0, "idle": 0}
        assert await post(client, url) == (200, b"{}")  # its place under the cap of 1 is free
        assert server.connections == 1


async def test_a_connect_whose_timeout_the_loop_overslept_is_tried_again() -> None:
    """The loop stands still (a loaded host) past the connect timeout while the kernel connects:
    the timer and the connection's completion are both due at once and the timer wins (the
    connect takes a few loop turns to finish). Tried once more, the hop is answered."""
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        await server.request(r)
        w.write(ok(b"{}"))
        await w.drain()

    async with serving(handler, max_per_host=1, connect_timeout=0.1) as (server, url, client):
        task = asyncio.create_task(post(client, url))
        await asyncio.sleep(0)  # the connect is under way
        time.sleep(0.1 + hop._STALL + 0.3)  # noqa: ASYNC251 (the loop stands still past the timeout)
        assert await task == (200, b"{}")
        assert client._open == {parse_origin(url).key: 1} and client.counts() == {"in_use": 0, "idle": 1}


async def test_a_connection_closed_at_the_cap_lets_a_waiting_hop_open_one() -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        await server.request(r)
        if n == 0:
            w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n{")  # then nothing more
            await w.drain()
            await r.read()
            return
        w.write(ok(b"{}"))
        await w.drain()

    async with serving(handler, max_per_host=1) as (server, url, client):
        loop = asyncio.get_running_loop()
        first = await client.request(url, "/g", b"", b"{}", deadline=loop.time() + 10, read_limit=5)
        waiting = asyncio.create_task(post(client, url))
        await asyncio.sleep(0.05)
        assert not waiting.done() and server.connections == 1
        first.close()  # mid-answer: the connection is closed, its place taken by the waiting hop
        assert await waiting == (200, b"{}")
        assert server.connections == 2
        assert client._open == {parse_origin(url).key: 1}


async def test_closing_an_answer_before_its_end_closes_the_connection_release_keeps_it() -> None:
    """``close()`` mid-answer tells the worker the caller left (vLLM aborts on it); ``release()``
    after the content waits for the framing's end and keeps the connection."""
    finish = asyncio.Event()

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        while await server.request(r):
            w.write(chunked(b"data: [DONE]\n\n")[:-5])
            await w.drain()
            if len(server.requests) == 1:
                await r.read()
                server.closed_by_client.append(n)
                return
            await finish.wait()
            w.write(b"0\r\n\r\n")
            await w.drain()

    async with serving(handler) as (server, url, client):
        loop = asyncio.get_running_loop()
        resp = await client.request(url, "/g", b"", b"{}", deadline=None, read_limit=5)
        assert await resp.read_any() == b"data: [DONE]\n\n"
        resp.close()
        await until(lambda: bool(server.closed_by_client))
        assert server.closed_by_client == [0]
        resp = await client.request(url, "/g", b"", b"{}", deadline=loop.time() + 10, read_limit=5)
        assert await resp.read_any() == b"data: [DONE]\n\n"
        resp.release()
        assert client.counts() == {"in_use": 1, "idle": 0}  # lingering for the last chunk
        finish.set()
        await until(lambda: client.counts()["idle"] == 1)
        assert client.counts() == {"in_use": 0, "idle": 1}
        assert server.connections == 2


@pytest.mark.parametrize("framing", ["length", "chunked"])
async def test_an_unread_body_pauses_reading_until_it_is_read(framing: str) -> None:
    size = 4 << 20

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        await server.request(r)
        if framing == "length":
            w.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % size)
            w.write(b"x" * size)
        else:  # small chunks, many to a read (a stream's events)
            w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            w.write((b"400\r\n" + b"x" * 1024 + b"\r\n") * (size // 1024) + b"0\r\n\r\n")
        await w.drain()

    async with serving(handler) as (server, url, client):
        loop = asyncio.get_running_loop()
        resp = await client.request(url, "/g", b"", b"{}", deadline=loop.time() + 30, read_limit=10)
        conn = resp._conn
        assert conn is not None
        await until(lambda: conn._reading_paused)
        assert conn._reading_paused and conn._buffered < size
        assert len(await resp.read()) == size
        resp.close()


async def test_a_cancelled_request_closes_its_connection() -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        await server.request(r)
        await r.read()
        server.closed_by_client.append(n)

    async with serving(handler) as (server, url, client):
        task = asyncio.create_task(post(client, url))
        await until(lambda: bool(server.requests))
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await until(lambda: bool(server.closed_by_client))
        assert server.closed_by_client == [0]
        assert client.counts() == {"in_use": 0, "idle": 0}


async def test_idle_connections_past_the_keepalive_are_not_reused_and_are_swept() -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        while await server.request(r):
            w.write(ok(b"{}"))
            await w.drain()

    async with serving(handler, keepalive=0.0) as (server, url, client):
        await post(client, url)
        await post(client, url)
        assert server.connections == 2
        client.sweep()
        assert client.counts() == {"in_use": 0, "idle": 0}


def test_header_values_with_line_breaks_are_left_out() -> None:
    assert header_lines({"X-Request-Id": "a\r\nEvil: 1", "X-Ok": "b"}) == b"X-Ok: b\r\n"
