"""``/livez`` (the process serves) and ``/readyz`` (a request can be routed now) beside ``/health``:
a liveness probe on ``/health`` restarted the proxy, dropping every live stream, whenever a pool had no
reachable worker (vLLM start-up, a pool outage)."""

from __future__ import annotations

from typing import Any

from proxy.app import DRAINING
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
