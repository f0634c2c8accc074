"""The server's answer to a request its parser refuses: vLLM's error shape, and a log line that
names the parser's error class only."""

from __future__ import annotations

import logging
import warnings
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMethod

from proxy.wire.errors import malformed_http_response

log = logging.getLogger("pd_proxy")


with warnings.catch_warnings():
    # ``_make_handler`` is the one seam where the server's connections get their handler class.
    warnings.simplefilter("ignore", DeprecationWarning)

    class QuietApplication(web.Application):
        """A ``web.Application`` whose server's connections get ``QuietRequestHandler``."""

        def _make_handler(self, **kwargs: Any) -> web.Server:
            server = super()._make_handler(**kwargs)
            return QuietServer(server.request_handler, request_factory=server.request_factory,
                               loop=self._loop, handler_cancellation=server.handler_cancellation,
                               **server._kwargs)


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


__all__ = ["QuietApplication", "QuietRequestHandler", "QuietServer"]
