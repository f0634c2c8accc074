"""``/livez`` (the process serves) and ``/readyz`` (a request can be routed now) beside ``/health``:
a liveness probe on ``/health`` restarted the proxy, dropping every live stream, whenever a pool had no
reachable worker (vLLM start-up, a pool outage)."""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from proxy.http.app import DRAINING, SERVING
from proxy.pools import PoolSettings
from tests.proxy.conftest import PD, PDFactory, req


async def probe(pd: PD, path: str) -> tuple[int, Any]:
    r = await pd.client.get(path)
    return r.status, await r.json()


async def test_ready_and_live_with_both_pools_up(pd_factory: PDFactory) -> None:
    pd = await pd_factory()
    assert await probe(pd, "/livez") == (200, {"status": "ok"})
    assert await probe(pd, "/readyz") == (200, {"status": "ok"})
    assert (await pd.client.get("/health")).status == 200


async def test_decode_pool_down_is_unready_but_alive(pd_factory: PDFactory) -> None:
    pd = await pd_factory()
    (d,) = pd.serving.decode_pool.workers
    d.draining = True  # no decode worker may take a request
    assert await probe(pd, "/livez") == (200, {"status": "ok"})
    assert await probe(pd, "/readyz") == (503, {"status": "unavailable"})
    assert (await pd.client.get("/health")).status == 503  # /health unchanged
    d.draining = False
    assert (await probe(pd, "/readyz"))[0] == 200


async def test_prefill_pool_down_is_ready_only_with_the_bypass(pd_factory: PDFactory) -> None:
    pd = await pd_factory(pools=PoolSettings.plain(bypass_when_prefill_unavailable=True))
    pd.serving.prefill_pool.workers[0].draining = True
    assert (await probe(pd, "/readyz"))[0] == 200  # decode-only takes the requests
    status, _, headers = await pd.gen(req())
    assert status == 200 and headers["X-PD-Decode-Only"] == "prefill_unavailable"
    pd = await pd_factory()  # plain: no bypass
    pd.serving.prefill_pool.workers[0].draining = True
    assert (await probe(pd, "/readyz"))[0] == 503
    assert (await probe(pd, "/livez"))[0] == 200


async def test_an_empty_pool_is_unready(proxy_factory: Any) -> None:
    """Discovery before any pod is ready (vLLM loads for minutes): no worker yet."""
    client, _ = await proxy_factory(["http://127.0.0.1:9"], [], pools=PoolSettings.plain(admin_key="adm"))
    r = await client.get("/readyz")
    assert r.status == 503 and (await r.json())["status"] == "unavailable"
    assert (await client.get("/livez")).status == 200


async def test_draining_is_unready_and_still_alive(pd_factory: PDFactory) -> None:
    pd = await pd_factory()
    pd.app[DRAINING].set()
    assert await probe(pd, "/readyz") == (503, {"status": "draining"})
    assert await probe(pd, "/livez") == (200, {"status": "draining"})


async def test_probes_need_no_key(pd_factory: PDFactory) -> None:
    pd = await pd_factory(api_key="k1", pools=PoolSettings.plain(admin_key="adm"))
    assert (await pd.client.get("/livez")).status == 200
    assert (await pd.client.get("/readyz")).status == 200


async def until(check: Any, limit: float = 10.0) -> None:
    """Poll ``check`` (an async predicate) until it holds, within a generous bound."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit
    while not await check():
        assert loop.time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


async def test_a_pool_in_panic_is_unready(proxy_factory: Any, aiohttp_server: Any) -> None:
    """The only decode worker fails its probes: the pool panics (it may still route what arrives),
    but nothing passes the probes, so ``/readyz`` says 503 as ``/health`` says 0 available; once it
    passes them again, 200."""
    decode_up = {"ok": True}

    async def health(_: web.Request) -> web.Response:
        return web.Response(status=200 if decode_up["ok"] else 503)

    async def healthy(_: web.Request) -> web.Response:
        return web.Response(status=200)

    servers = []
    for handler in (healthy, health):
        app = web.Application()
        app.router.add_get("/health", handler)
        servers.append(await aiohttp_server(app, host="127.0.0.1"))
    p, d = (str(s.make_url("")).rstrip("/") for s in servers)
    client, app = await proxy_factory([p], [d], kv_block_size=16, pools=PoolSettings.plain(
        active_health=True, health_interval=0.02, health_fail_threshold=1, health_recover_threshold=1,
        panic_when_all_unhealthy=True))
    pool = app[SERVING].decode_pool
    assert pool.panic

    async def readyz() -> tuple[int, Any]:
        r = await client.get("/readyz")
        return r.status, await r.json()

    async def decode_available() -> int:
        body = await (await client.get("/health")).json()
        return int(body["workers"]["decode"]["available"])

    async def ready() -> bool:
        return (await readyz())[0] == 200

    await until(ready)
    decode_up["ok"] = False

    async def unhealthy() -> bool:
        return not pool.workers[0].healthy

    await until(unhealthy)
    assert pool.in_panic and pool.candidates()  # panic mode: requests that arrive are still routed
    assert await readyz() == (503, {"status": "unavailable"})
    assert await decode_available() == 0
    decode_up["ok"] = True
    await until(ready)
    assert await decode_available() == 1
