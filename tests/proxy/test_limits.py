"""proxy.http.limits: a body over the limit is refused before it is read, a body that does not arrive
in time is a 408, and a large generate body is read without a final copy. (Against a running
proxy, raw sockets: ``tests/reliability/test_hostile.py``.)"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from proxy.http.limits import BodyLimit, body_middleware, request_body
from proxy.wire.errors import error_middleware

MAX, LARGE = 1000, 100


def app(seen: list[str]) -> web.Application:
    async def read(request: web.Request) -> web.Response:
        body = await request_body(request)
        seen.append(type(body).__name__)
        return web.json_response({"bytes": len(body)})

    async def other(request: web.Request) -> web.Response:
        seen.append("other")
        return web.json_response({"bytes": len(await request.read())})

    a = web.Application(middlewares=[error_middleware, body_middleware(
        BodyLimit(MAX, 0.2, large_bytes=LARGE), ["/read"], large_paths=["/read"])], client_max_size=MAX)
    a.router.add_post("/read", read)
    a.router.add_post("/other", other)
    return a


async def test_a_body_announced_over_the_limit_is_refused_unread(aiohttp_client: Any) -> None:
    seen: list[str] = []
    c: TestClient[Any, Any] = await aiohttp_client(app(seen))
    for path in ("/read", "/other"):
        r = await c.post(path, data=b"x" * (MAX + 1))
        assert r.status == 413
        message = f"Request body too large: {MAX + 1} bytes, the limit is {MAX}"
        assert await r.json() == {"error": {"message": message, "type": "Request Entity Too Large",
                                            "param": None, "code": 413}}
    assert seen == []


async def test_a_chunked_body_over_the_limit_is_cut(aiohttp_client: Any) -> None:
    seen: list[str] = []
    c: TestClient[Any, Any] = await aiohttp_client(app(seen))

    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(20):
            yield b"y" * 100

    r = await c.post("/read", data=chunks())  # no length: read as a large body, cut at the limit
    assert r.status == 413 and seen == []


async def test_a_large_body_is_handed_over_as_read_and_a_small_one_as_bytes(aiohttp_client: Any) -> None:
    seen: list[str] = []
    c: TestClient[Any, Any] = await aiohttp_client(app(seen))
    r = await c.post("/read", data=b"z" * (LARGE + 1))
    assert await r.json() == {"bytes": LARGE + 1}
    r = await c.post("/read", data=b"z" * LARGE)
    assert await r.json() == {"bytes": LARGE}
    r = await c.post("/other", data=b"z" * (LARGE + 1))  # not a route the middleware reads for
    assert await r.json() == {"bytes": LARGE + 1}
    assert seen == ["bytearray", "bytes", "other"]


async def test_a_body_that_does_not_arrive_in_time_is_a_408() -> None:
    seen: list[str] = []
    server = TestServer(app(seen), host="127.0.0.1")
    await server.start_server()
    try:
        for length in (10, LARGE + 10):  # a small body and a large one: both under the timer
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(f"POST /read HTTP/1.1\r\nHost: x\r\nContent-Length: {length}\r\n\r\nab".encode())
            await writer.drain()
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            writer.close()
            assert head.startswith(b"HTTP/1.1 408"), head
    finally:
        await server.close()
    assert seen == []  # the handler never ran


async def test_a_route_that_reads_its_own_body_is_not_under_the_timer() -> None:
    """The admin API reads its own bodies: only the announced length is checked for it."""
    seen: list[str] = []
    server = TestServer(app(seen), host="127.0.0.1")
    await server.start_server()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"POST /other HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n\r\nab")
        await writer.drain()
        await asyncio.sleep(0.4)  # twice the middleware's timer
        writer.write(b"cd")
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        writer.close()
        assert head.startswith(b"HTTP/1.1 200"), head
    finally:
        await server.close()
    assert seen == ["other"]
