"""The proxy's one exception tree, mapped once to vLLM's error JSON and an HTTP status.

``ProxyError``
├── ``ClientError``            the request is wrong (400), nothing was sent anywhere
│   ├── ``InvalidRequest``     FastAPI-style validation failure (``type: "Bad Request"``)
│   └── ``BadRequest``         vLLM's own checks (``type: "BadRequestError"``)
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
from typing import Any

from aiohttp import web

from proxy.protocol import RequestValidationError, VLLMValidationError, error_body


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    """JSON as vLLM (starlette) writes it: compact, UTF-8 unescaped."""
    return web.Response(body=json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode(),
                        status=status, headers=headers, content_type="application/json")


class ProxyError(Exception):
    status: int = 500
    err_type: str = "InternalServerError"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.err_type, self.status, self.param)

    def to_response(self, headers: dict[str, str] | None = None) -> web.Response:
        return json_response(self.body(), self.status, headers)

    def sse_event(self) -> bytes:
        """The in-band error event vLLM sends once a stream has started."""
        return b"data: " + json.dumps(self.body(), separators=(",", ":")).encode() + b"\n\n"


class ClientError(ProxyError):
    status = 400


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


class Unauthorized(ProxyError):
    status = 401
    err_type = "Unauthorized"

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

    def to_response(self, headers: dict[str, str] | None = None) -> web.Response:
        if self.passthrough:
            resp = web.Response(status=self.upstream_status, body=self.upstream_body, headers=headers)
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
    err_type = "GatewayTimeoutError"


class UpstreamProtocolError(UpstreamError):
    pass


class StreamOverflow(ProxyError):
    """The client read so slowly that the bytes queued for it passed the cap."""

    status = 503
    err_type = "ServiceUnavailableError"
