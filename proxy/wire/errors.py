"""The proxy's one exception tree (``ProxyError``), mapped once to vLLM's error JSON and an HTTP
status by ``error_middleware``: ``ClientError`` (the request is wrong, nothing was sent),
``UpstreamError`` (a worker failed: its 4xx passes through, else 502/504), and a few others.
"""

from __future__ import annotations

import json
import logging
import traceback
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Any

from aiohttp import web

from proxy.wire.protocol import compact_json
from proxy.wire.replies import error_body
from proxy.wire.validation_errors import RequestValidationError, VLLMValidationError


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    """JSON as vLLM (starlette) writes it: compact, UTF-8 unescaped."""
    return web.Response(body=compact_json(body),
                        status=status, headers=headers, content_type="application/json")


class ProxyError(Exception):
    status: int = 500
    err_type: str = "InternalServerError"
    _outcome: str = "upstream_error"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.headers: dict[str, str] | None = None
        """Headers the answer carries (a generate request's id and decode-only reason)."""

    @property
    def outcome(self) -> str:
        """The ``outcome`` label of ``pd_proxy_requests_total`` when a generate call ends so."""
        return self._outcome

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.err_type, self.status, self.param)

    def to_response(self, headers: dict[str, str] | None = None) -> web.Response:
        return json_response(self.body(), self.status, headers if headers is not None else self.headers)

    def sse_event(self) -> bytes:
        """The in-band error event vLLM sends once a stream has started."""
        return b"data: " + json.dumps(self.body(), separators=(",", ":")).encode() + b"\n\n"


class ClientError(ProxyError):
    status = 400
    _outcome = "client_error"


class InvalidRequest(ClientError):
    err_type = "Bad Request"

    @classmethod
    def from_protocol(cls, exc: RequestValidationError) -> InvalidRequest:
        return cls(exc.message, param=exc.param)


class BadRequest(ClientError):
    err_type = "BadRequestError"

    @classmethod
    def from_protocol(cls, exc: VLLMValidationError) -> BadRequest:
        return cls(str(exc), param=exc.parameter)


class PayloadTooLarge(ClientError):
    status = 413
    err_type = HTTPStatus(413).phrase


class BodyTimeout(ClientError):
    status = 408
    err_type = HTTPStatus(408).phrase

    @classmethod
    def after(cls, timeout: float) -> BodyTimeout:
        """The body did not arrive within ``timeout`` seconds (the lean front's and the front's)."""
        return cls(f"the request body did not arrive within {timeout:g} s")


class HTTPBadRequest(ClientError):
    """The abort endpoint's 400, as vLLM's ``HTTPException`` handler writes it."""

    err_type = HTTPStatus(400).phrase


class Forbidden(ProxyError):
    status = 403
    err_type = HTTPStatus(403).phrase
    _outcome = "client_error"


class ShuttingDown(ProxyError):
    """A generate call that arrives while the proxy drains."""

    status = 503
    err_type = "ServiceUnavailableError"
    _outcome = "rejected"

    def __init__(self) -> None:
        super().__init__("the proxy is shutting down")


class Unauthorized(ProxyError):
    status = 401
    err_type = "Unauthorized"
    _outcome = "client_error"

    def body(self) -> dict[str, Any]:
        return {"error": "Unauthorized"}


class UpstreamError(ProxyError):
    status = 502
    err_type = "BadGatewayError"

    def __init__(self, hop: str, worker: str, reason: str) -> None:
        super().__init__(f"{hop} worker {worker}: {reason}")
        self.hop = hop
        self.worker = worker
        self.reason = reason


class UpstreamStatusError(UpstreamError):
    """The worker answered ``upstream_status``; 4xx replies reach the client unchanged."""

    def __init__(
        self, hop: str, worker: str, upstream_status: int, body: bytes, content_type: str
    ) -> None:
        super().__init__(hop, worker, f"answered HTTP {upstream_status}")
        self.upstream_status = upstream_status
        self.upstream_body = body
        self.content_type = content_type
        if 400 <= upstream_status < 500:
            self.status = upstream_status

    @property
    def passthrough(self) -> bool:
        return 400 <= self.upstream_status < 500

    @property
    def outcome(self) -> str:
        return "client_error" if self.passthrough else "upstream_error"

    def to_response(self, headers: dict[str, str] | None = None) -> web.Response:
        if self.passthrough:
            resp = web.Response(status=self.upstream_status, body=self.upstream_body,
                                headers=headers if headers is not None else self.headers)
            resp.content_type = self.content_type.split(";")[0] or "application/json"
            return resp
        return super().to_response(headers)

    def sse_event(self) -> bytes:
        if self.passthrough:
            try:
                parsed = json.loads(self.upstream_body)
            except ValueError:
                parsed = None
            if isinstance(parsed, dict) and isinstance(parsed.get("error"), dict):
                return b"data: " + json.dumps(parsed, separators=(",", ":")).encode() + b"\n\n"
        return super().sse_event()


class UpstreamUnavailable(UpstreamError):
    pass


class UpstreamTimeout(UpstreamError):
    status = 504
    _outcome = "timeout"
    err_type = "GatewayTimeoutError"


class UpstreamProtocolError(UpstreamError):
    pass


class StreamOverflow(ProxyError):
    """The client read so slowly that the bytes queued for it passed the cap."""

    status = 503
    err_type = "ServiceUnavailableError"


log = logging.getLogger("pd_proxy")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def http_exception_response(exc: web.HTTPException) -> web.StreamResponse:
    """aiohttp's own HTTP errors as vLLM (FastAPI/starlette) answers them."""
    if exc.status in (404, 405):
        resp = json_response({"detail": HTTPStatus(exc.status).phrase}, exc.status)
        if exc.status == 405 and "Allow" in exc.headers:
            resp.headers["Allow"] = exc.headers["Allow"]
        return resp
    if exc.status == 413:
        return PayloadTooLarge("Request body too large").to_response()
    return json_response(error_body(exc.reason, HTTPStatus(exc.status).phrase, exc.status), exc.status)


def malformed_http_response(status: int, exc: BaseException | None) -> web.Response:
    """A request aiohttp's parser refused, in vLLM's shape: the parser's error class only, never
    its message (it quotes the request's bytes, which may hold a key)."""
    what = f" ({type(exc).__name__})" if exc is not None else ""
    body = error_body(f"malformed HTTP request{what}", HTTPStatus(status).phrase, status)
    resp = json_response(body, status)
    resp.force_close()
    return resp


ErrorHook = Callable[[web.Request, "ProxyError"], None]
ON_ERROR: web.AppKey[ErrorHook] = web.AppKey("on_error")
"""App key: called with every ``ProxyError`` a handler raised, before it is answered."""


def log_unexpected(e: BaseException, doing: str) -> None:
    """Log an unexpected error's type and frames, never its message (it can quote request values)."""
    log.error("unexpected %s while %s\n%s", type(e).__name__, doing,
              "".join(traceback.format_tb(e.__traceback__)).rstrip())


def answer_error(request: web.Request, e: Exception) -> web.StreamResponse:
    """A handler's exception in vLLM's shape (anything unexpected: a logged, generic 500).
    Re-raises an ``HTTPException`` under 400 and ``ConnectionResetError``."""
    if isinstance(e, ProxyError):
        on_error = request.app.get(ON_ERROR)
        if on_error is not None:
            on_error(request, e)
        return e.to_response()
    if isinstance(e, web.HTTPException):
        if e.status < 400:
            raise e
        return http_exception_response(e)
    if isinstance(e, ConnectionResetError):
        raise e
    log_unexpected(e, f"serving {request.method} {request.path}")
    return json_response(error_body("Internal server error", "InternalServerError", 500), 500)


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Outermost middleware: every error leaves in vLLM's shape (``answer_error``)."""
    try:
        return await handler(request)
    except Exception as e:
        return answer_error(request, e)
