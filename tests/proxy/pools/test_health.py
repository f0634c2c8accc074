from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from proxy.fleet import health as health_mod
from proxy.fleet.health import (
    HealthChecker,
    LoadScraper,
    PairState,
    Preflight,
    http_fetch,
    http_probe,
    parse_load,
)
from proxy.pools.breaker import BreakerConfig, CircuitState
from proxy.pools.pool import Pool
from proxy.pools.worker import Outcome, Worker
from proxy.upstream import capped
from proxy.upstream import client as upstream_mod
from tests.proxy.pools.helpers import FakeClock
from tests.traces import TRACE_DIR, load_trace

A, B = "http://127.0.0.1:9001", "http://127.0.0.1:9002"

METRICS = """# HELP vllm:num_requests_waiting Waiting.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="1",model_name="m"} 2.0
# HELP vllm:num_requests_running Running.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 7.0
# HELP vllm:kv_cache_usage_perc KV usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.7
"""


async def test_probe_thresholds_eject_and_readmit() -> None:
    clock = FakeClock()
    pool = Pool("decode", [A, B], clock=clock, breaker=BreakerConfig(failure_threshold=1))
    up = {A: True, B: True}
    changes: list[tuple[str, bool]] = []

    async def probe(w: Worker) -> bool:
        if w.url == B:
            raise OSError("probe blew up")  # an exception counts as a failure
        return up[w.url]

    hc = HealthChecker([pool], probe, fail_threshold=2, recover_threshold=2,
                       on_change=lambda w: changes.append((w.url, w.healthy)))
    a, b = pool.workers
    up[A] = False
    await hc.probe_once()
    assert a.healthy  # one failure is under the threshold
    await hc.probe_once()
    assert not a.healthy and not b.healthy
    assert pool.candidates() == []
    up[A] = True
    a.begin()
    a.end(outcome=Outcome.FAILURE)  # the breaker opened meanwhile
    assert a.circuit is CircuitState.OPEN
    await hc.probe_once()
    assert not a.healthy
    await hc.probe_once()
    assert a.healthy and a.circuit is CircuitState.CLOSED
    assert pool.candidates() == [a]
    assert changes == [(A, False), (B, False), (A, True)]


async def test_http_probe_and_fetch_against_a_server(aiohttp_server: Any) -> None:
    state = {"health": 200}

    async def health(_: web.Request) -> web.Response:
        return web.Response(status=state["health"])

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=METRICS)

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    server = await aiohttp_server(app, host="127.0.0.1")
    url = f"http://127.0.0.1:{server.port}"
    pool = Pool("prefill", [url, "http://127.0.0.1:1"])
    good, dead = pool.workers
    async with aiohttp.ClientSession() as session:
        probe = http_probe(session, timeout=5)
        assert await probe(good) is True
        assert await probe(dead) is False
        state["health"] = 503
        assert await probe(good) is False
        clock = FakeClock()
        scraper = LoadScraper([pool], http_fetch(session, timeout=5), clock)
        await scraper.scrape_once()
    assert good.load is not None and dead.load is None
    assert (good.load.waiting, good.load.running) == (5.0, 7.0)
    assert good.load.kv_usage == pytest.approx(0.6)
    assert good.load.at == clock()


def test_parse_load_on_a_real_vllm_scrape() -> None:
    body = load_trace(TRACE_DIR / "metrics-pd-decode.txt").response("main").body.decode()
    assert "vllm:num_requests_waiting{" in body and "vllm:kv_cache_usage_perc{" in body
    load = parse_load(body, 1.0)
    assert (load.waiting, load.running, load.kv_usage, load.at) == (0.0, 0.0, 0.0, 1.0)
    assert parse_load("", 2.0).kv_usage == 0.0


async def test_preflight_gates_pairs_and_retries_failures() -> None:
    clock = FakeClock()
    p = Pool("prefill", [A]).workers[0]
    d_ok, d_bad = Pool("decode", [A, B]).workers
    calls: list[tuple[str, str]] = []

    async def check(pw: Worker, dw: Worker) -> None:
        calls.append((pw.url, dw.url))
        if dw is d_bad:
            raise RuntimeError("NIXL link down")

    pf = Preflight(check, timeout=5, retry_after=30, clock=clock)
    assert not pf.usable(p, d_ok)
    usable = await pf.usable_decoders(p, [d_ok, d_bad], limit=5)
    assert usable == [d_ok]
    await asyncio.sleep(0)
    assert pf.state(p, d_bad) is PairState.FAILED and pf.failures == 1
    # checked once: later calls do not re-run passed or recently failed pairs
    assert await pf.usable_decoders(p, [d_ok, d_bad], limit=5) == [d_ok]
    assert sorted(calls) == [(A, A), (A, B)]
    clock.advance(31)
    await pf.usable_decoders(p, [d_ok, d_bad], limit=5)
    await asyncio.sleep(0)
    assert calls.count((A, B)) == 2
    # a worker that leaves is forgotten, and checked again when it comes back
    pf.prune([A], [B])
    assert pf.state(p, d_ok) is PairState.UNKNOWN
    await pf.close()


async def test_preflight_timeout_and_no_check() -> None:
    p = Pool("prefill", [A]).workers[0]
    d = Pool("decode", [B]).workers[0]
    hang = asyncio.Event()

    async def check(pw: Worker, dw: Worker) -> None:
        await hang.wait()

    pf = Preflight(check, timeout=0.01)
    assert await pf.usable_decoders(p, [d], limit=5) == []
    assert pf.state(p, d) is PairState.FAILED
    none = Preflight(None)
    assert none.usable(p, d) and await none.usable_decoders(p, [d], limit=1) == [d]


async def test_preflight_close_cancels_running_checks() -> None:
    p = Pool("prefill", [A]).workers[0]
    d = Pool("decode", [B]).workers[0]
    started = asyncio.Event()
    seen: list[str] = []

    async def check(pw: Worker, dw: Worker) -> None:
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            seen.append("cancelled")  # the check itself was cancelled, not merely abandoned
            raise

    pf = Preflight(check, timeout=60)
    task = pf.start(p, d)
    assert task is not None
    await started.wait()
    # asyncio.wait, not wait_for: its timeout must not do the cancelling for close().
    closing = asyncio.ensure_future(pf.close())
    done, _ = await asyncio.wait([closing], timeout=10)
    if not done:
        task.cancel()
        raise AssertionError("close() did not cancel the running check")
    assert seen == ["cancelled"]
    assert task.cancelled() and pf.state(p, d) is PairState.UNKNOWN
    again = pf.start(p, d)  # the pair is checked again later (its state was forgotten)
    assert again is not None
    again.cancel()


async def test_control_answers_are_read_only_up_to_their_limit(aiohttp_server: Any,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker answering a probe, a scrape or an abort with an endless body: the call fails
    once the limit is passed and no more of it is read (a hostile worker cannot fill memory)."""
    limit = 64 * 1024
    monkeypatch.setattr(health_mod, "PROBE_ANSWER_LIMIT", limit)
    monkeypatch.setattr(health_mod, "METRICS_PAGE_LIMIT", limit)
    monkeypatch.setattr(upstream_mod, "PROBE_ANSWER_LIMIT", limit)
    sent: dict[str, int] = {}
    chunk = b"x" * 16384
    most = 64 * 1024 * 1024

    async def endless(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        await resp.prepare(request)
        sent[request.path] = 0
        try:
            while sent[request.path] < most:  # bounded: 64 MiB
                await resp.write(chunk)
                sent[request.path] += len(chunk)
        except (ConnectionError, RuntimeError):
            pass
        return resp

    async def sized(request: web.Request) -> web.Response:
        return web.Response(body=b"y" * (limit + 1))

    app = web.Application()
    app.router.add_get("/health", endless)
    app.router.add_get("/metrics", endless)
    app.router.add_post("/abort_requests", endless)
    app.router.add_get("/sized", sized)
    server = await aiohttp_server(app, host="127.0.0.1")
    url = f"http://127.0.0.1:{server.port}"
    (worker,) = Pool("decode", [url]).workers
    async with aiohttp.ClientSession() as session:
        assert await http_probe(session, timeout=30)(worker) is False
        with pytest.raises(capped.AnswerTooLarge):
            await http_fetch(session, timeout=30)(worker)
        with pytest.raises(capped.AnswerTooLarge):
            await http_fetch(session, timeout=30, path="/sized")(worker)
        up = upstream_mod.Upstream(session, api_key=None, connect_timeout=5)
        assert await up.abort(url, ["generate-tokens-x"], limit=30) is False
        assert await up.health(url, limit=30) is False
    # Cut off well before the end (the rest stayed in the socket's buffers or was never sent).
    assert sent and all(n < most for n in sent.values())


async def test_read_capped_reads_a_body_at_the_limit_whole(aiohttp_server: Any) -> None:
    async def body(request: web.Request) -> web.Response:
        return web.Response(body=b"z" * int(request.query["n"]))

    app = web.Application()
    app.router.add_get("/b", body)
    server = await aiohttp_server(app, host="127.0.0.1")
    async with aiohttp.ClientSession() as session:
        for n in (0, 1, 1000, 4096):
            async with session.get(f"http://127.0.0.1:{server.port}/b?n={n}") as resp:
                assert await capped.read_capped(resp, 4096) == b"z" * n
