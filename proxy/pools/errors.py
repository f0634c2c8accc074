"""Errors of the pools layer, in the proxy's one error tree (``proxy.wire.errors.ProxyError``).

``ProxyError``
├── ``Overloaded``          the admission queue is full or the wait timed out: 429 + ``Retry-After``
├── ``NoWorkerAvailable``   every worker of a pool is unhealthy, ejected or draining: 503 + ``Retry-After``
└── ``DeadlineExceeded``    the request's deadline passed before an answer: 504
"""

from __future__ import annotations

import math

from aiohttp import web

from proxy.wire.errors import ProxyError


class _RetryAfterError(ProxyError):
    def __init__(self, message: str, *, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after

    @property
    def retry_after_header(self) -> str:
        """Whole seconds, at least 1 (RFC 9110 delay-seconds)."""
        return str(max(1, math.ceil(self.retry_after)))

    def to_response(self, headers: dict[str, str] | None = None) -> web.Response:
        merged = dict(headers or {})
        merged["Retry-After"] = self.retry_after_header
        return super().to_response(merged)


class Overloaded(_RetryAfterError):
    """Admission refused the request: the wait queue was full, or the wait timed out."""

    status = 429
    err_type = "TooManyRequestsError"
    _outcome = "rejected"

    def __init__(self, message: str, *, retry_after: float, reason: str) -> None:
        super().__init__(message, retry_after=retry_after)
        self.reason = reason


class NoWorkerAvailable(_RetryAfterError):
    status = 503
    err_type = "ServiceUnavailableError"

    def __init__(self, pool: str, *, retry_after: float) -> None:
        super().__init__(f"no {pool} worker is available", retry_after=retry_after)
        self.pool = pool


class DeadlineExceeded(ProxyError):
    status = 504
    err_type = "GatewayTimeoutError"
    _outcome = "timeout"

    def __init__(self, stage: str) -> None:
        super().__init__(f"the request's deadline passed during {stage}")
        self.stage = stage
