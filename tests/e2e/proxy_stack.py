"""pd-proxy served on loopback in front of a real vLLM cluster (shared by the e2e tests)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from proxy.config.settings import ProxySettings
from proxy.http.app import build_app
from proxy.pools import PoolSettings
from workers.launcher import Cluster

E2E_CONNECT_TIMEOUT = 30.0
"""The proxy's connect timeout in these tests: on the loaded 2-core host the test process (the
proxy's loop) can stand still for seconds, and a connect to a worker on loopback then failed at
the default 5 s (once, in CI: a migrated stream's decode hop)."""


@contextlib.asynccontextmanager
async def run_proxy(cluster: Cluster, **settings: Any) -> AsyncIterator[tuple[str, web.Application]]:
    """The proxy with default settings except one: no decode-only bypass when the prefill pool is
    unavailable. These tests assert that KV crosses from P to D behind every request, and on the
    loaded 2-core stack a vLLM CPU worker can miss three /health probes in a row (5 s each): with
    the bypass on, the proxy then rightly sends requests decode-only (a correct answer, no NIXL
    transfer). Without it, a pool whose every worker failed its probes still routes to them.
    The connect timeout is generous (``E2E_CONNECT_TIMEOUT``)."""
    settings.setdefault("pools", PoolSettings(bypass_when_prefill_unavailable=False))
    settings.setdefault("connect_timeout", E2E_CONNECT_TIMEOUT)
    app = build_app(ProxySettings(prefill_urls=tuple(cluster.prefill_urls),
                                  decode_urls=tuple(cluster.decode_urls), **settings))
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=5)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = next(int(a[1]) for a in runner.addresses if isinstance(a, tuple))
    try:
        yield f"http://127.0.0.1:{port}", app
    finally:
        await runner.cleanup()
