"""The upstream connection pools: never an idle connection kept longer than the workers keep it,
at most --upstream-max-connections-per-host per worker, stale-hop resends counted.

The proxy never keeps an idle upstream connection longer than the workers do.

vLLM (uvicorn) closes an idle keep-alive connection after ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE`` (5 s). A pooled
connection kept longer by the proxy can be reused just as the worker closes it, and the request then
fails with a disconnect (a 502 to the client). Seen on the real CPU stack with a 60 s pool.
"""

from __future__ import annotations

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient

from proxy.cli import parse_args
from proxy.config.settings import ProxySettings
from proxy.http.app import SERVING, build_app

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


async def test_upstream_connections_per_worker_are_capped_by_default(aiohttp_client: object) -> None:
    """Both pools to the workers (the generate hops' and the control calls') have the cap."""
    settings = ProxySettings(prefill_urls=("http://127.0.0.1:9",), decode_urls=("http://127.0.0.1:9",))
    assert settings.upstream_max_connections_per_host == 512
    app: web.Application = build_app(settings)
    client: TestClient[web.Request, web.Application] = await aiohttp_client(app)  # type: ignore[operator]
    upstream = client.app[SERVING].upstream
    assert upstream.hops.max_per_host == 512
    assert upstream.session.connector is not None
    assert upstream.session.connector.limit_per_host == 512


@pytest.mark.parametrize(("flag", "cap"), [([], 512), (["--upstream-max-connections-per-host", "8"], 8),
                                           (["--upstream-max-connections-per-host", "0"], 0)])
def test_the_connection_cap_is_a_cli_setting(flag: list[str], cap: int) -> None:
    settings = parse_args(["--prefill", "http://p", "--decode", "http://d", *flag])
    assert settings.upstream_max_connections_per_host == cap


def test_a_negative_connection_cap_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--prefill", "http://p", "--decode", "http://d",
                    "--upstream-max-connections-per-host", "-1"])
    assert "--upstream-max-connections-per-host must be 0 (no cap) or more" in capsys.readouterr().err


async def test_resends_of_stale_hops_are_counted_in_the_metrics(aiohttp_client: object) -> None:
    settings = ProxySettings(prefill_urls=("http://127.0.0.1:9",), decode_urls=("http://127.0.0.1:9",))
    app: web.Application = build_app(settings)
    client: TestClient[web.Request, web.Application] = await aiohttp_client(app)  # type: ignore[operator]
    upstream = client.app[SERVING].upstream
    assert upstream.abort_limit == settings.control_timeout
    count = upstream._count_resend
    assert count is not None
    count("decode", "resent")
    text = (await (await client.get("/metrics")).text())
    assert 'pd_proxy_upstream_resends_total{hop="decode",result="resent"} 1.0' in text
