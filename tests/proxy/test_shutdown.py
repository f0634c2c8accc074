"""Graceful shutdown: in-flight requests finish within the drain timeout; the rest are ended
cleanly (their upstream work aborted, nothing left held)."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
from aiohttp import web

from proxy.config.settings import ProxySettings
from proxy.http.app import METRICS, SERVING, build_app
from proxy.pools import PoolSettings
from tests.fixtures_sim import SimFactory
from tests.proxy.conftest import req, sse_datas

SLOW_DECODE = {"zero_latency": False, "itl_ms": 20.0, "prefill_base_ms": 0.0, "prefill_per_token_ms": 0.0,
               "transfer_per_block_ms": 0.0}


async def start(app: web.Application, drain: float) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=drain)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = next(int(a[1]) for a in runner.addresses if isinstance(a, tuple))
    return runner, f"http://127.0.0.1:{port}"


async def run_shutdown(sim_factory: SimFactory, max_tokens: int, drain: float) -> tuple[list[Any], Any]:
    p = await sim_factory(role="prefill", zero_latency=True)
    d = await sim_factory(role="decode", **SLOW_DECODE)
    app = build_app(ProxySettings(prefill_urls=(p.url,), decode_urls=(d.url,), drain_timeout=drain))
    serving = app[SERVING]
    runner, url = await start(app, drain)
    async with aiohttp.ClientSession() as s:
        r = await s.post(url + "/inference/v1/generate",
                         json={**req(sp={"max_tokens": max_tokens, "ignore_eos": True}), "stream": True})
        first = await r.content.readuntil(b"\n\n")
        stop = asyncio.create_task(runner.cleanup())
        try:
            rest = await asyncio.wait_for(r.read(), 10)
        except aiohttp.ClientPayloadError:
            rest = b""
        await asyncio.wait_for(stop, 10)
    states = [await p.state(), await d.state()]
    assert len(serving.table) == 0 and len(serving.tracker) == 0
    return sse_datas(first + rest), states


async def test_inflight_stream_finishes_during_drain(sim_factory: SimFactory) -> None:
    events, states = await run_shutdown(sim_factory, max_tokens=20, drain=5.0)
    assert events[-1] == "[DONE]"
    assert sum(len(e["choices"][0]["token_ids"]) for e in events[:-1]) == 20
    assert all(not s["inflight"] and not s["kv_held"] for s in states)


async def test_stream_past_the_drain_timeout_is_ended_and_aborted(sim_factory: SimFactory) -> None:
    events, states = await run_shutdown(sim_factory, max_tokens=2000, drain=0.3)
    assert sum(len(e["choices"][0]["token_ids"]) for e in events if isinstance(e, dict)) < 2000
    assert all(not s["kv_held"] for s in states)
    assert not states[1]["inflight"], "the decode worker's request must have been aborted"


async def test_shutdown_counts_its_aborts(sim_factory: SimFactory) -> None:
    p = await sim_factory(role="prefill", zero_latency=True)
    d = await sim_factory(role="decode", **SLOW_DECODE)
    app = build_app(ProxySettings(prefill_urls=(p.url,), decode_urls=(d.url,), drain_timeout=0.2))
    metrics = app[METRICS]
    runner, url = await start(app, 0.2)
    async with aiohttp.ClientSession() as s:
        r = await s.post(url + "/inference/v1/generate",
                         json={**req(sp={"max_tokens": 2000, "ignore_eos": True}), "stream": True})
        await r.content.readuntil(b"\n\n")
        await asyncio.wait_for(runner.cleanup(), 10)
        r.close()
    text = metrics.render().decode()
    assert 'pd_proxy_aborts_total{source="shutdown",state="decoding"} 1.0' in text


async def test_a_request_still_prefilling_when_the_drain_ends_is_aborted_on_the_prefill_worker(
        sim_factory: SimFactory) -> None:
    """The drain ends while the prefill hop waits for P (a 60-s prefill): the request is ended
    (aiohttp's server cancels the handler, the hop's task outliving it) and counted as a shutdown
    abort while prefilling, and nothing stays held or running on P or in the proxy (P aborted,
    or its hop's connection closed with the upstream session as the app stops)."""
    p = await sim_factory(role="prefill", zero_latency=False, prefill_base_ms=60_000.0,
                          prefill_per_token_ms=0.0)
    d = await sim_factory(role="decode", **SLOW_DECODE)
    app = build_app(ProxySettings(prefill_urls=(p.url,), decode_urls=(d.url,), drain_timeout=0.2,
                                  pools=PoolSettings.plain()))
    serving, metrics = app[SERVING], app[METRICS]
    runner, url = await start(app, 0.2)
    loop = asyncio.get_running_loop()
    async with aiohttp.ClientSession() as s:
        call = asyncio.create_task(s.post(url + "/inference/v1/generate", json=req()))
        deadline = loop.time() + 10.0
        while not (await p.state())["inflight"]:  # the prefill hop is with P
            assert loop.time() < deadline, "the prefill hop never reached P"
            await asyncio.sleep(0.02)
        await asyncio.wait_for(runner.cleanup(), 30)
        await asyncio.gather(call, return_exceptions=True)
    while (await p.state())["inflight"] or len(serving.table) or len(serving.tracker):
        assert loop.time() < deadline + 20.0, "P's request was never aborted"
        await asyncio.sleep(0.05)
    assert not (await p.state())["kv_held"]
    text = metrics.render().decode()
    assert 'pd_proxy_aborts_total{source="shutdown",state="prefilling"} 1.0' in text
