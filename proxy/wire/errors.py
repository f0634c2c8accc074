"""The proxy's one exception tree, mapped once to vLLM's error JSON and an HTTP status.

``ProxyError``
├── ``ClientError``            the request is wrong (400), nothing was sent anywhere
│   ├── ``InvalidRequest``     FastAPI-style validation failure (``type: "Bad Request"``)
│   └── ``BadRequest``         vLLM's own checks (``type: "BadRequestError"``)
│   ├── ``PayloadTooLarge``    the body passed ``--max-body-bytes`` (413, never read further)
│   └── ``BodyTimeout``        the body did not arrive within ``--body-timeout`` (408)
├── ``Unauthorized``           missing/wrong API key: 401 ``{"error":"Unauthorized"}`` as vLLM
└── ``UpstreamError``          a worker failed; names the hop ("prefill"/"decode") and the worker
    ├── ``UpstreamStatusError``   the worker answered an error status (4xx passes through unchanged,
    │                             5xx becomes a 502)
    ├── ``UpstreamUnavailable``   transport failure: 502
    ├── ``UpstreamTimeout``       no answer in time: 504
    └── ``UpstreamProtocolError`` a 2xx reply the proxy cannot use (bad JSON, no KV params,
                                  wrong ``output_mode`` echo, stream ended early): 502
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
    err_type = HTTPStatus(413).phrase  # vLLM's HTTPException handler: the status phrase


class BodyTimeout(ClientError):
    status = 408
    err_type = HTTPStatus(408).phrase

    @classmethod
    def after(cls, timeout: float) -> BodyTimeout:
        """The body did not arrive within ``timeout`` seconds (the lean front's and the front's)."""
        return cls(f"the request body did not arrive within {timeout:g} s")


class HTTPBadRequest(ClientError):
    """A 400 as vLLM's ``HTTPException`` handler writes it (the status phrase as ``type``): the
    abort endpoint's."""

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


# --------------------------------------------------------------------------------------------
# The one place where anything a handler raises becomes a response

log = logging.getLogger("pd_proxy")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def http_exception_response(exc: web.HTTPException) -> web.StreamResponse:
    """aiohttp's own HTTP errors as vLLM (FastAPI/starlette) answers them: an unknown path or
    method is starlette's ``{"detail": ...}``; anything else vLLM's error JSON with the status
    phrase as ``type`` (its ``http_exception_handler``)."""
    if exc.status in (404, 405):
        resp = json_response({"detail": HTTPStatus(exc.status).phrase}, exc.status)
        if exc.status == 405 and "Allow" in exc.headers:
            resp.headers["Allow"] = exc.headers["Allow"]
        return resp
    if exc.status == 413:
        return PayloadTooLarge("Request body too large").to_response()
    return json_response(error_body(exc.reason, HTTPStatus(exc.status).phrase, exc.status), exc.status)


def malformed_http_response(status: int, exc: BaseException | None) -> web.Response:
    """A request aiohttp's parser refused (a malformed head, a bad chunk): vLLM's error shape,
    naming the parser's error class only, never its message (it quotes the request's bytes,
    which may hold a key); the connection is closed after it, as aiohttp does."""
    what = f" ({type(exc).__name__})" if exc is not None else ""
    body = error_body(f"malformed HTTP request{what}", HTTPStatus(status).phrase, status)
    resp = json_response(body, status)
    resp.force_close()
    return resp


ErrorHook = Callable[[web.Request, "ProxyError"], None]
ON_ERROR: web.AppKey[ErrorHook] = web.AppKey("on_error")
"""App key: called with every ``ProxyError`` a handler raised, before it is answered (the app
counts failed generate calls there)."""


def log_unexpected(e: BaseException, doing: str) -> None:
    """An error nobody expected, logged with its type and frames (code locations) but not its
    message: messages can quote request values."""
    log.error("unexpected %s while %s\n%s", type(e).__name__, doing,
              "".join(traceback.format_tb(e.__traceback__)).rstrip())


def answer_error(request: web.Request, e: Exception) -> web.StreamResponse:
    """What a handler's exception becomes: every error in vLLM's shape (``ProxyError``s counted
    through the app's ``ON_ERROR`` hook), an unexpected exception a logged (method, path and type
    only: never the body) generic 500, not aiohttp's text. Re-raises what is not an error answer:
    an ``HTTPException`` under 400 (a redirect) and ``ConnectionResetError``. The error middleware
    and the lean front of the generate and abort calls (``proxy.http.lean``) both answer through it."""
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
    """Outermost middleware: every error leaves in vLLM's shape (``answer_error``). Handlers and
    the walk raise; this is where errors become answers (and are counted). Cancellation passes."""
    try:
        return await handler(request)
    except Exception as e:
        return answer_error(request, e)
