"""proxy.wire.errors: every error leaves in vLLM's shape with its status, a worker's 4xx reaches the
client unchanged, and an unexpected exception is a generic 500 whose log never quotes it.
(Against a running proxy, every route: ``tests/reliability/test_hostile.py``.)"""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient

from proxy.wire.errors import (
    ON_ERROR,
    BadRequest,
    ProxyError,
    ShuttingDown,
    Unauthorized,
    UpstreamProtocolError,
    UpstreamStatusError,
    UpstreamTimeout,
    error_middleware,
    http_exception_response,
)

D = "http://127.0.0.1:9201"
VLLM_400 = b'{"error":{"message":"max_tokens too large","type":"BadRequestError","param":null,"code":400}}'


def body_of(resp: web.Response) -> Any:
    assert isinstance(resp.body, bytes)
    return json.loads(resp.body)


def test_a_workers_4xx_reaches_the_client_unchanged() -> None:
    e = UpstreamStatusError("decode", D, 422, VLLM_400, "application/json; charset=utf-8")
    resp = e.to_response({"X-Request-Id": "r"})
    assert (resp.status, resp.body, resp.content_type) == (422, VLLM_400, "application/json")
    assert resp.headers["X-Request-Id"] == "r"
    assert e.status == 422 and e.outcome == "client_error"
    assert e.sse_event() == b"data: " + VLLM_400 + b"\n\n"  # in-band, on a stream already started


def test_a_workers_4xx_that_is_not_vllms_error_is_the_proxys_own_on_a_stream() -> None:
    e = UpstreamStatusError("decode", D, 404, b"<html>bad</html>", "text/html")
    assert e.to_response().body == b"<html>bad</html>"
    event = json.loads(e.sse_event().removeprefix(b"data: "))
    assert event == {"error": {"message": f"decode worker {D}: answered HTTP 404",
                               "type": "BadGatewayError", "param": None, "code": 404}}


def test_a_workers_5xx_is_a_502_naming_the_hop_and_the_worker() -> None:
    e = UpstreamStatusError("prefill", D, 503, b"secret detail", "text/plain")
    resp = e.to_response()
    assert resp.status == 502 and e.outcome == "upstream_error"
    assert body_of(resp) == {"error": {"message": f"prefill worker {D}: answered HTTP 503",
                                       "type": "BadGatewayError", "param": None, "code": 502}}


@pytest.mark.parametrize(("error", "status", "err_type", "outcome"), [
    (UpstreamTimeout("decode", D, "timed out"), 504, "GatewayTimeoutError", "timeout"),
    (UpstreamProtocolError("decode", D, "answered a body that is not JSON"), 502, "BadGatewayError",
     "upstream_error"),
    (BadRequest("n must be at most 4", param="n"), 400, "BadRequestError", "client_error"),
    (ShuttingDown(), 503, "ServiceUnavailableError", "rejected"),
])
def test_each_error_has_its_status_type_and_outcome(error: ProxyError, status: int, err_type: str,
                                                    outcome: str) -> None:
    resp = error.to_response()
    assert resp.status == status and error.outcome == outcome
    assert body_of(resp) == {"error": {"message": error.message, "type": err_type, "param": error.param,
                                       "code": status}}


def test_unauthorized_is_vllms_bare_answer() -> None:
    resp = Unauthorized("no key").to_response()
    assert resp.status == 401 and body_of(resp) == {"error": "Unauthorized"}


def test_an_error_carries_the_requests_headers() -> None:
    e = UpstreamTimeout("decode", D, "timed out")
    e.headers = {"X-Request-Id": "r", "X-PD-Decode-Only": "prefill_error"}
    assert e.to_response().headers["X-PD-Decode-Only"] == "prefill_error"


def test_aiohttps_own_errors_as_vllm_answers_them() -> None:
    not_found = http_exception_response(web.HTTPNotFound())
    assert not_found.status == 404 and body_of(not_found) == {"detail": "Not Found"}  # type: ignore[arg-type]
    method = http_exception_response(web.HTTPMethodNotAllowed("PUT", ["GET", "POST"]))
    assert method.status == 405 and method.headers["Allow"] == "GET,POST"
    assert body_of(method) == {"detail": "Method Not Allowed"}  # type: ignore[arg-type]
    large = http_exception_response(web.HTTPRequestEntityTooLarge(10, 20))
    assert large.status == 413
    assert body_of(large)["error"]["type"] == "Request Entity Too Large"  # type: ignore[arg-type]
    bad = http_exception_response(web.HTTPBadRequest(reason="Bad header"))
    assert body_of(bad) == {"error": {"message": "Bad header", "type": "Bad Request",  # type: ignore[arg-type]
                                      "param": None, "code": 400}}


async def client(aiohttp_client: Any, handler: Any, seen: list[ProxyError]) -> TestClient[Any, Any]:
    app = web.Application(middlewares=[error_middleware])
    app[ON_ERROR] = lambda request, e: seen.append(e)
    app.router.add_post("/x", handler)
    result: TestClient[Any, Any] = await aiohttp_client(app)
    return result


async def test_the_middleware_answers_and_counts_a_raised_error(aiohttp_client: Any) -> None:
    seen: list[ProxyError] = []
    raised = UpstreamTimeout("decode", D, "timed out")

    async def handler(request: web.Request) -> web.Response:
        raise raised

    c = await client(aiohttp_client, handler, seen)
    r = await c.post("/x")
    assert r.status == 504 and (await r.json())["error"]["type"] == "GatewayTimeoutError"
    assert seen == [raised]


async def test_an_unexpected_exception_is_a_generic_500_never_quoted(
        aiohttp_client: Any, caplog: pytest.LogCaptureFixture) -> None:
    seen: list[ProxyError] = []

    async def handler(request: web.Request) -> web.Response:
        raise ValueError(await request.text())  # a message may quote what the client sent

    c = await client(aiohttp_client, handler, seen)
    with caplog.at_level(logging.ERROR, logger="pd_proxy"):
        r = await c.post("/x", data=b"prompt text: the secret plan")
    assert r.status == 500 and await r.json() == {"error": {
        "message": "Internal server error", "type": "InternalServerError", "param": None, "code": 500}}
    logged = "\n".join(rec.getMessage() for rec in caplog.records)
    assert "unexpected ValueError while serving POST /x" in logged and "secret plan" not in logged
    assert seen == []


async def test_a_redirect_is_not_an_error(aiohttp_client: Any) -> None:
    async def handler(request: web.Request) -> web.Response:
        raise web.HTTPFound("/elsewhere")

    c = await client(aiohttp_client, handler, [])
    r = await c.post("/x", allow_redirects=False)
    assert r.status == 302 and r.headers["Location"] == "/elsewhere"
