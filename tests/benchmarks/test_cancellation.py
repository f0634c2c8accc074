"""Cancellation: the client's cancels (disconnect, abort, the two-hop floor), the plans, the TTFT
penalty, the KV probes' analysis, and small bounded runs on pd-sim behind pd-proxy."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from benchmarks import BenchConfig, DatasetConfig, RequestRecord, RequestSpec, arun_benchmark
from benchmarks.cancel import CancelConfig, cancel_plans, pick_cancelled, ttft_penalty
from benchmarks.client import CancelPlan, ClientOptions, send_request
from benchmarks.kvprobe import (
    Interval,
    KvSample,
    analyse,
    parse_metrics,
    sim_state_holdings,
)
from benchmarks.metrics import compute_metrics
from proxy.config.settings import ProxySettings
from proxy.http.app import build_app
from tests.benchmarks.scripted import SEEN, Script, ScriptFn, Seen, make_app, stream_of

ServerFactory = Callable[..., Awaitable[TestServer]]
SimFactory = Callable[..., Awaitable[Any]]
SPEC = RequestSpec(prompt=[5, 6, 7, 8], output_len=6)


async def serve(aiohttp_server: ServerFactory, script: ScriptFn) -> tuple[str, web.Application]:
    app = make_app(script)
    server = await aiohttp_server(app)
    return f"http://127.0.0.1:{server.port}", app


async def one(url: str, plan: CancelPlan | None, **opts: Any) -> RequestRecord:
    rec = RequestRecord(0, "rq-1", url, len(SPEC.prompt), SPEC.output_len)
    async with aiohttp.ClientSession() as session:
        return await send_request(session, ClientOptions(url=url, **opts), SPEC, rec, 0.0, cancel=plan)


# ------------------------------------------------------------------ the client's cancels


async def test_disconnect_before_the_first_token(aiohttp_server: ServerFactory) -> None:
    # The first token would come after 30 s; the cancel fires long before it.
    url, app = await serve(aiohttp_server, lambda b: Script(steps=stream_of("rq-1", [1] * 6, gap_s=30.0)))
    rec = await one(url, CancelPlan(after_s=0.05, before_first_token=True))
    assert rec.cancelled and not rec.success and rec.failure is None
    assert rec.cancel_phase == "before_first_token" and rec.cancel_mode == "disconnect"
    assert rec.output_tokens == 0 and rec.tokens_at_cancel == 0
    await asyncio.wait_for(app[SEEN].disconnected.wait(), 10)  # the server saw the client go
    assert app[SEEN].aborts == []


async def test_disconnect_mid_stream_after_k_tokens(aiohttp_server: ServerFactory) -> None:
    url, app = await serve(aiohttp_server, lambda b: Script(steps=stream_of("rq-1", [1] * 6, gap_s=0.02)))
    rec = await one(url, CancelPlan(after_tokens=2))
    assert rec.cancelled and rec.cancel_phase == "mid_stream"
    assert rec.tokens_at_cancel == 2 and rec.output_tokens == 2  # nothing read after the cancel
    await asyncio.wait_for(app[SEEN].disconnected.wait(), 10)


async def test_abort_goes_to_the_abort_endpoint_and_the_answer_is_read_to_its_end(
    aiohttp_server: ServerFactory,
) -> None:
    url, app = await serve(aiohttp_server, lambda b: Script(steps=stream_of("rq-1", [1] * 6, gap_s=0.05)))
    rec = await one(url, CancelPlan(mode="abort", after_tokens=1), api_key="k")
    assert app[SEEN].aborts == [{"request_ids": ["generate-tokens-rq-1"]}]
    assert rec.cancelled and rec.cancel_mode == "abort" and rec.abort_status == 200
    assert rec.finish_reason == "abort"  # the server's aborted ending was read, no hang-up
    assert rec.abort_ended_s is not None and rec.abort_ended_s >= (rec.cancel_s or 0.0)
    assert app[SEEN].disconnects == 0
    assert rec.output_tokens < 6


async def test_an_abort_not_honoured_is_hung_up_after_the_grace_time(aiohttp_server: ServerFactory) -> None:
    script = lambda b: Script(steps=stream_of("rq-1", [1] * 6, gap_s=0.5), honour_abort=False)  # noqa: E731
    url, app = await serve(aiohttp_server, script)
    rec = await one(url, CancelPlan(mode="abort", after_tokens=1, abort_grace_s=0.2))
    assert rec.cancelled and rec.abort_status == 200
    assert rec.abort_ended_s is None  # the answer never ended: we hung up
    await asyncio.wait_for(app[SEEN].disconnected.wait(), 10)


async def test_a_first_token_before_the_moment_cancels_at_once(aiohttp_server: ServerFactory) -> None:
    url, _ = await serve(aiohttp_server, lambda b: Script(steps=stream_of("rq-1", [1] * 6, gap_s=0.02)))
    rec = await one(url, CancelPlan(after_s=60.0, before_first_token=True))
    assert rec.cancelled and rec.cancel_phase == "mid_stream" and rec.tokens_at_cancel == 1


async def test_a_request_that_ends_before_its_cancel_is_not_cancelled(aiohttp_server: ServerFactory) -> None:
    url, _ = await serve(aiohttp_server, lambda b: Script(steps=stream_of("rq-1", [1] * 6)))
    rec = await one(url, CancelPlan(after_s=60.0))
    assert rec.success and not rec.cancelled and rec.output_tokens == 6


def _prefill_app(delay_s: float = 0.0) -> web.Application:
    """A prefill worker's non-stream answer with kv_transfer_params (after ``delay_s``)."""
    app = web.Application()
    app[SEEN] = Seen()

    async def generate(request: web.Request) -> web.Response:
        body = await request.json()
        app[SEEN].bodies.append(body)
        try:
            await asyncio.sleep(delay_s)
        except asyncio.CancelledError:
            app[SEEN].disconnects += 1
            app[SEEN].disconnected.set()
            raise
        params = {"do_remote_prefill": True, "remote_block_ids": [[1]], "remote_request_id": "p-1"}
        return web.json_response(
            {
                "choices": [{"index": 0, "token_ids": [9], "finish_reason": "length"}],
                "kv_transfer_params": params,
                "output_mode": "tokens",
            }
        )

    app.router.add_post("/inference/v1/generate", generate)
    return app


async def test_the_floor_sends_both_hops_itself(aiohttp_server: ServerFactory) -> None:
    papp = _prefill_app()
    p = await aiohttp_server(papp)
    d_url, dapp = await serve(aiohttp_server, lambda b: Script(steps=stream_of("rq-1", [1] * 6)))
    rec = await one(d_url, None, prefill_url=f"http://127.0.0.1:{p.port}")
    assert rec.success, rec.error
    (pb,) = papp[SEEN].bodies
    assert pb["stream"] is False and pb["sampling_params"]["max_tokens"] == 1
    assert pb["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False}
    (db,) = dapp[SEEN].bodies
    assert db["kv_transfer_params"]["remote_request_id"] == "p-1" and db["stream"] is True
    assert db["sampling_params"]["max_tokens"] == 6 and db["request_id"] == pb["request_id"] == "rq-1"


async def test_the_floors_cancel_during_prefill_closes_the_prefill_hop(aiohttp_server: ServerFactory) -> None:
    papp = _prefill_app(delay_s=30.0)
    p = await aiohttp_server(papp)
    d_url, dapp = await serve(aiohttp_server, lambda b: Script(steps=stream_of("rq-1", [1] * 6)))
    rec = await one(
        d_url, CancelPlan(after_s=0.05, before_first_token=True), prefill_url=f"http://127.0.0.1:{p.port}"
    )
    assert rec.cancelled and rec.cancel_phase == "before_first_token"
    await asyncio.wait_for(papp[SEEN].disconnected.wait(), 10)
    assert dapp[SEEN].bodies == []  # the decode worker never heard of it


# ------------------------------------------------------------------ plans and penalty


def test_plans_are_deterministic_and_shaped_as_asked() -> None:
    specs = [RequestSpec([3] * 8, 10) for _ in range(40)]
    assert pick_cancelled(40, 0.25, 1) == pick_cancelled(40, 0.25, 1)
    assert len(pick_cancelled(40, 0.25, 1)) == 10 and pick_cancelled(40, 0.0, 1) == set()
    mid = cancel_plans(CancelConfig(rate=0.5, at="mid-stream"), specs, 3)
    assert len(mid) == 20
    assert all(p.after_tokens is not None and 1 <= p.after_tokens <= 9 for p in mid.values())
    refs = {i: 0.1 * (i + 1) for i in range(40)}
    bft = cancel_plans(CancelConfig(rate=0.5, at="before-first-token", mode="abort"), specs, 3, refs)
    assert set(bft) == set(mid)  # the same requests for the same seed
    for i, p in bft.items():
        assert p.before_first_token and p.mode == "abort" and 0.0 <= (p.after_s or 0.0) <= refs[i]
    first = cancel_plans(CancelConfig(rate=0.5, at="first-token", mode="abort"), specs, 3)
    assert set(first) == set(mid) and {(p.after_tokens, p.mode) for p in first.values()} == {(1, "abort")}
    after = cancel_plans(CancelConfig(rate=1.0, after_s=0.3), specs, 3)
    assert len(after) == 40 and {p.after_s for p in after.values()} == {0.3}
    with pytest.raises(ValueError):
        cancel_plans(CancelConfig(rate=0.5, at="before-first-token"), specs, 3)  # no TTFT reference


@pytest.mark.parametrize(
    ("cfg", "problem"),
    [
        (CancelConfig(rate=0.5), "exactly one of"),
        (CancelConfig(rate=0.5, at="mid-stream", after_s=1.0), "exactly one of"),
        (CancelConfig(rate=1.5, at="mid-stream"), "within 0..1"),
        (CancelConfig(rate=0.5, at="mid-stream", mode="pray"), "--cancel-mode"),
    ],
)
def test_bad_cancel_configs(cfg: CancelConfig, problem: str) -> None:
    assert any(problem in p for p in cfg.problems())


def _rec(i: int, ttft: float | None, *, cancelled: bool = False, ok: bool = True) -> RequestRecord:
    r = RequestRecord(
        i,
        f"r{i}",
        "t",
        4,
        2,
        success=ok and not cancelled,
        ttft_s=ttft,
        e2e_s=0.5,
        cancelled=cancelled,
        cancel_s=0.01 if cancelled else None,
        cancel_phase="before_first_token" if cancelled else None,
    )
    if ok and not cancelled:
        r.chunk_times_s, r.chunk_tokens, r.output_tokens = [ttft or 0.1, 0.5], [1, 1], 2
    return r


def test_ttft_penalty_pairs_the_survivors_with_the_same_requests_of_the_baseline() -> None:
    baseline = [_rec(i, 0.100) for i in range(4)]
    run = [_rec(0, 0.150), _rec(1, None, cancelled=True), _rec(2, 0.110), _rec(3, 0.100)]
    out = ttft_penalty(run, baseline, [50.0, 99.0])
    assert out["survivors_compared"] == 3
    assert out["ttft_penalty_mean_paired_ms"] == pytest.approx((50 + 10 + 0) / 3)
    assert out["ttft_penalty_median_ms"] == pytest.approx(10.0)
    assert out["baseline_median_ttft_ms"] == pytest.approx(100.0)


def test_an_abort_whose_answer_ran_to_its_end_is_counted() -> None:
    recs = [_rec(i, 0.05, cancelled=True) for i in range(4)]
    for r, finish in zip(recs, ["abort", "length", "stop", None], strict=True):
        r.cancel_mode, r.finish_reason = "abort", finish  # None: hung up after the grace
    recs.append(_rec(4, 0.05, cancelled=True))
    recs[4].finish_reason = "length"  # a disconnect: no abort call to heed
    out = compute_metrics(recs, 1.0, [50.0], cancellation=True)
    assert out["abort_calls"] == 4 and out["aborts_run_out"] == 2


def test_cancelled_requests_are_neither_completed_nor_failed() -> None:
    recs = [_rec(0, 0.1), _rec(1, None, cancelled=True), _rec(2, None, ok=False)]
    recs[2].failure = "http_status"
    out = compute_metrics(recs, 1.0, [50.0], cancellation=True)
    assert (out["completed"], out["failed"], out["cancelled"]) == (1, 1, 1)
    assert out["cancel_phases"] == {"before_first_token": 1, "mid_stream": 0}
    assert out["median_ttft_ms"] == pytest.approx(100.0)


# ------------------------------------------------------------------ KV probe analysis


def test_per_request_cancel_to_free_and_stranded_block_seconds() -> None:
    def s(t: float, **held: int) -> KvSample:
        return KvSample(t, float(sum(held.values())), dict(held))

    samples = [s(-0.1), s(0.0, a=4), s(0.1, a=4, b=2), s(0.2, a=4), s(0.3, a=4), s(0.4), s(0.5, c=1)]
    intervals = [
        Interval("a", 0.0, 0.15, cancel=0.15),
        Interval("b", 0.05, 0.6),
        Interval("c", 0.45, 0.7, cancel=0.5),
    ]
    rep = analyse(samples, intervals)
    a, c = rep.cancels
    assert a.held_after_cancel and a.freed == pytest.approx(0.4)
    assert a.cancel_to_free_s == pytest.approx(0.25)
    assert a.stranded_block_s == pytest.approx(4 * 0.2)  # 4 blocks from the poll after the cancel
    assert c.held_after_cancel and c.freed is None  # still held when watching ended: not freed
    out = rep.to_json([50.0])
    assert out["not_freed"] == 1 and out["cancels_holding"] == 2
    assert out["held_over_1s"] == 1  # c, never freed while watched
    assert out["median_cancel_to_free_ms"] == pytest.approx(250.0)
    assert rep.idle == 0.0 and rep.peak == 6.0


def test_aggregate_attribution_only_without_overlap() -> None:
    samples = [KvSample(t / 10, h) for t, h in enumerate([0, 0, 8, 8, 8, 0, 0, 8, 8, 0, 0])]
    samples = [KvSample(-0.05, 0.0), *samples]
    alone = [Interval("a", 0.15, 0.3, cancel=0.3), Interval("b", 0.65, 0.95)]
    rep = analyse(samples, alone, source="metrics")
    (a,) = rep.cancels
    assert a.attributed and a.freed == pytest.approx(0.5) and a.stranded_block_s == pytest.approx(8 * 0.2)
    crowded = [Interval("a", 0.15, 0.3, cancel=0.3), Interval("b", 0.2, 0.95)]
    (a2,) = analyse(samples, crowded, source="metrics").cancels
    assert not a2.attributed  # someone else was in flight: the total is not a's


def test_drain_after_the_last_request() -> None:
    samples = [KvSample(t, h) for t, h in ((-0.1, 1.0), (0.0, 5.0), (1.0, 5.0), (2.0, 1.0), (3.0, 1.0))]
    rep = analyse(samples, [Interval("a", 0.0, 1.0)], source="metrics")
    assert rep.idle == 1.0 and rep.drain_s == pytest.approx(1.0)
    assert rep.drain_block_s == pytest.approx(4.0)


def test_vllm_metrics_give_usage_and_blocks() -> None:
    text = (
        "# HELP vllm:kv_cache_usage_perc KV-cache usage.\n"
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25\n'
        'vllm:cache_config_info{block_size="128",engine="0",num_gpu_blocks="401",prefix="a\\"b"} 1.0\n'
    )
    assert parse_metrics(text) == (0.25, 400)
    assert parse_metrics("up 1\n") == (None, None)
    assert parse_metrics(
        'vllm:cache_config_info{x="{}",num_gpu_blocks="9"} 1\nvllm:kv_cache_usage_perc 0\n'
    ) == (
        0.0,
        8,
    )
    # a real vLLM 0.32 prefill worker's /metrics (CPU build: 4096 blocks of 128 tokens)
    trace = Path(__file__).parents[1] / "data" / "traces" / "vllm-0.32.0-cpu" / "metrics-pd-prefill.txt"
    usage, blocks = parse_metrics(trace.read_text())
    assert blocks == 4095 and usage == pytest.approx(0.00146520146520146)


def test_sim_state_ids_match_exactly() -> None:
    pat = re.compile(re.escape("pdbench-x-") + r"\d+-\d+(?!\d)")
    state = {
        "kv_blocks_used": 9,
        "inflight": [{"request_id": "generate-tokens-pdbench-x-0-12", "blocks": 2}],
        "kv_held": [
            {
                "request_id": "generate-tokens-pdbench-x-0-1",
                "remote_request_id": "pdbench-x-0-1-ab",
                "blocks": 4,
            },
            {"request_id": "someone-else", "blocks": 3},
        ],
    }
    assert sim_state_holdings(state, pat) == (9, {"pdbench-x-0-12": 2, "pdbench-x-0-1": 4})


# ------------------------------------------------------------------ runs on pd-sim behind pd-proxy


def _cfg(url: str, **kw: Any) -> BenchConfig:
    ds = DatasetConfig(num_requests=kw.pop("n", 12), input_len=64, output_len=8, seed=5)
    return BenchConfig(
        url=url,
        dataset=ds,
        progress=False,
        request_timeout_s=30.0,
        max_concurrency=4,
        percentiles=(50.0, 99.0),
        warmup=1,
        kv_free_timeout_s=10.0,
        **kw,
    )


async def _stack(sim_factory: SimFactory, aiohttp_server: ServerFactory) -> tuple[Any, Any, str]:
    timing = {"prefill_base_ms": 20.0, "prefill_per_token_ms": 0.1, "itl_ms": 5.0, "lease_seconds": 3.0}
    p = await sim_factory(role="prefill", **timing)
    d = await sim_factory(role="decode", **timing)
    app = build_app(
        ProxySettings(prefill_urls=(p.url,), decode_urls=(d.url,), kv_block_size=16, lease_duration=3.0)
    )
    server = await aiohttp_server(app)
    return p, d, f"http://127.0.0.1:{server.port}"


@pytest.mark.parametrize("mode", ["disconnect", "abort"])
async def test_cancels_through_pd_proxy_are_freed_on_the_prefill_worker(
    sim_factory: SimFactory, aiohttp_server: ServerFactory, mode: str
) -> None:
    p, _, url = await _stack(sim_factory, aiohttp_server)
    cancel = CancelConfig(rate=0.5, at="before-first-token", mode=mode)
    res = await arun_benchmark(_cfg(url, cancel=cancel, kv_probes=(p.url,)))
    d = res.data
    assert d["cancelled"] == 6 and d["completed"] == 6 and d["failed"] == 0, [r.error for r in res.records]
    assert res.baseline is not None and res.baseline.data["completed"] == 12
    assert d["survivors_compared"] == 6 and d["ttft_penalty_median_ms"] is not None
    (probe,) = d["kv_probes"]
    assert probe["source"] == "sim-state" and probe["cancels_attributed"] == 6
    assert probe["not_freed"] == 0  # pd-proxy freed every cancelled request's prefill KV
    if mode == "abort":
        assert d["abort_calls"] == 6 and d["abort_calls_ok"] == 6
    state = await p.state()
    assert state["kv_held"] == [] and state["releases"].get("expired", 0) == 0


async def test_the_baseline_and_the_cancel_run_share_no_prefix_cache(
    sim_factory: SimFactory, aiohttp_server: ServerFactory
) -> None:
    # The two runs send the same prompts; a worker's prefix cache must not serve the second run
    # from the first (on a real vLLM with room for every prompt, the "penalty" would be the cache).
    p, _, url = await _stack(sim_factory, aiohttp_server)
    res = await arun_benchmark(_cfg(url, cancel=CancelConfig(rate=0.5, at="mid-stream")))
    assert res.baseline is not None and res.data["completed"] == 6
    async with aiohttp.ClientSession() as s, s.get(f"{p.url}/metrics") as r:
        text = await r.text()
    hits = [line for line in text.splitlines() if line.startswith("vllm:prefix_cache_hits_total")]
    assert hits and all(float(line.rsplit(" ", 1)[1]) == 0.0 for line in hits), hits
    salts = {r.request_id.rsplit("-", 2)[0] for r in res.records} | {
        r.request_id.rsplit("-", 2)[0] for r in res.baseline.records
    }
    assert len(salts) == 2  # two runs, two ids (and salts)


async def test_the_floor_on_pd_sim(sim_factory: SimFactory, aiohttp_server: ServerFactory) -> None:
    p, d, _ = await _stack(sim_factory, aiohttp_server)
    cancel = CancelConfig(rate=0.5, at="mid-stream")
    res = await arun_benchmark(_cfg(d.url, two_hop=(p.url, d.url), cancel=cancel, kv_probes=(p.url, d.url)))
    data = res.data
    assert data["completed"] == 6 and data["cancelled"] == 6 and data["failed"] == 0
    assert data["base_url"].startswith("two-hop ")
    assert data["cancel_phases"] == {"before_first_token": 0, "mid_stream": 6}
    pk, dk = data["kv_probes"]
    assert pk["cancels_holding"] == 0  # mid-stream: P's blocks were pulled before any cancel
    assert dk["cancels_attributed"] == 6 and dk["not_freed"] == 0


def _vllm_like_metrics(sim_url: str) -> web.Application:
    """A worker seen through vLLM's metrics only: pd-sim's KV use as kv_cache_usage_perc."""

    async def metrics(request: web.Request) -> web.Response:
        async with aiohttp.ClientSession() as s, s.get(f"{sim_url}/sim/state") as r:
            state = json.loads(await r.read())
        usage = state["kv_cache_usage_perc"]
        used = state["kv_blocks_used"]
        blocks = round(used / usage) + 1 if usage else 4096
        text = (
            f'vllm:kv_cache_usage_perc{{engine="0"}} {usage}\n'
            f'vllm:cache_config_info{{engine="0",num_gpu_blocks="{blocks}"}} 1.0\n'
        )
        return web.Response(text=text)

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    return app


async def test_settled_serial_runs_attribute_cancels_from_a_total(
    sim_factory: SimFactory, aiohttp_server: ServerFactory
) -> None:
    # What the real-vLLM run does: usage totals only, one request at a time, each sent when the
    # prefill worker is idle again; every cancel is then attributed.
    p, _, url = await _stack(sim_factory, aiohttp_server)
    m = await aiohttp_server(_vllm_like_metrics(p.url))
    cancel = CancelConfig(rate=1.0, at="before-first-token", baseline=False)
    cfg = _cfg(
        url,
        n=4,
        cancel=cancel,
        kv_probes=(f"http://127.0.0.1:{m.port}",),
        kv_settle=True,
        kv_probe_interval_s=0.01,
    )
    res = await arun_benchmark(replace(cfg, max_concurrency=1))
    (probe,) = res.data["kv_probes"]
    assert probe["source"] == "metrics" and probe["cancels"] == 4
    assert probe["cancels_attributed"] == 4 and probe["not_freed"] == 0
