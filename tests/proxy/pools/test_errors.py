"""proxy.pools.errors: the pools' refusals in vLLM's error shape, with ``Retry-After`` in whole
seconds (at least 1) where a retry may succeed."""

from __future__ import annotations

import json

import pytest
from aiohttp import web

from proxy.pools import DeadlineExceeded, NoWorkerAvailable, Overloaded


@pytest.mark.parametrize(("retry_after", "header"), [(0.0, "1"), (0.2, "1"), (1.0, "1"), (2.01, "3")])
def test_retry_after_is_whole_seconds_at_least_one(retry_after: float, header: str) -> None:
    e = NoWorkerAvailable("decode", retry_after=retry_after)
    resp = e.to_response({"X-Request-Id": "r"})
    assert resp.headers["Retry-After"] == header and resp.headers["X-Request-Id"] == "r"


def body(resp: web.Response) -> object:
    assert isinstance(resp.body, bytes)
    return json.loads(resp.body)


def test_each_refusal_has_its_status_and_outcome() -> None:
    full = Overloaded("the queue is full", retry_after=1.0, reason="queue_full")
    assert (full.status, full.outcome, full.reason) == (429, "rejected", "queue_full")
    assert body(full.to_response())["error"]["type"] == "TooManyRequestsError"  # type: ignore[index]
    none = NoWorkerAvailable("prefill", retry_after=1.0)
    assert (none.status, none.outcome) == (503, "upstream_error")
    assert none.message == "no prefill worker is available"
    late = DeadlineExceeded("prefill")
    resp = late.to_response()
    assert (late.status, late.outcome) == (504, "timeout") and "Retry-After" not in resp.headers
    assert body(resp) == {"error": {"message": "the request's deadline passed during prefill",
                                    "type": "GatewayTimeoutError", "param": None, "code": 504}}
