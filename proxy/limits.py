"""Limits on what a client may send before the proxy spends anything on it.

``body_middleware`` runs after authentication and before any handler: a body announced
larger than ``max_bytes`` is refused at once (413, nothing read); otherwise, on the routes
that read bodies (generate, abort), the whole body is read under ``timeout`` (a client
trickling it gets a 408) and cached on the request, so the handlers' ``await request.read()``
costs nothing more. Bodies sent without a length (chunked) are cut at ``max_bytes`` by
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

from proxy.errors import BodyTimeout, Handler, PayloadTooLarge


def body_middleware(max_bytes: int, timeout: float, read_paths: Collection[str]) -> Middleware:
    """``read_paths``: the routes whose handlers read the body (it is read here, under the
    timeout); on others only the announced length is checked (sub-applications such as the
    admin API read their own bodies and test ``request.can_read_body``)."""
    paths = frozenset(read_paths)

    @web.middleware
    async def limit_body(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.body_exists:
            length = request.content_length
            if length is not None and length > max_bytes:
                raise PayloadTooLarge(f"Request body too large: {length} bytes, the limit is {max_bytes}")
            if request.path not in paths:
                return await handler(request)
            try:
                if request.content.is_eof():
                    await request.read()  # it all came with the headers: no timer, no task
                else:
                    await asyncio.wait_for(request.read(), timeout)
            except TimeoutError:
                raise BodyTimeout(f"the request body did not arrive within {timeout:g} s") from None
            except web.HTTPRequestEntityTooLarge:
                raise PayloadTooLarge(f"Request body too large: the limit is {max_bytes} bytes") from None
        return await handler(request)

    return limit_body


__all__ = ["body_middleware"]
