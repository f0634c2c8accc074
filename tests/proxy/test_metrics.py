"""The agreed metric names, per-app registries, and the timing contract pd-bench relies on."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from proxy import __version__
from proxy.observe.metrics import ProxyMetrics
from proxy.pools import PoolSettings
from tests.proxy.conftest import PD, PDFactory, ProxyFactory, req
from tests.proxy.scripted import KV_PARAMS, Scripted, ScriptedFactory, SSEBytes, prefill_reply
from tests.proxy.test_aborts import SLOW_DECODE, _disconnect_when, abort, wait_for_state
from workers.sim import SimSettings
from workers.sim import build_app as sim_app

AGREED = [
    "pd_proxy_requests", "pd_proxy_ttft_seconds", "pd_proxy_itl_seconds", "pd_proxy_tpot_seconds",
    "pd_proxy_e2e_seconds", "pd_proxy_stage_seconds", "pd_proxy_upstream_requests",
    "pd_proxy_upstream_errors", "pd_proxy_inflight_requests", "pd_proxy_worker_healthy", "pd_proxy_aborts",
    "pd_proxy_abort_fanout", "pd_proxy_kv_leases_open", "pd_proxy_kv_lease_duration_seconds",
    "pd_proxy_kv_leases_closed", "pd_proxy_prefill_missing_kv_params", "pd_proxy_decode_only",
    "pd_proxy_build_info", "pd_proxy_suspect_no_transfer",
    # the pools' (proxy.fleet.runtime.PoolMetrics)
    "pd_proxy_circuit_state", "pd_proxy_retries", "pd_proxy_migrations", "pd_proxy_queue_rejections",
]
TIMING = re.compile(r"^queue;dur=[0-9.]+, prefill;dur=[0-9.]+, handoff;dur=[0-9.]+, "
                    r"decode_ttft;dur=[0-9.]+, total;dur=[0-9.]+$")


async def test_metrics_after_traffic(pd_factory: PDFactory) -> None:
    pd = await pd_factory()
    status, _, headers = await pd.gen(req())
    assert status == 200 and TIMING.match(headers["Server-Timing"])
    await pd.stream(req())
    text = await (await pd.client.get("/metrics")).text()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in AGREED:
        assert name in families, name
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in families.values() for s in f.samples}
    assert samples[("pd_proxy_requests_total", (("outcome", "ok"),))] == 2
    assert samples[("pd_proxy_kv_leases_closed_total", (("reason", "pulled"),))] == 2
    assert samples[("pd_proxy_kv_leases_open", ())] == 0
    assert samples[("pd_proxy_ttft_seconds_count", ())] == 2
    assert samples[("pd_proxy_stage_seconds_count", (("stage", "prefill"),))] == 2


def test_every_stage_and_outcome_is_a_series_from_the_start() -> None:
    text = ProxyMetrics().render().decode()
    for stage in ("queue", "prefill", "handoff", "decode_first_token", "first_to_second", "decode_stream"):
        assert f'pd_proxy_stage_seconds_count{{stage="{stage}"}} 0.0' in text
    outcomes = ("ok", "client_error", "upstream_error", "aborted", "timeout", "rejected", "internal_error")
    for outcome in outcomes:
        assert f'pd_proxy_requests_total{{outcome="{outcome}"}} 0.0' in text


def test_registries_are_per_app() -> None:
    a, b = ProxyMetrics(), ProxyMetrics()
    a.requests.labels(outcome="ok").inc()
    assert b'pd_proxy_requests_total{outcome="ok"} 1.0' in a.render()
    assert b'pd_proxy_requests_total{outcome="ok"} 0.0' in b.render()


# ------------------------------------------------------------------ values after scripted traffic


async def scrape(pd: PD) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = await (await pd.client.get("/metrics")).text()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def val(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


async def test_successes_count_upstream_calls_health_and_tpot(pd_factory: PDFactory) -> None:
    pd = await pd_factory(pools=PoolSettings.plain(active_health=True, health_interval=0.05,
                                                   health_fail_threshold=1))
    s = await scrape(pd)
    assert val(s, "pd_proxy_worker_healthy", pool="prefill", worker=pd.p.url) == 1
    assert val(s, "pd_proxy_build_info", version=__version__) == 1
    for _ in range(2):
        assert (await pd.gen(req()))[0] == 200
    # A stream without include_usage gives no token count: no TPOT sample from it.
    await pd.stream(req())
    s = await scrape(pd)
    assert val(s, "pd_proxy_tpot_seconds_count") == 2
    await pd.stream(req(stream_options={"include_usage": True}))
    s = await scrape(pd)
    assert val(s, "pd_proxy_requests_total", outcome="ok") == 4
    assert val(s, "pd_proxy_upstream_requests_total", pool="prefill", worker=pd.p.url) == 4
    assert val(s, "pd_proxy_upstream_requests_total", pool="decode", worker=pd.d.url) == 4
    assert val(s, "pd_proxy_tpot_seconds_count") == 3
    assert val(s, "pd_proxy_inflight_requests", pool="prefill") == 0
    assert val(s, "pd_proxy_inflight_requests", pool="decode") == 0
    assert val(s, "pd_proxy_e2e_seconds_count") == 4
    # pd-sim reports no cached tokens and P advertised blocks: nothing suspect.
    assert val(s, "pd_proxy_suspect_no_transfer_total") == 0
    await pd.p.close()
    for _ in range(400):  # bounded (20 s): /health shows the active probes' last verdict
        if (await pd.client.get("/health")).status == 503:
            break
        await asyncio.sleep(0.05)
    assert (await pd.client.get("/health")).status == 503
    s = await scrape(pd)
    assert val(s, "pd_proxy_worker_healthy", pool="prefill", worker=pd.p.url) == 0
    assert val(s, "pd_proxy_worker_healthy", pool="decode", worker=pd.d.url) == 1


async def test_validation_error_touches_no_worker(pd_factory: PDFactory) -> None:
    pd = await pd_factory()
    status, _, _ = await pd.gen({"token_ids": [], "sampling_params": {}})
    assert status == 400
    s = await scrape(pd)
    assert val(s, "pd_proxy_requests_total", outcome="client_error") == 1
    assert val(s, "pd_proxy_requests_total", outcome="ok") == 0
    assert val(s, "pd_proxy_upstream_requests_total", pool="prefill", worker=pd.p.url) == 0


async def test_upstream_5xx_is_classed(pd_factory: PDFactory) -> None:
    pd = await pd_factory(prefill={"lease_seconds": 0.5})
    await pd.d.set_faults(fail_next=1, fail_status=503)
    status, _, _ = await pd.gen(req())
    assert status == 502
    s = await scrape(pd)
    assert val(s, "pd_proxy_requests_total", outcome="upstream_error") == 1
    assert val(s, "pd_proxy_upstream_errors_total", pool="decode", worker=pd.d.url, error="http_5xx") == 1
    assert val(s, "pd_proxy_upstream_errors_total", pool="prefill", worker=pd.p.url, error="http_5xx") == 0
    await pd.p.set_faults(fail_next=1, fail_status=400)
    assert (await pd.gen(req()))[0] == 400
    s = await scrape(pd)
    assert val(s, "pd_proxy_upstream_errors_total", pool="prefill", worker=pd.p.url, error="http_4xx") == 1
    assert val(s, "pd_proxy_requests_total", outcome="client_error") == 1


async def test_unreachable_worker_is_a_connect_error(pd_factory: PDFactory) -> None:
    pd = await pd_factory()
    url = pd.p.url
    await pd.p.close()
    assert (await pd.gen(req()))[0] == 502
    s = await scrape(pd)
    assert val(s, "pd_proxy_upstream_errors_total", pool="prefill", worker=url, error="connect") == 1


@pytest.mark.parametrize("policy", ["fail", "decode-only"])
async def test_prefill_without_kv_params(pd_factory: PDFactory, policy: str) -> None:
    pd = await pd_factory(prefill_failure_policy=policy, prefill={"lease_seconds": 0.3})
    await pd.p.set_faults(drop_kv_params=True)
    status, _, _ = await pd.gen(req())
    s = await scrape(pd)
    assert val(s, "pd_proxy_prefill_missing_kv_params_total") == 1
    assert val(s, "pd_proxy_upstream_errors_total", pool="prefill", worker=pd.p.url, error="protocol") == 0
    if policy == "fail":
        assert status == 502
        assert val(s, "pd_proxy_requests_total", outcome="upstream_error") == 1
        assert val(s, "pd_proxy_decode_only_total", reason="missing_kv_params") == 0
        assert val(s, "pd_proxy_upstream_requests_total", pool="decode", worker=pd.d.url) == 0
    else:
        assert status == 200
        assert val(s, "pd_proxy_requests_total", outcome="ok") == 1
        assert val(s, "pd_proxy_decode_only_total", reason="missing_kv_params") == 1
        assert val(s, "pd_proxy_upstream_requests_total", pool="decode", worker=pd.d.url) == 1
        assert val(s, "pd_proxy_suspect_no_transfer_total") == 0  # a known bypass is not "silent"
    await pd.p.set_faults(drop_kv_params=False)


async def test_abort_counts_and_fanout(pd_factory: PDFactory) -> None:
    pd = await pd_factory(decode=SLOW_DECODE)
    task = asyncio.create_task(pd.client.post(
        "/inference/v1/generate", json=req(request_id="ab", sp={"max_tokens": 300, "ignore_eos": True})))
    await wait_for_state(pd, "decoding")
    assert await abort(pd, "generate-tokens-ab") == 200
    r = await asyncio.wait_for(task, 5)
    assert r.status == 200
    await pd.quiet(limit=2.0)
    s = await scrape(pd)
    assert val(s, "pd_proxy_aborts_total", source="client_call", state="decoding") == 1
    assert val(s, "pd_proxy_requests_total", outcome="aborted") == 1
    assert val(s, "pd_proxy_requests_total", outcome="ok") == 0
    assert val(s, "pd_proxy_abort_fanout_total", pool="decode", result="ok") >= 1
    assert val(s, "pd_proxy_abort_fanout_total", pool="decode", result="error") == 0
    assert val(s, "pd_proxy_inflight_requests", pool="decode") == 0


async def test_disconnect_counts(pd_factory: PDFactory) -> None:
    pd = await pd_factory(decode=SLOW_DECODE)
    body = {**req(request_id="dc", sp={"max_tokens": 300, "ignore_eos": True}), "stream": True}
    await _disconnect_when(pd, "decoding", body, after_bytes=1)
    await pd.quiet(limit=2.0)
    s = await scrape(pd)
    assert val(s, "pd_proxy_aborts_total", source="disconnect", state="decoding") == 1
    assert val(s, "pd_proxy_requests_total", outcome="aborted") == 1
    assert val(s, "pd_proxy_abort_fanout_total", pool="decode", result="ok") >= 1
    assert val(s, "pd_proxy_inflight_requests", pool="decode") == 0
    assert val(s, "pd_proxy_kv_leases_open") == 0


def _decode_reply(body: dict[str, Any], details: dict[str, Any] | None) -> dict[str, Any]:
    reply = prefill_reply(body, kv_transfer_params=None)
    reply["usage"]["prompt_tokens_details"] = details
    reply["choices"][0]["finish_reason"] = "length"
    return reply


@pytest.mark.parametrize(("blocks", "details", "suspect"), [
    ([[]], None, 1),                      # P advertised no blocks
    ([[1]], {"cached_tokens": 0}, 1),     # D says nothing came from cache/transfer
    ([[1]], {"cached_tokens": 128}, 0),
    ([[1]], None, 0),
])
async def test_suspect_no_transfer(scripted_factory: ScriptedFactory, proxy_factory: ProxyFactory,
                                   blocks: list[list[int]], details: dict[str, Any] | None,
                                   suspect: int) -> None:
    kv = {**KV_PARAMS, "remote_block_ids": blocks}
    p: Scripted = await scripted_factory(lambda b, r: prefill_reply(b, kv))
    d: Scripted = await scripted_factory(lambda b, r: _decode_reply(b, details))
    client, _ = await proxy_factory([p.url], [d.url], kv_block_size=128)  # the CPU build's block
    for prompt_len, expected in ((127, 0), (128, suspect)):
        r = await client.post("/inference/v1/generate", json=req(token_ids=list(range(1, prompt_len + 1))))
        assert r.status == 200
        text = await (await client.get("/metrics")).text()
        assert f"pd_proxy_suspect_no_transfer_total {float(expected)}" in text


async def test_kv_block_size_is_a_setting(scripted_factory: ScriptedFactory,
                                          proxy_factory: ProxyFactory) -> None:
    kv = {**KV_PARAMS, "remote_block_ids": [[]]}
    p: Scripted = await scripted_factory(lambda b, r: prefill_reply(b, kv))
    d: Scripted = await scripted_factory(lambda b, r: _decode_reply(b, None))
    client, _ = await proxy_factory([p.url], [d.url], kv_block_size=16)
    r = await client.post("/inference/v1/generate", json=req(token_ids=list(range(1, 17))))
    assert r.status == 200
    assert "pd_proxy_suspect_no_transfer_total 1.0" in await (await client.get("/metrics")).text()


async def test_stream_without_done_is_a_protocol_error(scripted_factory: ScriptedFactory,
                                                       proxy_factory: ProxyFactory) -> None:
    chunk = b'data: {"request_id":"generate-tokens-x","usage":null,"output_mode":"tokens","choices":' \
            b'[{"index":0,"finish_reason":null,"stop_reason":null,"token_ids":[7],"logprobs":null}]}\n\n'
    p: Scripted = await scripted_factory(lambda b, r: prefill_reply(b))  # P's token is 7 too
    d: Scripted = await scripted_factory(lambda b, r: SSEBytes([chunk, b"data: {\"trunc"]))
    client, _ = await proxy_factory([p.url], [d.url])
    r = await client.post("/inference/v1/generate", json={**req(), "stream": True})
    assert b"stream ended without [DONE]" in await r.read()
    text = await (await client.get("/metrics")).text()
    assert f'pd_proxy_upstream_errors_total{{error="protocol",pool="decode",worker="{d.url}"}} 1.0' in text
    assert f'pd_proxy_upstream_requests_total{{pool="decode",worker="{d.url}"}} 1.0' in text


# ------------------------------------------------------------------ the pools' metrics (issue 7)

LONG = list(range(300, 340))  # 40 tokens: above pd-sim's 16-token block (no short-prompt bypass)


async def eventually(check: Any, limit: float = 5.0) -> None:
    """Poll the async ``check`` until true (bounded): a condition, never a duration, is asserted."""
    loop = asyncio.get_running_loop()
    end = loop.time() + limit
    while not await check():
        assert loop.time() < end, "condition not reached in time"
        await asyncio.sleep(0.02)


async def test_circuit_state_opens_after_failures(pd_factory: PDFactory) -> None:
    pd = await pd_factory(n_decode=2, pools=PoolSettings.plain(
        breaker_failures=1, breaker_open_seconds=60.0, decode_policy="round_robin"))
    s = await scrape(pd)
    assert [val(s, "pd_proxy_circuit_state", pool="decode", worker=d.url) for d in pd.decode] == [0, 0]
    await pd.decode[0].set_faults(fail_next=1, fail_status=503)
    await pd.decode[1].set_faults(fail_next=1, fail_status=503)
    assert (await pd.gen(req()))[0] == 502  # no decode retry in the bare walk: one worker fails
    s = await scrape(pd)
    # A 5xx on a hop with P's KV that no retry settles counts on P (proxy/pools/README.md,
    # Attribution): P's circuit opens (2), the decode workers' stay closed.
    assert val(s, "pd_proxy_circuit_state", pool="prefill", worker=pd.p.url) == 2
    assert [val(s, "pd_proxy_circuit_state", pool="decode", worker=d.url) for d in pd.decode] == [0, 0]
    assert (await pd.gen(req()))[0] == 503  # no prefill worker admitted while its circuit is open


async def test_retries_by_hop_single_workers(pd_factory: PDFactory) -> None:
    pd = await pd_factory(pools=PoolSettings.plain(prefill_attempts=2, decode_attempts=2,
                                                   retry_base_delay=0.0))
    await pd.p.set_faults(fail_next=1, fail_status=500)
    assert (await pd.gen(req()))[0] == 200  # retried on the one prefill worker
    s = await scrape(pd)
    assert val(s, "pd_proxy_retries_total", hop="prefill") == 1
    assert val(s, "pd_proxy_retries_total", hop="decode") == 0
    await pd.d.set_faults(fail_next=1, fail_status=500)
    assert (await pd.stream(req()))[0] == 200  # retried on the one decode worker
    s = await scrape(pd)
    assert val(s, "pd_proxy_retries_total", hop="decode") == 1
    assert val(s, "pd_proxy_upstream_errors_total", pool="prefill", worker=pd.p.url, error="http_5xx") == 1
    assert val(s, "pd_proxy_upstream_errors_total", pool="decode", worker=pd.d.url, error="http_5xx") == 1
    assert val(s, "pd_proxy_requests_total", outcome="ok") == 2
    await pd.quiet()


@pytest.mark.parametrize("fault", ["error_after_tokens", "reset_after_tokens"])
async def test_migration_and_in_band_error_event_are_counted(pd_factory: PDFactory, fault: str) -> None:
    pd = await pd_factory(n_decode=2, kv_block_size=16,
                          pools=PoolSettings.plain(migrate=True, decode_policy="round_robin"))
    expected = [t for e in (await pd.stream(req(token_ids=LONG, sp={"max_tokens": 12})))[1]
                if isinstance(e, dict) for c in e["choices"] for t in c["token_ids"]]
    await pd.decode[1].set_faults(**{fault: 4})  # round robin: the next stream goes to decode[1]
    status, events, _ = await pd.stream(req(token_ids=LONG, sp={"max_tokens": 12}))
    got = [t for e in events if isinstance(e, dict) for c in e.get("choices", []) for t in c["token_ids"]]
    assert status == 200 and got == expected and events[-1] == "[DONE]"
    assert not any(isinstance(e, dict) and "error" in e for e in events)
    s = await scrape(pd)
    assert val(s, "pd_proxy_migrations_total") == 1
    error = "error_event" if fault == "error_after_tokens" else "connect"
    assert val(s, "pd_proxy_upstream_errors_total", pool="decode", worker=pd.decode[1].url, error=error) == 1
    assert val(s, "pd_proxy_requests_total", outcome="ok") == 2
    await pd.decode[1].set_faults(**{fault: None})
    await pd.quiet()


async def test_in_band_error_event_without_migration_is_counted(pd_factory: PDFactory) -> None:
    pd = await pd_factory()
    await pd.d.set_faults(error_after_tokens=3)
    status, events, _ = await pd.stream(req(sp={"max_tokens": 10}))
    assert status == 200 and any(isinstance(e, dict) and "error" in e for e in events)
    s = await scrape(pd)
    assert val(s, "pd_proxy_upstream_errors_total", pool="decode", worker=pd.d.url, error="error_event") == 1
    assert val(s, "pd_proxy_migrations_total") == 0
    await pd.d.set_faults(error_after_tokens=None)
    await pd.quiet()


async def test_queue_rejections(pd_factory: PDFactory) -> None:
    pd = await pd_factory(decode=SLOW_DECODE, pools=PoolSettings.plain(max_inflight=1, max_queue=0))
    body = {**req(request_id="long", sp={"max_tokens": 300, "ignore_eos": True}), "stream": True}
    task = asyncio.create_task(pd.client.post("/inference/v1/generate", json=body))
    await wait_for_state(pd, "decoding")
    status, payload, headers = await pd.gen(req())
    assert status == 429 and "Retry-After" in headers
    assert payload["error"]["code"] == 429
    s = await scrape(pd)
    assert val(s, "pd_proxy_queue_rejections_total") == 1
    assert val(s, "pd_proxy_requests_total", outcome="rejected") == 1
    assert await abort(pd, "generate-tokens-long") == 200
    r = await asyncio.wait_for(task, 5)
    await r.read()
    await pd.quiet(limit=2.0)


async def test_worker_healthy_follows_the_active_probes(pd_factory: PDFactory) -> None:
    pd = await pd_factory(n_decode=2, pools=PoolSettings.plain(
        active_health=True, health_interval=0.05, health_timeout=0.5, health_fail_threshold=2,
        health_recover_threshold=1))
    victim = pd.decode[1]

    async def healthy(value: float) -> bool:
        s = await scrape(pd)  # /metrics only: GET /health is never called here
        return val(s, "pd_proxy_worker_healthy", pool="decode", worker=victim.url) == value

    assert await healthy(1)
    await victim.close()  # the worker dies
    await eventually(lambda: healthy(0))
    s = await scrape(pd)
    assert val(s, "pd_proxy_worker_healthy", pool="decode", worker=pd.decode[0].url) == 1
    for _ in range(3):  # the probed-out worker gets no traffic
        assert (await pd.gen(req()))[0] == 200
    s = await scrape(pd)
    assert val(s, "pd_proxy_upstream_requests_total", pool="decode", worker=victim.url) == 0
    runner = web.AppRunner(sim_app(SimSettings(role="decode", zero_latency=True)))
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", victim.port).start()  # back on the same port
    try:
        await eventually(lambda: healthy(1))
    finally:
        await runner.cleanup()


# ------------------------------------------------------------------ histogram buckets


def finite_buckets(text: str, name: str) -> list[float]:
    return sorted({float(s.labels["le"]) for f in text_string_to_metric_families(text) for s in f.samples
                   if s.name == f"{name}_bucket" and s.labels["le"] != "+Inf"})


@pytest.mark.parametrize(
    ("settings", "longest"),
    [
        ({}, 600.0),  # the default --decode-timeout
        ({"decode_timeout": 3600.0}, 3600.0),
        ({"decode_timeout": 20000.0}, 20000.0),  # beyond vLLM's last bucket
        ({"pools": PoolSettings.plain(deadline_max_ms=9_000_000.0)}, 9000.0),
    ],
)
async def test_latency_buckets_cover_every_timeout_the_proxy_allows(
        proxy_factory: ProxyFactory, settings: dict[str, Any], longest: float) -> None:
    """A request that runs as long as the timeouts let it lands in a finite bucket (vLLM's request-latency
    buckets reach 7680 s), not in +Inf beside every other slow one: the old buckets stopped at 60 s."""
    client, app = await proxy_factory(["http://127.0.0.1:1"], ["http://127.0.0.1:2"], **settings)
    from proxy.http.app import METRICS  # noqa: PLC0415

    metrics = app[METRICS]
    metrics.ttft.observe(longest)
    metrics.e2e.observe(longest)
    metrics.stage.labels(stage="decode_first_token").observe(longest)
    text = await (await client.get("/metrics")).text()
    for name in ("pd_proxy_ttft_seconds", "pd_proxy_e2e_seconds", "pd_proxy_stage_seconds"):
        buckets = finite_buckets(text, name)
        assert buckets[-1] >= max(longest, 7680.0), name
        assert {0.001, 1.0, 60.0, 120.0, 960.0, 7680.0} <= set(buckets), name  # fine below, vLLM's above
    samples = {(s.name, s.labels.get("le")): s.value for f in text_string_to_metric_families(text)
               for s in f.samples if s.name == "pd_proxy_ttft_seconds_bucket"}
    top = finite_buckets(text, "pd_proxy_ttft_seconds")[-1]
    assert samples[("pd_proxy_ttft_seconds_bucket", repr(top))] == 1.0  # counted in a finite bucket


async def test_lease_buckets_cover_the_lease_duration(proxy_factory: ProxyFactory) -> None:
    client, _ = await proxy_factory(["http://127.0.0.1:1"], ["http://127.0.0.1:2"], lease_duration=300.0,
                                    decode_timeout=60.0, stream_idle_timeout=60.0)
    text = await (await client.get("/metrics")).text()
    assert finite_buckets(text, "pd_proxy_kv_lease_duration_seconds")[-1] >= 600.0


async def test_lease_buckets_cover_a_decode_hop_holding_the_lease(proxy_factory: ProxyFactory) -> None:
    """A lease a decode hop holds closes when the hop tells (up to its bound), not at P's lease."""
    client, _ = await proxy_factory(["http://127.0.0.1:1"], ["http://127.0.0.1:2"], lease_duration=30.0,
                                    decode_timeout=600.0)
    text = await (await client.get("/metrics")).text()
    assert finite_buckets(text, "pd_proxy_kv_lease_duration_seconds")[-1] >= 1200.0
