"""Limits on what a client may send before the proxy spends anything on it: ``BodyLimit`` runs
after authentication and before any handler. Headers are bounded by aiohttp itself (8190 bytes a
line, ``--header-timeout``)."""

from __future__ import annotations

import asyncio
from collections.abc import Collection

from aiohttp import web
from aiohttp.typedefs import Middleware

from proxy.wire.errors import BodyTimeout, Handler, PayloadTooLarge
from proxy.wire.large_body import LARGE_BODY_BYTES

RAW_BODY = web.RequestKey("raw_body", bytearray)


async def _read_growing(request: web.Request, max_bytes: int) -> bytearray:
    """The body in one growing buffer, kept as it is: aiohttp's ``read`` copies the whole body."""
    buf = bytearray()
    while True:
        chunk = await request.content.readany()
        if not chunk:
            return buf
        buf += chunk
        if len(buf) > max_bytes:
            raise PayloadTooLarge(f"Request body too large: the limit is {max_bytes} bytes")


async def request_body(request: web.Request) -> bytes | bytearray:
    """The request's body, as ``body_middleware`` read it."""
    raw = request.get(RAW_BODY)
    return raw if raw is not None else await request.read()


class BodyLimit:
    """A body announced larger than ``max_bytes`` is refused (413, nothing read); a body that is
    read is read whole under ``timeout`` (408) and cached on the request."""

    def __init__(self, max_bytes: int, timeout: float, *, large_bytes: int = LARGE_BODY_BYTES) -> None:
        self.max_bytes, self.timeout, self.large_bytes = max_bytes, timeout, large_bytes

    async def take(self, request: web.Request, *, read: bool = True, large: bool = False) -> None:
        """Check ``request``'s body and, when ``read``, read it."""
        if not request.body_exists:
            return
        max_bytes, timeout = self.max_bytes, self.timeout
        length = request.content_length
        if length is not None and length > max_bytes:
            raise PayloadTooLarge(f"Request body too large: {length} bytes, the limit is {max_bytes}")
        if not read:
            return
        try:
            if large and (length is None or length > self.large_bytes):
                request[RAW_BODY] = await asyncio.wait_for(_read_growing(request, max_bytes), timeout)
            elif request.content.is_eof():
                await request.read()  # it all came with the headers: no timer, no task
            else:
                await asyncio.wait_for(request.read(), timeout)
        except TimeoutError:
            raise BodyTimeout.after(timeout) from None
        except web.HTTPRequestEntityTooLarge:
            raise PayloadTooLarge(f"Request body too large: the limit is {max_bytes} bytes") from None


def body_middleware(limit: BodyLimit, read_paths: Collection[str], *,
                    large_paths: Collection[str] = ()) -> Middleware:
    """``limit`` on every route; the body is read here only on ``read_paths`` (others read their
    own), and without a final copy on ``large_paths``."""
    paths = frozenset(read_paths)
    large = frozenset(large_paths)

    @web.middleware
    async def limit_body(request: web.Request, handler: Handler) -> web.StreamResponse:
        path = request.path
        await limit.take(request, read=path in paths, large=path in large)
        return await handler(request)

    return limit_body


__all__ = ["RAW_BODY", "BodyLimit", "body_middleware", "request_body"]
