"""Pools integrated into the proxy, against pd-sim workers with faults (all on 127.0.0.1)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import pytest
from aiohttp import web

from proxy.config.settings import ProxySettings
from proxy.fleet.health import HealthChecker, http_probe
from proxy.http.app import build_app
from proxy.pools import PoolSettings
from proxy.pools.breaker import CircuitState
from tests.proxy.conftest import PD
from tests.sse import datas
from workers.sim import SimSettings
from workers.sim import build_app as sim_app

BYPASS = "X-PD-Decode-Only"
PROMPT = [260 + (i * 7) % 200 for i in range(40)]  # 40 tokens: two full KV blocks and a bit


def req(**kw: Any) -> dict[str, Any]:
    sp = {"temperature": 0, "max_tokens": 12}
    sp.update(kw.pop("sp", {}))
    return {"token_ids": kw.pop("token_ids", PROMPT), "sampling_params": sp, **kw}


@dataclass
class Stack(PD):
    """The proxy tests' ``PD`` (client, app, workers, ``gen``); ``stream`` returns the headers."""

    async def stream(self, body: dict[str, Any], **kw: Any) -> tuple[int, list[Any], Any]:
        r = await self.client.post("/inference/v1/generate", json={**body, "stream": True}, **kw)
        raw = await r.read()
        return r.status, datas(raw, comments=True), r.headers

    async def metric(self, name: str, **labels: str) -> float:
        text = (await (await self.client.get("/metrics")).read()).decode()
        for line in text.splitlines():
            if line.startswith((name + "{", name + " ")) and all(
                    f'{k}="{v}"' in line for k, v in labels.items()):
                return float(line.rsplit(" ", 1)[1])
        return 0.0


StackFactory = Callable[..., Awaitable[Stack]]


@pytest.fixture
def stack(sim_factory: Any, aiohttp_client: Any) -> StackFactory:
    async def make(*, n_prefill: int = 2, n_decode: int = 2, prefill: dict[str, Any] | None = None,
                   decode: dict[str, Any] | None = None, pools: dict[str, Any] | None = None,
                   **settings: Any) -> Stack:
        pkw = {"zero_latency": True, **(prefill or {})}
        dkw = {"zero_latency": True, **(decode or {})}
        ps = [await sim_factory(role="prefill", **pkw) for _ in range(n_prefill)]
        ds = [await sim_factory(role="decode", **dkw) for _ in range(n_decode)]
        pool_settings = PoolSettings(**{"active_health": False, "retry_base_delay": 0.0,
                                        "migrate_prefill_tokens": 10**6, **(pools or {})})
        settings.setdefault("kv_block_size", 16)  # pd-sim's block size
        s = ProxySettings(prefill_urls=tuple(w.url for w in ps), decode_urls=tuple(w.url for w in ds),
                          pools=pool_settings, **settings)
        app = build_app(s)
        client = await aiohttp_client(app, server_kwargs={"handler_cancellation": True})
        return Stack(client, app, ps, ds)

    return make


def tokens(events: list[Any]) -> list[int]:
    return [t for e in events if isinstance(e, dict)
            for c in e.get("choices", []) for t in c.get("token_ids", [])]


def text(events: list[Any]) -> str:
    return "".join(c.get("text", "") for e in events if isinstance(e, dict) for c in e.get("choices", []))


async def eventually(check: Callable[[], Awaitable[bool]], limit: float = 5.0) -> None:
    """Poll ``check`` until true (bounded): a condition, never a duration, is asserted."""
    loop = asyncio.get_running_loop()
    end = loop.time() + limit
    while not await check():
        if loop.time() > end:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.02)


async def quiet(st: Stack) -> None:
    async def idle() -> bool:
        states = [await w.state() for w in (*st.prefill, *st.decode)]
        busy = any(s["kv_held"] or s["inflight"] or s["kv_blocks_used"] for s in states)
        return not busy and not len(st.serving.table) and not len(st.serving.tracker)

    await eventually(idle)


async def upstream_counts(st: Stack, pool: str) -> dict[str, float]:
    workers = st.prefill if pool == "prefill" else st.decode
    metric = "pd_proxy_upstream_requests_total"
    return {w.url: await st.metric(metric, pool=pool, worker=w.url) for w in workers}


# ----------------------------------------------------------------------------- policies


async def test_prefix_policy_keeps_a_shared_prefix_on_one_prefill_worker(stack: StackFactory) -> None:
    st = await stack(n_prefill=3, pools={"prefill_policy": "prefix", "prefix_blocks": 2})
    for tail in range(6):
        status, _, headers = await st.gen(req(token_ids=[*PROMPT[:32], 300 + tail, 301]))
        assert status == 200 and BYPASS not in headers
    counts = await upstream_counts(st, "prefill")
    assert sorted(counts.values()) == [0, 0, 6]


async def test_round_robin_and_session_affinity(stack: StackFactory) -> None:
    st = await stack(n_prefill=2, n_decode=3,
                     pools={"prefill_policy": "round_robin", "decode_policy": "session"})
    for _ in range(4):
        assert (await st.gen(req(), headers={"X-Session-ID": "user-7"}))[0] == 200
    assert sorted((await upstream_counts(st, "prefill")).values()) == [2, 2]
    assert sorted((await upstream_counts(st, "decode")).values()) == [0, 0, 4]
    # Rendezvous hashing over the workers' URLs (their ports differ per run): 12 sessions left a
    # worker with none in about 2% of runs (3 x (2/3)^12); with 64, about 1 in 10^11.
    for i in range(64):
        assert (await st.gen(req(), headers={"X-Session-ID": f"user-{i}"}))[0] == 200
    assert all(v > 0 for v in (await upstream_counts(st, "decode")).values())


# ----------------------------------------------------------------------------- retries


async def test_prefill_retry_on_another_worker(stack: StackFactory) -> None:
    st = await stack(n_prefill=2, pools={"prefill_policy": "round_robin"})
    await st.prefill[0].set_faults(fail_next=1, fail_status=503)
    await st.prefill[1].set_faults(fail_next=1, fail_status=503)
    status, body, headers = await st.gen(req())  # first pick fails, the retry also: third attempt ok
    assert status == 200 and body["choices"][0]["token_ids"]
    assert await st.metric("pd_proxy_retries_total", hop="prefill") == 2
    assert BYPASS not in headers
    await quiet(st)


async def test_prefill_4xx_is_not_retried(stack: StackFactory) -> None:
    st = await stack(n_prefill=2, pools={"prefill_policy": "round_robin"})
    await st.prefill[0].set_faults(fail_next=1, fail_status=429)
    status, _, _ = await st.gen(req())
    assert status == 429
    assert await st.metric("pd_proxy_retries_total", hop="prefill") == 0


@pytest.mark.parametrize("stream", [False, True])
async def test_decode_retry_before_first_byte(stack: StackFactory, stream: bool) -> None:
    st = await stack(pools={"decode_policy": "round_robin"})
    expected = tokens((await st.stream(req()))[1])
    await st.decode[0].set_faults(fail_next=1, fail_status=500)
    await st.decode[1].set_faults(fail_next=0)
    for _ in range(2):  # one of the two lands on the failing worker first
        if stream:
            status, events, _ = await st.stream(req())
            assert status == 200 and tokens(events) == expected
            assert events[-1] == "[DONE]"
        else:
            status, body, _ = await st.gen(req())
            assert status == 200 and body["choices"][0]["token_ids"] == expected
    assert await st.metric("pd_proxy_retries_total", hop="decode") == 1
    await quiet(st)


@pytest.mark.parametrize(("stream", "first_token"), [(False, True), (True, False), (True, True)])
async def test_decode_retry_without_the_kv_ends_the_lease_as_unknown(stack: StackFactory,
                                                                    stream: bool, first_token: bool) -> None:
    """Both decode workers fail before their first byte: the retry on the same KV fails too, so
    the third attempt runs decode-only; the lease ends "unknown" (never "pulled"). A stream that
    already has the prefill worker's token has its headers out: no ``X-PD-Decode-Only`` then."""
    st = await stack(prefill={"lease_seconds": 0.5}, pools={"decode_policy": "round_robin",
                                                             "decode_attempts": 3},
                     first_token_from_prefill=first_token)
    expected = tokens((await st.stream(req()))[1])
    for d in st.decode:
        await d.set_faults(fail_next=1, fail_status=500)
    if stream:
        status, events, headers = await st.stream(req())
        assert tokens(events) == expected and events[-1] == "[DONE]"
    else:
        status, body, headers = await st.gen(req())
        assert body["choices"][0]["token_ids"] == expected
    assert status == 200
    assert headers.get(BYPASS) == (None if stream and first_token else "decode_retry")
    assert await st.metric("pd_proxy_retries_total", hop="decode") == 2
    assert await st.metric("pd_proxy_decode_only_total", reason="decode_retry") == 1
    ledger = await (await st.client.get("/debug/kv-leases")).json()
    assert ledger["open"] == []
    assert [c["reason"] for c in ledger["closed"]] == ["unknown", "pulled"]  # newest first
    assert await st.metric("pd_proxy_kv_leases_closed_total", reason="unknown") == 1
    await quiet(st)  # P's own (short) lease frees the blocks nobody pulled


async def test_prefill_unavailable_goes_decode_only_and_503_when_not_allowed(stack: StackFactory) -> None:
    st = await stack(n_prefill=1, pools={"breaker_failures": 1, "prefill_attempts": 1})
    await st.prefill[0].set_faults(fail_next=1, fail_status=500)
    status, _, _ = await st.gen(req())
    assert status == 502  # the one failure opened the circuit...
    status, body, headers = await st.gen(req())
    assert status == 200 and headers[BYPASS] == "prefill_unavailable"  # ...so the next bypasses
    assert await st.metric("pd_proxy_decode_only_total", reason="prefill_unavailable") == 1
    st2 = await stack(n_prefill=1, pools={"breaker_failures": 1, "prefill_attempts": 1,
                                          "bypass_when_prefill_unavailable": False})
    await st2.prefill[0].set_faults(fail_next=1, fail_status=500)
    assert (await st2.gen(req()))[0] == 502
    status, body, headers = await st2.gen(req())
    assert status == 503 and "Retry-After" in headers
    assert body["error"]["type"] == "ServiceUnavailableError"


async def test_a_prefill_retry_with_no_worker_left_goes_decode_only(stack: StackFactory) -> None:
    """Seen in the soak: the timeouts of the requests hung on one prefill worker opened its
    circuit while the other was half-open with its trial running; every retry found no worker
    and the clients got the timeout (504). The request holds nothing: with the bypass allowed,
    the decode worker computes the prompt."""
    st = await stack(n_prefill=1, pools={"breaker_failures": 1, "prefill_attempts": 2})
    await st.prefill[0].set_faults(fail_next=1, fail_status=500)
    status, body, headers = await st.gen(req())
    assert status == 200 and headers[BYPASS] == "prefill_unavailable", body
    assert len(body["choices"][0]["token_ids"]) == 12
    assert await st.metric("pd_proxy_decode_only_total", reason="prefill_unavailable") == 1


@pytest.mark.parametrize("stream", [False, True])
async def test_a_decode_pick_waits_for_a_circuit_about_to_let_requests_in(stack: StackFactory,
                                                                           stream: bool) -> None:
    """P has prefilled (its KV is held): when the only decode worker's circuit is open for a
    moment, the decode hop waits for its trial (bounded by the queue timeout), not a 503."""
    st = await stack(n_prefill=1, n_decode=1, pools={"breaker_failures": 1, "decode_attempts": 1,
                                                     "breaker_open_seconds": 0.3})
    d = st.serving.decode_pool.workers[0]
    d.breaker.record_failure()  # e.g. a connect error: the circuit opens for 0.3 s
    assert not d.admissible
    if stream:
        status, events, headers = await st.stream(req())
        assert status == 200 and events[-1] == "[DONE]"
    else:
        status, body, headers = await st.gen(req())
        assert status == 200 and len(body["choices"][0]["token_ids"]) == 12, body
    assert BYPASS not in headers  # the KV hand-off went through
    assert d.breaker.state is CircuitState.CLOSED  # it was the trial, and closed the circuit


async def test_short_prompt_bypass(stack: StackFactory) -> None:
    st = await stack()  # kv_block_size=16, pd-sim's
    status, _, headers = await st.gen(req(token_ids=PROMPT[:15]))
    assert status == 200 and headers[BYPASS] == "short_prompt"
    assert sum((await upstream_counts(st, "prefill")).values()) == 0
    status, _, headers = await st.gen(req(token_ids=PROMPT[:16]))
    assert status == 200 and BYPASS not in headers
    assert await st.metric("pd_proxy_decode_only_total", reason="short_prompt") == 1


# ----------------------------------------------------------------------------- ejection


async def test_decode_worker_answering_5xx_is_ejected_and_readmitted(stack: StackFactory) -> None:
    # Open for 3 s: long enough that the circuit is still open through the checks below on a
    # loaded machine (at 0.2 s it was sometimes half-open already: a flaky assertion).
    st = await stack(n_decode=2, pools={"decode_policy": "round_robin", "breaker_failures": 2,
                                        "breaker_open_seconds": 3.0, "decode_attempts": 2})
    bad = st.serving.decode_pool.get(st.decode[0].url)
    assert bad is not None
    await st.decode[0].set_faults(fail_next=1000, fail_status=503)
    for _ in range(6):
        assert (await st.gen(req()))[0] == 200  # retried on the good worker every time
    assert int(bad.circuit) == 2  # open
    text = (await (await st.client.get("/metrics")).read()).decode()
    assert f'pd_proxy_circuit_state{{pool="decode",worker="{st.decode[0].url}"}} 2.0' in text
    before = await st.metric("pd_proxy_upstream_requests_total", pool="decode", worker=st.decode[0].url)
    for _ in range(4):
        assert (await st.gen(req()))[0] == 200
    after = await st.metric("pd_proxy_upstream_requests_total", pool="decode", worker=st.decode[0].url)
    assert after == before  # ejected: no traffic while open
    await st.decode[0].set_faults(fail_next=0)

    async def readmitted() -> bool:
        await st.gen(req())
        return int(bad.circuit) == 0

    await eventually(readmitted, limit=20.0)
    await quiet(st)


async def test_preflight_keeps_traffic_off_a_pair_whose_kv_link_fails(stack: StackFactory) -> None:
    """P[1] refuses KV pulls: its pair with the one decode worker fails the preflight (started
    at app start), so prefill picks leave P[1] out; every request still crosses P[0] -> D."""
    st = await stack(n_decode=1, pools={"preflight": True, "prefill_policy": "round_robin",
                                        "preflight_timeout": 5.0})
    await st.prefill[1].set_faults(refuse_kv_pulls=True)
    good, bad = st.serving.prefill_pool.workers
    d = st.serving.decode_pool.workers[0]
    pf = st.serving.pools.preflight
    pf.prune([], [])  # forget the checks run at start (before the fault was set)
    pf.start_all(st.serving.prefill_pool, st.serving.decode_pool)

    async def settled() -> bool:
        return pf.usable(good, d) and pf.all_failed(bad, [d])

    await eventually(settled)
    for _ in range(4):
        status, _, headers = await st.gen(req())
        assert status == 200 and BYPASS not in headers
    counts = await upstream_counts(st, "prefill")
    assert counts == {st.prefill[0].url: 4, st.prefill[1].url: 0}
    ledger = await (await st.client.get("/debug/kv-leases")).json()
    assert [c["reason"] for c in ledger["closed"]] == ["pulled"] * 4
    # Only P[1] left: its KV can reach no decode worker. A request picked while its check still
    # runs waits for it, then runs decode-only (no_usable_pair); once the check has failed, P[1]
    # is left out of prefill picks and the request bypasses the prefill pool (prefill_unavailable).
    st.serving.prefill_pool.remove(good.url)
    pf.prune([], [])
    pf.start_all(st.serving.prefill_pool, st.serving.decode_pool)
    status, _, headers = await st.gen(req())
    assert status == 200 and headers[BYPASS] in ("no_usable_pair", "prefill_unavailable")
    await eventually(lambda: asyncio.sleep(0, pf.all_failed(bad, [d])))
    status, _, headers = await st.gen(req())
    assert status == 200 and headers[BYPASS] == "prefill_unavailable"
    assert await st.metric("pd_proxy_upstream_requests_total", pool="prefill", worker=bad.url) <= 1
    await st.prefill[1].set_faults(refuse_kv_pulls=False)


async def test_a_lone_decode_worker_failing_its_probes_still_serves(stack: StackFactory) -> None:
    """Seen on the loaded real-vLLM stack: /health answered slower than the probe's timeout, the
    only decode worker was probed out and every request got a 503. Now the pool panics: when every
    worker failed its probes it routes as if they had not (the breaker still ejects)."""
    st = await stack(n_prefill=1, n_decode=1)
    st.serving.decode_pool.workers[0].healthy = False  # the probes' verdict
    status, _, headers = await st.gen(req())
    assert status == 200 and BYPASS not in headers
    st.serving.prefill_pool.workers[0].healthy = False  # prefill: the bypass takes over instead
    status, _, headers = await st.gen(req())
    assert status == 200 and headers[BYPASS] == "prefill_unavailable"
    await quiet(st)


async def test_dead_and_hung_workers_are_probed_out_and_back(stack: StackFactory) -> None:
    st = await stack(n_decode=2, pools={"active_health": False, "health_fail_threshold": 2,
                                        "health_recover_threshold": 1})
    hc = HealthChecker(list(st.serving.pools.pools), http_probe(st.serving.upstream.session, 0.5),
                       fail_threshold=2, recover_threshold=1)
    dead = st.serving.decode_pool.get(st.decode[1].url)
    assert dead is not None
    port = st.decode[1].port
    await st.decode[1].close()  # the worker dies
    await hc.probe_once()
    assert dead.healthy
    await hc.probe_once()
    assert not dead.healthy
    for _ in range(3):
        status, _, _ = await st.gen(req())
        assert status == 200
    assert await st.metric("pd_proxy_upstream_requests_total", pool="decode", worker=dead.url) == 0
    # it comes back on the same port
    runner = web.AppRunner(sim_app(SimSettings(role="decode", zero_latency=True)), handler_cancellation=True)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        await hc.probe_once()
        assert dead.healthy
    finally:
        await runner.cleanup()


# ----------------------------------------------------------------------------- migration


def usage_of(events: list[Any]) -> Any:
    return next((e["usage"] for e in events if isinstance(e, dict) and e.get("usage")), None)


@pytest.mark.parametrize("mode", ["tokens", "text"])
@pytest.mark.parametrize("fault", ["reset_after_tokens", "error_after_tokens"])
async def test_migration_mid_stream_has_exact_token_continuity(stack: StackFactory, mode: str,
                                                               fault: str) -> None:
    st = await stack(pools={"decode_policy": "round_robin"})
    body = req(output_mode=mode, sp={"max_tokens": 30, "detokenize": True},
               stream_options={"include_usage": True})
    await st.decode[0].set_faults(**{fault: 7})
    status, events, _ = await st.stream(body)  # round robin: decode[0] first, dies after 7 tokens
    assert status == 200 and events[-1] == "[DONE]"
    assert not any(isinstance(e, dict) and "error" in e for e in events)
    assert await st.metric("pd_proxy_migrations_total") == 1
    await st.decode[0].set_faults(reset=True)
    _, baseline, _ = await st.stream(body)
    assert tokens(events) == tokens(baseline) and len(tokens(events)) == 30
    if mode == "text":
        assert text(events) == text(baseline)
    assert usage_of(events) == usage_of(baseline)
    finishes = [c["finish_reason"] for e in events if isinstance(e, dict) for c in e["choices"]]
    assert finishes.count("length") == 1 and finishes[-1] == "length"
    await quiet(st)


async def test_long_continuation_is_prefilled_through_the_prefill_pool(stack: StackFactory) -> None:
    st = await stack(pools={"decode_policy": "round_robin", "migrate_prefill_tokens": 0})
    body = req(sp={"max_tokens": 30})
    await st.decode[0].set_faults(reset_after_tokens=9)
    status, events, _ = await st.stream(body)
    assert status == 200 and events[-1] == "[DONE]"
    assert await st.metric("pd_proxy_migrations_total") == 1
    assert sum((await upstream_counts(st, "prefill")).values()) == 2  # the request's and the continuation's
    await st.decode[0].set_faults(reset=True)
    _, baseline, _ = await st.stream(body)
    assert tokens(events) == tokens(baseline)
    leases = await (await st.client.get("/debug/kv-leases")).json()
    assert leases["open"] == []
    assert sorted(c["reason"] for c in leases["closed"]) == ["pulled"] * 3  # both runs + the continuation
    await quiet(st)


async def test_no_migration_for_stop_strings_or_when_disabled(stack: StackFactory) -> None:
    st = await stack(pools={"decode_policy": "round_robin", "decode_attempts": 1})
    await st.decode[0].set_faults(reset_after_tokens=3)
    status, events, _ = await st.stream(req(output_mode="text", sp={"max_tokens": 20, "stop": ["zzzz"]}))
    assert status == 200 and any(isinstance(e, dict) and "error" in e for e in events)
    assert await st.metric("pd_proxy_migrations_total") == 0
    st2 = await stack(pools={"decode_policy": "round_robin", "migrate": False})
    await st2.decode[0].set_faults(reset_after_tokens=3)
    status, events, _ = await st2.stream(req(sp={"max_tokens": 20}))
    assert any(isinstance(e, dict) and "error" in e for e in events)


# ----------------------------------------------------------------------------- deadlines, admission


async def test_deadline_expiry_mid_stream_aborts(stack: StackFactory) -> None:
    # 2 s: the prefill hop ends well inside it on a loaded machine (300 ms once ran out before
    # the decode began, in CI); D's 400 tokens at 20 ms take 8 s, so it ends mid-stream.
    st = await stack(n_decode=1, decode={"zero_latency": False, "itl_ms": 20.0})
    status, events, _ = await st.stream(req(sp={"max_tokens": 400}), headers={"X-PD-Deadline-Ms": "2000"})
    assert status == 200 and events[-1] == "[DONE]"
    finishes = [c["finish_reason"] for e in events if isinstance(e, dict) for c in e["choices"]]
    assert finishes[-1] == "abort" and len(tokens(events)) < 400
    assert await st.metric("pd_proxy_aborts_total", source="deadline", state="decoding") == 1
    await quiet(st)


async def test_bad_deadline_header_is_a_400_and_default_applies(stack: StackFactory) -> None:
    st = await stack(n_decode=1, decode={"zero_latency": False, "itl_ms": 20.0},
                     pools={"deadline_default_ms": 200})
    status, body, _ = await st.gen(req(), headers={"X-PD-Deadline-Ms": "soon"})
    assert status == 400 and body["error"]["param"] == "X-PD-Deadline-Ms"
    status, body, _ = await st.gen(req(sp={"max_tokens": 400}))
    assert status == 200 and body["choices"][0]["finish_reason"] == "abort"


async def test_queue_overflow_and_queue_timeout_get_429_with_retry_after(stack: StackFactory) -> None:
    st = await stack(n_decode=1, decode={"zero_latency": False, "itl_ms": 50.0},
                     pools={"max_inflight": 1, "max_queue": 1, "queue_timeout": 30})
    first = asyncio.create_task(st.stream(req(sp={"max_tokens": 400})))
    await eventually(lambda: asyncio.sleep(0, len(st.serving.table) == 1))
    queued = asyncio.create_task(st.gen(req(sp={"max_tokens": 2}), headers={"X-PD-Deadline-Ms": "100000"}))
    await eventually(lambda: asyncio.sleep(0, len(st.serving.pools.admission.queue) == 1))
    status, body, headers = await st.gen(req())
    assert status == 429 and headers["Retry-After"] == "1"
    assert body["error"]["type"] == "TooManyRequestsError" and body["error"]["code"] == 429
    assert await st.metric("pd_proxy_queue_rejections_total") == 1
    assert await st.metric("pd_proxy_requests_total", outcome="rejected") == 1
    first.cancel()  # the client of the first request goes away: the queued one goes in
    with pytest.raises(asyncio.CancelledError):
        await first
    assert (await queued)[0] == 200
    # a wait longer than the request's deadline ends in a 429 too
    hold = asyncio.create_task(st.stream(req(sp={"max_tokens": 400})))
    await eventually(lambda: asyncio.sleep(0, len(st.serving.table) == 1))
    status, _, headers = await st.gen(req(), headers={"X-PD-Deadline-Ms": "50"})
    assert status == 429 and "Retry-After" in headers
    hold.cancel()
    with pytest.raises(asyncio.CancelledError):
        await hold
    await quiet(st)


async def test_hung_workers_time_out_and_the_hop_is_retried(stack: StackFactory) -> None:
    st = await stack(pools={"prefill_policy": "round_robin", "decode_policy": "round_robin"},
                     prefill_timeout=0.5, stream_idle_timeout=0.5)
    await st.prefill[0].set_faults(hang_before_headers=True)
    await st.decode[0].set_faults(hang_before_headers=True)
    status, events, _ = await st.stream(req())
    assert status == 200 and events[-1] == "[DONE]" and len(tokens(events)) == 12
    assert await st.metric("pd_proxy_retries_total", hop="prefill") == 1
    assert await st.metric("pd_proxy_retries_total", hop="decode") == 1


async def test_client_gone_while_queued_or_between_prefill_attempts(stack: StackFactory) -> None:
    st = await stack(n_decode=1, decode={"zero_latency": False, "itl_ms": 50.0},
                     pools={"max_inflight": 1, "max_queue": 4, "queue_timeout": 30,
                            "retry_base_delay": 5.0, "retry_max_delay": 5.0})
    hold = asyncio.create_task(st.stream(req(sp={"max_tokens": 400})))
    await eventually(lambda: asyncio.sleep(0, len(st.serving.table) == 1))
    waiting = asyncio.create_task(st.gen(req()))
    await eventually(lambda: asyncio.sleep(0, len(st.serving.pools.admission.queue) == 1))
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    await eventually(lambda: asyncio.sleep(0, len(st.serving.pools.admission.queue) == 0))
    hold.cancel()
    with pytest.raises(asyncio.CancelledError):
        await hold
    await quiet(st)
    assert st.serving.pools.admission.inflight == 0
    # the client leaves during the backoff between two prefill attempts: nothing is held
    await st.prefill[0].set_faults(fail_next=1, fail_status=503)
    await st.prefill[1].set_faults(fail_next=1, fail_status=503)
    gone = asyncio.create_task(st.gen(req()))
    await eventually(lambda: _retried(st))
    gone.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gone
    await quiet(st)
    assert all(w.inflight == 0 for w in (*st.serving.prefill_pool, *st.serving.decode_pool))
    assert st.serving.pools.admission.inflight == 0


async def _retried(st: Stack) -> bool:
    return await st.metric("pd_proxy_retries_total", hop="prefill") >= 1


async def test_admin_api_and_workers_file_through_the_app(stack: StackFactory, tmp_path: Any,
                                                          sim_factory: Any) -> None:
    extra = await sim_factory(role="decode", zero_latency=True)
    cfg = tmp_path / "workers.toml"
    cfg.write_text(f'[pools.decode]\nworkers = ["{extra.url}"]\n')
    st = await stack(n_decode=1,
                     pools={"admin_key": "adm", "config_file": cfg, "decode_policy": "round_robin"})
    urls = {w.url for w in st.serving.decode_pool}
    assert urls == {st.decode[0].url, extra.url}
    r = await st.client.get("/admin/workers")
    assert r.status == 401
    r = await st.client.post("/admin/workers/drain", json={"pool": "decode", "url": st.decode[0].url},
                             headers={"Authorization": "Bearer adm"})
    assert r.status == 200
    for _ in range(3):
        assert (await st.gen(req()))[0] == 200
    assert await st.metric("pd_proxy_upstream_requests_total", pool="decode", worker=st.decode[0].url) == 0
    assert await st.metric("pd_proxy_upstream_requests_total", pool="decode", worker=extra.url) == 3
    r = await st.client.get("/health", headers={"Authorization": "Bearer adm"})  # URLs: admin only
    body = await r.json()
    drained = next(w for w in body["pools"]["decode"] if w["url"] == st.decode[0].url)
    assert drained["draining"] is True and drained["admitted"] is False


# ----------------------------------------------------------------------------- blame


async def test_a_prefill_worker_refusing_kv_pulls_is_blamed_not_the_decode_workers(
        stack: StackFactory) -> None:
    """P[1] refuses KV pulls: the decode workers answer 5xx for its KV. That is ambiguous on one
    decode worker; when a second one fails on the same KV, P[1] takes the failure. No decode
    circuit opens (they used to, and every request got a 503); P[1]'s does, and from then on
    every request crosses the healthy pair. A request whose KV no decode worker could use gets
    one last decode-only attempt (an answer, not a 502). (Streams: the next test.)"""
    st = await stack(prefill={"lease_seconds": 2.0},
                     pools={"prefill_policy": "round_robin", "decode_policy": "round_robin",
                            "breaker_failures": 2, "breaker_open_seconds": 60.0})
    await st.prefill[1].set_faults(refuse_kv_pulls=True)
    good, bad = st.serving.prefill_pool.workers
    bypassed: list[str | None] = []
    for _ in range(8):
        status, body, headers = await st.gen(req())
        assert status == 200 and len(body["choices"][0]["token_ids"]) == 12
        bypassed.append(headers.get(BYPASS))
    assert [int(d.circuit) for d in st.serving.decode_pool.workers] == [0, 0]  # closed
    assert int(bad.circuit) == 2 and int(good.circuit) == 0  # P[1] open
    # P[1]'s two requests went decode-only in the end; every other crossed the healthy pair
    assert bypassed.count("decode_retry") == 2 and bypassed.count(None) == 6
    assert bypassed[-4:] == [None] * 4
    assert await st.metric("pd_proxy_upstream_requests_total", pool="prefill", worker=bad.url) == 2
    await st.prefill[1].set_faults(refuse_kv_pulls=False)


async def test_streams_on_a_prefill_worker_refusing_kv_pulls_blame_it_and_complete(
        stack: StackFactory) -> None:
    """The same on streams: D sends its headers, then (the pull refused) an error event before
    any token. With P's KV that is as ambiguous as a 5xx before the first byte: the same KV goes
    to the other decode worker, the second failure counts on P[1], and the client's stream goes on
    decode-only with every token and no error event. No decode circuit opens."""
    st = await stack(prefill={"lease_seconds": 2.0},
                     pools={"prefill_policy": "round_robin", "decode_policy": "round_robin",
                            "breaker_failures": 2, "breaker_open_seconds": 60.0})
    _, want, _ = await st.stream(req())  # a clean run: the tokens every stream must carry
    assert want[-1] == "[DONE]" and len(tokens(want)) == 12
    await st.prefill[1].set_faults(refuse_kv_pulls=True)
    good, bad = st.serving.prefill_pool.workers
    for _ in range(8):
        status, events, _ = await st.stream(req())
        assert status == 200 and events[-1] == "[DONE]"
        assert not any(isinstance(e, dict) and "error" in e for e in events)
        assert tokens(events) == tokens(want)
    assert [int(d.circuit) for d in st.serving.decode_pool.workers] == [0, 0]  # closed
    assert int(bad.circuit) == 2 and int(good.circuit) == 0  # P[1] open
    assert await st.metric("pd_proxy_upstream_requests_total", pool="prefill", worker=bad.url) == 2
    # each of P[1]'s two requests: its KV to both decode workers, then decode-only
    assert await st.metric("pd_proxy_decode_only_total", reason="decode_retry") == 2
    errors = [await st.metric("pd_proxy_upstream_errors_total", pool="decode", worker=d.url,
                              error="error_event") for d in st.decode]
    assert errors == [2, 2]
    await st.prefill[1].set_faults(refuse_kv_pulls=False)
    await quiet(st)


async def test_with_one_decode_worker_a_prefill_worker_refusing_kv_pulls_takes_the_blame(
        stack: StackFactory) -> None:
    """One decode worker: nothing can tell its fault from P's, and opening its circuit would stop
    all traffic. P[1] takes the failures (its circuit opens); the decode circuit stays closed and
    every later request crosses P[0] -> D with its KV."""
    st = await stack(n_decode=1, prefill={"lease_seconds": 2.0},
                     pools={"prefill_policy": "round_robin", "breaker_failures": 2,
                            "breaker_open_seconds": 60.0})
    await st.prefill[1].set_faults(refuse_kv_pulls=True)
    good, bad = st.serving.prefill_pool.workers
    d = st.serving.decode_pool.workers[0]
    for _ in range(6):
        status, events, _ = await st.stream(req())
        assert status == 200 and events[-1] == "[DONE]" and len(tokens(events)) == 12
    assert int(d.circuit) == 0 and int(bad.circuit) == 2 and int(good.circuit) == 0
    for _ in range(3):
        status, _, headers = await st.gen(req())
        assert status == 200 and BYPASS not in headers
    await st.prefill[1].set_faults(refuse_kv_pulls=False)
    await quiet(st)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_decode_worker_failing_kv_hops_is_still_blamed(stack: StackFactory, stream: bool) -> None:
    """D[0] answers 5xx (its own fault) on hops with KV: ambiguous, but D[1] then serves the same
    KV, so the failure lands on D[0] (its circuit opens), never on the prefill worker."""
    st = await stack(n_prefill=1, pools={"decode_policy": "round_robin", "breaker_failures": 2,
                                         "breaker_open_seconds": 60.0})
    await st.decode[0].set_faults(fail_next=10, fail_status=500)
    for _ in range(4):
        if stream:
            status, events, headers = await st.stream(req())
            assert events[-1] == "[DONE]"
        else:
            status, _, headers = await st.gen(req())
        assert status == 200 and BYPASS not in headers
    bad = st.serving.decode_pool.get(st.decode[0].url)
    assert bad is not None and int(bad.circuit) == 2
    assert int(st.serving.prefill_pool.workers[0].circuit) == 0
    await st.decode[0].set_faults(fail_next=0)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_prefill_reply_without_kv_params_is_retried_on_another_prefill_worker(
        stack: StackFactory, stream: bool) -> None:
    """P[1] answers 200 without kv_transfer_params: the request goes to P[0] (a prefill retry,
    a failure on P[1]'s breaker) instead of a 502."""
    st = await stack(pools={"prefill_policy": "round_robin", "breaker_failures": 2,
                            "breaker_open_seconds": 60.0})
    await st.prefill[1].set_faults(drop_kv_params=True)
    _, bad = st.serving.prefill_pool.workers
    for _ in range(6):
        if stream:
            status, events, headers = await st.stream(req())
            assert events[-1] == "[DONE]"
        else:
            status, _, headers = await st.gen(req())
        assert status == 200 and BYPASS not in headers
    bad_calls = await st.metric("pd_proxy_upstream_requests_total", pool="prefill", worker=bad.url)
    assert bad_calls == 2  # then its circuit opened
    assert await st.metric("pd_proxy_retries_total", hop="prefill") == bad_calls
    assert int(bad.circuit) == 2
    await st.prefill[1].set_faults(drop_kv_params=False)


@pytest.mark.parametrize("bypass", [True, False])
async def test_an_unusable_prefill_reply_with_no_other_worker(stack: StackFactory, bypass: bool) -> None:
    """The one prefill worker drops its KV params: nothing to retry on. With the bypass allowed
    (the default) the decode worker computes the prompt, as when no prefill worker is available
    (its circuit would open after a few such failures and send requests there anyway); without
    it, --prefill-failure fail answers 502. Either way after one prefill call, not one per attempt."""
    st = await stack(n_prefill=1, pools={"prefill_attempts": 3, "bypass_when_prefill_unavailable": bypass})
    await st.prefill[0].set_faults(drop_kv_params=True)
    status, body, headers = await st.gen(req())
    if bypass:
        assert status == 200 and headers[BYPASS] == "prefill_unavailable"
        assert len(body["choices"][0]["token_ids"]) == 12
    else:
        assert status == 502
    assert await st.metric("pd_proxy_upstream_requests_total", pool="prefill",
                           worker=st.prefill[0].url) == 1
    assert await st.metric("pd_proxy_retries_total", hop="prefill") == 0
    assert await st.metric("pd_proxy_prefill_missing_kv_params_total") == 1
    await st.prefill[0].set_faults(drop_kv_params=False)
