"""``Upstream.open`` over the hop client against scripted servers on loopback: a hop whose
kept-alive connection ended after the request went out is sent again only once the worker
aborted its id (and is counted); a worker that stops reading a request is an upstream timeout."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from proxy.upstream.client import ABORT_PATH, Upstream
from proxy.wire.errors import UpstreamTimeout, UpstreamUnavailable
from tests.proxy.hop_servers import BIG_BODY, Handler, Server, head_only, ok, serving

Event = tuple[str, Any]
Counted = list[tuple[str, str]]


@contextlib.asynccontextmanager
async def upstream(handler: Handler, **kw: Any) -> AsyncIterator[tuple[Server, str, Upstream, Counted]]:
    counted: Counted = []
    async with serving(handler, **kw) as (server, url, client), aiohttp.ClientSession() as session:
        up = Upstream(session, api_key=None, connect_timeout=5.0, hops=client, abort_limit=2.0,
                      count_resend=lambda hop, result: counted.append((hop, result)))
        yield server, url, up, counted


class StaleWorker:
    """Reads the second generate call on its first connection and closes it without answering;
    answers aborts with ``abort_status`` and every other generate call with 200."""

    def __init__(self, abort_status: int) -> None:
        self.abort_status = abort_status
        self.events: list[Event] = []
        self.server: Server | None = None

    async def __call__(self, r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        assert self.server is not None
        while request := await self.server.request(r):
            head, _, body = request.partition(b"\r\n\r\n")
            if ABORT_PATH.encode() in head.split(b"\r\n", 1)[0]:
                self.events.append(("abort", json.loads(body)))
                w.write(b"HTTP/1.1 %d X\r\nContent-Length: 0\r\n\r\n" % self.abort_status)
            else:
                self.events.append(("generate", n))
                if sum(1 for e in self.events if e[0] == "generate") == 2:
                    return  # read it, then closed: no answer byte
                w.write(ok(b'{"ok":1}'))
            await w.drain()


@contextlib.asynccontextmanager
async def stale_worker(abort_status: int) -> AsyncIterator[tuple[str, Upstream, list[Event], Counted]]:
    worker = StaleWorker(abort_status)
    async with upstream(worker) as (server, url, up, counted):
        worker.server = server
        yield url, up, worker.events, counted


async def test_a_stale_kept_alive_hop_is_sent_again_only_after_the_worker_aborted_its_id() -> None:
    async with stale_worker(200) as (url, up, events, counted):
        assert await up.post_generate("prefill", url, {"a": 1}, request_id="r0", total=10.0) == {"ok": 1}
        assert await up.post_generate("prefill", url, {"a": 2}, request_id="r1", total=10.0) == {"ok": 1}
    # The copy the worker read (on connection 0) is aborted by its engine id before the resend.
    assert events[:3] == [("generate", 0), ("generate", 0),
                          ("abort", {"request_ids": ["generate-tokens-r1"]})]
    assert events[3][0] == "generate" and events[3][1] != 0 and len(events) == 4
    assert counted == [("prefill", "resent")]


async def test_a_stale_kept_alive_hop_whose_abort_fails_is_not_sent_again() -> None:
    async with stale_worker(500) as (url, up, events, counted):
        await up.post_generate("decode", url, {"a": 1}, request_id="r0", total=10.0)
        with pytest.raises(UpstreamUnavailable) as e:
            await up.post_generate("decode", url, {"a": 2}, request_id="r1", total=10.0)
        assert "closed the connection" in e.value.message
        assert up.hops.counts() == {"in_use": 0, "idle": 0}
    assert events == [("generate", 0), ("generate", 0), ("abort", {"request_ids": ["generate-tokens-r1"]})]
    assert counted == [("decode", "abort_failed")]


async def test_a_worker_that_stops_reading_the_request_is_an_upstream_timeout() -> None:
    release = asyncio.Event()

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        await head_only(r)
        await release.wait()

    async with upstream(handler, rcvbuf=4096, write_timeout=0.3) as (_, url, up, _counted):
        task = asyncio.create_task(up.open("decode", url, {"x": "y" * BIG_BODY}, request_id="r", total=None))
        done, _ = await asyncio.wait({task}, timeout=20)  # a bound for the old behaviour (it hung)
        release.set()
        assert task in done, "the hop is still writing to a worker that stopped reading"
        assert isinstance(task.exception(), UpstreamTimeout)
        assert up.hops.counts() == {"in_use": 0, "idle": 0}


async def test_a_worker_never_connected_is_an_upstream_timeout_that_says_so() -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        raise AssertionError("never connected")

    async def never(*args: Any, **kw: Any) -> None:
        await asyncio.Event().wait()

    async with upstream(handler, connect_timeout=0.2) as (_, url, up, _counted):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(asyncio.get_running_loop(), "create_connection", never)
            with pytest.raises(UpstreamTimeout) as e:
                await up.open("decode", url, {"a": 1}, request_id="r", total=None)
        assert e.value.message == f"decode worker {url}: not connected within 0.2 s"
        assert up.hops.counts() == {"in_use": 0, "idle": 0}
