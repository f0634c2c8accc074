"""pd-proxy served on loopback in front of a real vLLM cluster (shared by the e2e tests)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from proxy.app import build_app
from proxy.pools import PoolSettings
from proxy.settings import ProxySettings
from workers.launcher import Cluster


@contextlib.asynccontextmanager
async def run_proxy(cluster: Cluster, **settings: Any) -> AsyncIterator[tuple[str, web.Application]]:
    """The proxy with default settings except one: no decode-only bypass when the prefill pool is
    unavailable. These tests assert that KV crosses from P to D behind every request, and on the
    loaded 2-core stack a vLLM CPU worker can miss three /health probes in a row (5 s each): with
    the bypass on, the proxy then rightly sends requests decode-only (a correct answer, no NIXL
    transfer). Without it, a pool whose every worker failed its probes still routes to them."""
    settings.setdefault("pools", PoolSettings(bypass_when_prefill_unavailable=False))
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
