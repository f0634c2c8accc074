"""The proxy never keeps an idle upstream connection longer than the workers do.

vLLM (uvicorn) closes an idle keep-alive connection after ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE`` (5 s). A pooled
connection kept longer by the proxy can be reused just as the worker closes it, and the request then
fails with a disconnect (a 502 to the client). Seen on the real CPU stack with a 60 s pool.
"""

from __future__ import annotations

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient

from proxy.app import SERVING, build_app
from proxy.cli import parse_args
from proxy.settings import ProxySettings

VLLM_DEFAULT_KEEP_ALIVE = 5.0


async def test_upstream_pool_drops_idle_connections_before_vllm_does(aiohttp_client: object) -> None:
    settings = ProxySettings(prefill_urls=("http://127.0.0.1:9",), decode_urls=("http://127.0.0.1:9",))
    assert settings.upstream_keepalive_timeout < VLLM_DEFAULT_KEEP_ALIVE
    app: web.Application = build_app(settings)
    client: TestClient[web.Request, web.Application] = await aiohttp_client(app)  # type: ignore[operator]
    connector = client.app[SERVING].upstream.session.connector
    assert connector is not None
    assert connector._keepalive_timeout == settings.upstream_keepalive_timeout
    assert client.app[SERVING].upstream.hops.keepalive == settings.upstream_keepalive_timeout


def test_keepalive_is_a_cli_setting() -> None:
    settings = parse_args(
        ["--prefill", "http://p", "--decode", "http://d", "--upstream-keepalive-timeout", "2.5"]
    )
    assert settings.upstream_keepalive_timeout == pytest.approx(2.5)
