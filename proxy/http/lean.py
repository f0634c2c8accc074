"""The lean front of the hot calls: ``POST`` generate and abort served without the router and the
middleware chain, by the same steps in one frame (key check, body limits, handler, errors answered
by the error middleware's own code). Another method, an ``Expect`` header and every other route
take the full path, unchanged."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple

from aiohttp import hdrs, web
from aiohttp.http_exceptions import BadHttpMethod

from proxy.http.limits import BodyLimit
from proxy.wire.errors import answer_error, malformed_http_response

log = logging.getLogger("pd_proxy")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Guard = Callable[[web.Request], None]
"""Checks a request's key before its body is read and notes its tenant on the request."""


class LeanRoute(NamedTuple):
    match_info: web.UrlMappingMatchInfo
    handler: Handler
    large: bool


with warnings.catch_warnings():
    # ``_handle`` is the one seam where a request can skip the router without leaving the app.
    warnings.simplefilter("ignore", DeprecationWarning)

    class LeanApplication(web.Application):
        """Serves the routes added with ``add_lean_post`` in one frame; the rest as any app."""

        ATTRS = web.Application.ATTRS | frozenset({"_lean", "_lean_guard", "_lean_limit"})

        def __init__(self, *, limit: BodyLimit, **kwargs: object) -> None:
            super().__init__(**kwargs)  # type: ignore[arg-type]
            self._lean: dict[str, LeanRoute] = {}
            self._lean_guard: Guard | None = None
            self._lean_limit = limit

        def _make_handler(self, **kwargs: Any) -> web.Server:
            server = super()._make_handler(**kwargs)
            return QuietServer(server.request_handler, request_factory=server.request_factory,
                               loop=self._loop, handler_cancellation=server.handler_cancellation,
                               **server._kwargs)

        def set_guard(self, guard: Guard) -> None:
            self._lean_guard = guard

        def add_lean_post(self, path: str, handler: Handler, *, large: bool = False) -> None:
            """``POST path`` on the lean front; the router has it too (405s, ``Expect``)."""
            route = self.router.add_post(path, handler)
            match_info = web.UrlMappingMatchInfo({}, route)
            match_info.add_app(self)
            match_info.freeze()
            self._lean[path] = LeanRoute(match_info, handler, large)

        async def _handle(self, request: web.Request) -> web.StreamResponse:
            if request.method == hdrs.METH_POST:
                route = self._lean.get(request.rel_url.path_safe)
                if route is not None and hdrs.EXPECT not in request.headers:
                    request._match_info = route.match_info
                    return await self._serve_lean(request, route)
            return await super()._handle(request)

        async def _serve_lean(self, request: web.Request, route: LeanRoute) -> web.StreamResponse:
            try:
                if self._lean_guard is not None:
                    self._lean_guard(request)
                await self._lean_limit.take(request, large=route.large)
                return await route.handler(request)
            except Exception as e:
                return answer_error(request, e)


class QuietRequestHandler(web.RequestHandler):
    """A request the parser refuses is answered in vLLM's error shape and logged by its class
    only: aiohttp's own message quotes the offending line, which may hold a key."""

    def handle_error(self, request: web.BaseRequest, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if status != 400:
            return super().handle_error(request, status, exc, message)
        # Non-HTTP traffic (a TLS hello, a scanner) is a bad method: DEBUG, as aiohttp logs it.
        level = logging.DEBUG if isinstance(exc, BadHttpMethod) else logging.INFO
        log.log(level, "refused a malformed HTTP request from %s: %s", request.remote,
                type(exc).__name__ if exc is not None else "no error")
        if request.writer.output_size > 0:  # as aiohttp: an answer is on its way, the connection is broken
            raise ConnectionError("an answer was sent already: no error answer can follow")
        return malformed_http_response(status, exc)


class QuietServer(web.Server):
    """A ``web.Server`` whose connections get ``QuietRequestHandler``."""

    def __call__(self) -> web.RequestHandler:
        return QuietRequestHandler(self, loop=self._loop, **self._kwargs)


__all__ = ["Guard", "LeanApplication", "LeanRoute", "QuietRequestHandler", "QuietServer"]
