"""proxy.observe.diagnostics: ``GET /debug/runtime`` counts what a long run watches for leaks (requests,
background tasks, KV leases, upstream connections, Python objects), back to nothing once the proxy
is idle. (Behind the admin key: ``tests/reliability/test_security.py``.)"""

from __future__ import annotations

import asyncio
import gc
import os
from typing import Any

from proxy.observe.diagnostics import connector_counts, rss_bytes
from tests.proxy.conftest import PDFactory, req


async def runtime(pd: Any, query: str = "") -> dict[str, Any]:
    r = await pd.client.get("/debug/runtime" + query)
    assert r.status == 200
    data: dict[str, Any] = await r.json()
    return data


async def test_a_request_holding_kv_is_counted_and_nothing_is_left_after_it(pd_factory: PDFactory) -> None:
    pd = await pd_factory(hold_between_hops=10.0, kv_block_size=4)  # no /metrics reads: control idle
    idle = await runtime(pd)
    assert (idle["requests_in_flight"], idle["background_tasks"], idle["kv_leases_open"]) == (0, 0, 0)
    assert idle["pid"] == os.getpid() and idle["tasks"] >= 1
    task = asyncio.create_task(pd.client.post("/inference/v1/generate", json=req(request_id="dg")))
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 3
    while not any(r.phase.value == "kv_held" for r in pd.serving.table.all()):
        assert loop.time() < deadline, "never reached kv_held"
        await asyncio.sleep(0.01)
    held = await runtime(pd)
    assert held["requests_in_flight"] == 1 and held["kv_leases_open"] == 1
    assert held["upstream_connections"]["idle"] >= 1  # the prefill hop's connection, kept alive
    r = await pd.client.post("/inference/v1/abort_requests", json={"request_ids": ["generate-tokens-dg"]})
    assert r.status == 200
    await asyncio.wait_for(task, 5)
    await pd.quiet(limit=2.0)
    after = await runtime(pd)
    assert (after["requests_in_flight"], after["background_tasks"], after["kv_leases_open"]) == (0, 0, 0)
    assert after["upstream_connections"]["in_use"] == 0


def test_counts_without_a_connector_and_the_processes_memory() -> None:
    assert connector_counts(None) == {"in_use": 0, "idle": 0}
    rss = rss_bytes()
    assert rss is not None and rss > 1 << 20  # Linux: read from /proc


async def test_collect_counts_only_the_objects_still_reachable(pd_factory: PDFactory) -> None:
    pd = await pd_factory()
    enabled = gc.isenabled()
    gc.disable()  # no automatic collection between the two readings
    try:
        cycles: list[list[Any]] = [[] for _ in range(20_000)]
        for one in cycles:
            one.append(one)  # each list its own cycle: garbage that only a collection frees
        del cycles, one
        pending = await runtime(pd)
        collected = await runtime(pd, "?collect=1")
    finally:
        if enabled:
            gc.enable()
    assert pending["python_objects"] - collected["python_objects"] >= 20_000
    assert collected["gc"]["collections"][2] > pending["gc"]["collections"][2]  # a full collection ran


async def test_collect_takes_0_or_1(pd_factory: PDFactory) -> None:
    pd = await pd_factory()
    assert (await runtime(pd, "?collect=0"))["requests_in_flight"] == 0
    r = await pd.client.get("/debug/runtime?collect=yes")
    assert r.status == 400
    error = (await r.json())["error"]
    assert (error["param"], error["code"]) == ("collect", 400) and "0 or 1" in error["message"]
