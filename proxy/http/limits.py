"""Limits on what a client may send before the proxy spends anything on it.

``BodyLimit`` runs after authentication and before any handler (as ``body_middleware`` on the full
path, and inside the lean front of the generate and abort calls, ``proxy.http.lean``): a body announced
larger than ``max_bytes`` is refused at once (413, nothing read); otherwise, on the routes
that read bodies (generate, abort), the whole body is read under ``timeout`` (a client
trickling it gets a 408) and cached on the request, so the handlers' ``await request.read()``
costs nothing more (a large generate body is read into one growing buffer instead, handed over by
``request_body``: ``proxy.wire.large_body``). Bodies sent without a length (chunked) are cut at
``max_bytes`` by
aiohttp's ``client_max_size`` (set to the same value by the app) and answered 413.

Headers are bounded by aiohttp itself: a request line or header over 8190 bytes is a 400, and a
client that has not finished sending its headers when the server's keep-alive timer fires (it
starts when the connection opens and restarts after each response) is disconnected; ``pd-proxy``
sets that timer from ``--header-timeout``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection

from aiohttp import web
from aiohttp.typedefs import Middleware

from proxy.wire.errors import BodyTimeout, Handler, PayloadTooLarge
from proxy.wire.large_body import LARGE_BODY_BYTES

RAW_BODY = web.RequestKey("raw_body", bytearray)
"""A large body, as ``body_middleware`` read it (``request_body``)."""


async def _read_growing(request: web.Request, max_bytes: int) -> bytearray:
    """The body, chunk by chunk into one growing buffer that is kept as it is: aiohttp's
    ``read`` ends with ``bytes(buffer)``, a copy of the whole body in one step (10-20 ms of the
    loop for 16 MiB, most of it page faults), which is what the large-body path avoids."""
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
    """The body checks of one app: a body announced larger than ``max_bytes`` is refused (413,
    nothing read); a body that is read is read whole under ``timeout`` (408) and cached on the
    request. ``body_middleware`` applies it to every route, the lean front (``proxy.http.lean``) to the
    generate and abort calls."""

    def __init__(self, max_bytes: int, timeout: float, *, large_bytes: int = LARGE_BODY_BYTES) -> None:
        self.max_bytes, self.timeout, self.large_bytes = max_bytes, timeout, large_bytes

    async def take(self, request: web.Request, *, read: bool = True, large: bool = False) -> None:
        """Check ``request``'s body and, when ``read``, read it (``large``: a body over
        ``large_bytes``, or of unknown length, into one growing buffer, for ``request_body``)."""
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
    """``limit`` applied to every route. ``read_paths``: the routes whose handlers read the body
    (it is read here, under the timeout); on others only the announced length is checked
    (sub-applications such as the admin API read their own bodies and test
    ``request.can_read_body``). On ``large_paths`` a body over ``limit.large_bytes`` (or of
    unknown length) is read without a final copy, and its handler takes it with ``request_body``."""
    paths = frozenset(read_paths)
    large = frozenset(large_paths)

    @web.middleware
    async def limit_body(request: web.Request, handler: Handler) -> web.StreamResponse:
        path = request.path
        await limit.take(request, read=path in paths, large=path in large)
        return await handler(request)

    return limit_body


__all__ = ["RAW_BODY", "BodyLimit", "body_middleware", "request_body"]
