"""The lean front of the hot calls: ``POST`` generate and abort served without the router and the
middleware chain.

aiohttp's ``Application._handle`` resolves every request through the router (a match object
built, the app added to it and frozen, an ``Expect`` check), then runs it through the middleware
chain (one coroutine frame per middleware: errors, keys, body limits). For the generate and abort
calls the answer is always the same route, so ``LeanApplication`` looks the path up in one dict
(by ``rel_url.path_safe``, the key the router matches on) and runs the same steps in one frame:
the key check (``guard``), the body limits (``proxy.http.limits.BodyLimit``), the handler, and every
error answered by ``proxy.wire.errors.answer_error``, the error middleware's own code. The request
gets a match object built once per route (shared and frozen, its match dict empty), so
``request.app`` and ``request.match_info`` work as on any route.

Anything else takes the full path, unchanged: another method on these paths (405 in vLLM's shape,
from the router), a request with an ``Expect`` header (the router's expect handler), every other
route and the sub-applications (health, metrics, debug, admin).

Every request is parsed by aiohttp's own (strict) parser; a head it refuses is answered by
``QuietRequestHandler``.
"""

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
"""Checks a request's key before its body is read (raises ``Unauthorized``, ``Forbidden``) and
notes its tenant on the request."""


class LeanRoute(NamedTuple):
    match_info: web.UrlMappingMatchInfo
    handler: Handler
    large: bool
    """Whether a large body is read into a growing buffer (``proxy.http.limits.request_body``)."""


with warnings.catch_warnings():
    # aiohttp discourages subclassing (it prefers composition); ``_handle`` is the one seam where
    # a request can skip the router without leaving the app (its runner, signals, test server).
    warnings.simplefilter("ignore", DeprecationWarning)

    class LeanApplication(web.Application):
        """A ``web.Application`` that serves the routes added with ``add_lean_post`` in one frame
        (see the module's docstring); the rest as any application."""

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
            """The key check of the lean routes (the auth middleware's own, on the full path)."""
            self._lean_guard = guard

        def add_lean_post(self, path: str, handler: Handler, *, large: bool = False) -> None:
            """``POST path`` on the lean front; the router has it too (for the 405 of another method,
            ``Expect`` requests and introspection)."""
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
            """The error, key and body middlewares and the handler, in their order, in one frame."""
            try:
                if self._lean_guard is not None:
                    self._lean_guard(request)
                await self._lean_limit.take(request, large=route.large)
                return await route.handler(request)
            except Exception as e:
                return answer_error(request, e)


class QuietRequestHandler(web.RequestHandler):
    """aiohttp's request handler, for every connection the app accepts. A request its parser
    refuses is answered in vLLM's error shape and logged in one line, its class and status:
    aiohttp logs it at ERROR with the parser's message, which quotes the offending line (an
    ``Authorization`` header and its key, say), and answers it as plain text that echoes it.
    Errors of a handler (500) stay aiohttp's (the app's middlewares answer them first)."""

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
