"""The router comparison: plan order, arithmetic, result shape, configuration, and its load,
readiness and memory steps against a scripted server.

No timing assertions: the numbers themselves come from `python -m benchmarks.compare_routers`.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from benchmarks import compare_routers as cr
from benchmarks.compare_routers import FLOOR, PD_PROXY, TARGETS, VLLM_ROUTER, Point, RunStats
from benchmarks.records import FAIL_HTTP_STATUS, FAIL_TRANSPORT, RequestRecord
from tests.benchmarks.scripted import SEEN, Script, chunk, echo_stream, make_app

ServerFactory = Callable[..., Awaitable[TestServer]]

# --- plan ---------------------------------------------------------------------------------


def test_target_order_rotates_so_every_target_leads_once() -> None:
    orders = [cr.target_order(TARGETS, rep) for rep in range(3)]
    assert orders == [
        [FLOOR, PD_PROXY, VLLM_ROUTER],
        [PD_PROXY, VLLM_ROUTER, FLOOR],
        [VLLM_ROUTER, FLOOR, PD_PROXY],
    ]
    # each position is held by each target exactly once over len(targets) repetitions
    for position in range(3):
        assert sorted(o[position] for o in orders) == sorted(TARGETS)
    assert cr.target_order(TARGETS, 3) == orders[0]
    assert cr.target_order([], 5) == []


def test_schedule_runs_every_point_rep_target_once_point_by_point() -> None:
    points = cr.build_points([1, 64], [32], [True, False])
    plan = list(cr.schedule(points, TARGETS, reps=2))
    assert len(plan) == len(points) * 2 * len(TARGETS)
    assert len(set(plan)) == len(plan)
    # all runs of one point are contiguous, so drift within a point hits every target
    seen_points = [p for p, _, _ in plan]
    firsts = [seen_points.index(p) for p in points]
    assert firsts == sorted(firsts)
    for p in points:
        idx = [i for i, q in enumerate(seen_points) if q == p]
        assert idx == list(range(idx[0], idx[0] + 2 * len(TARGETS)))
    # within a point, repetition 1 starts with a different target than repetition 0
    first_point = [(rep, t) for p, rep, t in plan if p == points[0]]
    assert first_point[0] == (0, FLOOR)
    assert first_point[3] == (1, PD_PROXY)


def test_build_points_is_the_full_grid_with_labels() -> None:
    points = cr.build_points([1, 64, 256], [32, 256], [True, False])
    assert len(points) == 12
    assert len({p.label for p in points}) == 12
    assert Point(stream=False, max_tokens=256, concurrency=64).label == "nonstream-out256-c64"


def test_requests_per_run() -> None:
    assert cr.requests_per_run(256, 2, 16) == 512
    assert cr.requests_per_run(1, 2, 16) == 16
    assert cr.parse_args(["--quick"]).min_requests == 64


# --- arithmetic ---------------------------------------------------------------------------


def test_median_ignores_nan_and_is_nan_when_empty() -> None:
    assert cr.median([1.0, math.nan, 3.0, 10.0]) == 3.0
    assert math.isnan(cr.median([math.nan]))
    assert math.isnan(cr.median([]))


def test_ratio_guards() -> None:
    assert cr.ratio(3.0, 2.0) == 1.5
    assert math.isnan(cr.ratio(1.0, 0.0))
    assert math.isnan(cr.ratio(1.0, -2.0))
    assert math.isnan(cr.ratio(math.nan, 2.0))
    assert math.isnan(cr.ratio(2.0, math.nan))


def _record(
    ttft_s: float | None, tokens: int, failure: str | None = None, status: int = 200, e2e_s: float = 0.1
) -> RequestRecord:
    rec = RequestRecord(0, "r", "t", 4, tokens, ttft_s=ttft_s, e2e_s=e2e_s, output_tokens=tokens)
    rec.http_status = status
    if failure is not None:
        rec.fail(failure, "x")
    rec.success = failure is None
    return rec


def test_run_stats_counts_only_good_samples() -> None:
    samples = [_record(0.010, 32), _record(0.020, 32), _record(None, 0, FAIL_HTTP_STATUS, 502)]
    stats = cr.run_stats(samples, wall_s=2.0, proxy_cpu_s=0.5, workers_cpu_s=1.0, client_cpu_s=1.5)
    assert stats.ok == 2
    assert stats.errors == 1
    assert stats.error_kinds == {"http_status 502": 1}
    assert stats.tokens_per_s == 32.0
    assert stats.requests_per_s == 1.0
    assert stats.ttft_p50_ms == pytest.approx(15.0)
    assert stats.tokens_per_proxy_cpu_s == 128.0
    assert stats.proxy_cpu_util == 0.25
    assert stats.workers_cpu_util == 0.5
    assert stats.client_cpu_util == 0.75
    floor_stats = cr.run_stats(samples, wall_s=2.0)
    assert math.isnan(floor_stats.tokens_per_proxy_cpu_s)


def test_run_stats_non_stream_ttft_is_the_whole_answer_and_empty_answers_are_errors() -> None:
    # a non-stream answer has no first token of its own: its TTFT is the time to the whole answer
    samples = [_record(None, 16, e2e_s=0.030), _record(None, 16, e2e_s=0.050), _record(None, 0, e2e_s=0.01)]
    stats = cr.run_stats(samples, wall_s=1.0)
    assert stats.ttft_p50_ms == pytest.approx(40.0)
    assert stats.ttft_p99_ms == pytest.approx(49.8)
    assert (stats.ok, stats.errors, stats.error_kinds) == (2, 1, {"no tokens": 1})
    assert stats.tokens_per_s == 32.0
    nothing = cr.run_stats([_record(None, 0, FAIL_TRANSPORT)], wall_s=1.0)
    assert math.isnan(nothing.ttft_p50_ms) and nothing.error_kinds == {FAIL_TRANSPORT: 1}


def _rs(p50: float, p99: float, tps: float) -> RunStats:
    return RunStats(
        ttft_p50_ms=p50,
        ttft_p99_ms=p99,
        tokens_per_s=tps,
        requests_per_s=tps / 10,
        ok=10,
        errors=0,
        timed_out=False,
        wall_s=1.0,
    )


def test_added_ttft_is_paired_per_repetition_then_median() -> None:
    # floor drifts between repetitions; pairing removes the drift
    runs = {
        FLOOR: [_rs(1.0, 2.0, 1000), _rs(5.0, 9.0, 900), _rs(2.0, 3.0, 950)],
        PD_PROXY: [_rs(1.5, 3.0, 500), _rs(5.5, 10.0, 400), _rs(2.5, 4.0, 450)],
        VLLM_ROUTER: [_rs(2.0, 4.0, 400), _rs(7.0, 12.0, 410), _rs(3.0, 5.0, 380)],
    }
    med = cr.summarise_point(runs)
    assert med[PD_PROXY]["added_ttft_p50_ms"] == pytest.approx(0.5)
    assert med[PD_PROXY]["added_ttft_p99_ms"] == pytest.approx(1.0)
    assert med[VLLM_ROUTER]["added_ttft_p50_ms"] == pytest.approx(1.0)  # median of 1, 2, 1
    assert med[VLLM_ROUTER]["added_ttft_p99_ms"] == pytest.approx(2.0)  # median of 2, 3, 2
    assert med[FLOOR]["added_ttft_p50_ms"] == 0.0
    assert med[PD_PROXY]["tokens_per_s"] == 450
    assert med[PD_PROXY]["ok"] == 30
    ratios = cr.point_ratios("x", med)
    assert ratios["tokens_per_s"] == pytest.approx(450 / 400)
    assert ratios["added_ttft_p50_ms"] == pytest.approx(0.5)
    assert ratios["added_ttft_p50_diff_ms"] == pytest.approx(-0.5)
    assert ratios["added_ttft_p99_diff_ms"] == pytest.approx(-1.0)
    assert math.isnan(ratios["tokens_per_proxy_cpu_s"])  # no CPU figures in these runs


def test_added_ttft_is_nan_without_a_floor() -> None:
    med = cr.summarise_point({VLLM_ROUTER: [_rs(2.0, 4.0, 400)]})
    assert math.isnan(float(med[VLLM_ROUTER]["added_ttft_p50_ms"]))
    assert math.isnan(cr.point_ratios("x", med)["tokens_per_s"])


# --- result document ----------------------------------------------------------------------


def _result() -> dict[str, object]:
    points = cr.build_points([1, 64], [32], [True])
    runs = {
        p: {
            FLOOR: [_rs(1.0, 2.0, 1000), _rs(1.1, 2.2, 1001)],
            PD_PROXY: [_rs(1.5, 3.0, 500), _rs(1.6, 3.1, 505)],
            VLLM_ROUTER: [_rs(2.0, 4.0, 400), _rs(2.1, 4.1, 405)],
        }
        for p in points
    }
    memory = {
        "streams": 1000,
        "results": [
            {
                "target": PD_PROXY,
                "streams_requested": 1000,
                "streams_open": 0,
                "rss_before_kib": 100,
                "rss_after_kib": 100,
                "per_stream_kib": math.nan,
            }
        ],
    }
    return cr.build_result({"quick": True}, points, runs, memory)


def test_result_json_has_the_documented_keys_and_is_strict_json() -> None:
    result = _result()
    assert tuple(result) == cr.RESULT_KEYS
    text = json.dumps(result, allow_nan=False)  # NaN became null
    doc = json.loads(text)
    assert len(doc["points"]) == 2
    for point in doc["points"]:
        assert tuple(point) == cr.POINT_KEYS
        assert set(point["targets"]) == set(TARGETS)
        for target in point["targets"].values():
            assert tuple(target) == cr.TARGET_KEYS
            assert set(cr.METRIC_KEYS) <= set(target["median"])
            assert len(target["reps"]) == 2
    for row in doc["ratios"]:
        assert tuple(row) == cr.RATIO_KEYS
    assert doc["memory"]["results"][0]["per_stream_kib"] is None


def test_issue_checks_judge_each_target() -> None:
    checks = _result()["checks"]
    assert isinstance(checks, dict)
    assert tuple(checks) == cr.CHECK_KEYS
    # c64 only: pd-proxy 502.5 tok/s vs 402.5; added TTFT 0.55/1.05 ms vs 1.05/2.05 ms
    assert checks["relay_throughput"] == {"met": True, "judged": 1, "failing": []}
    assert checks["added_ttft"] == {"met": True, "judged": 2, "failing": []}
    assert checks["memory_per_stream"]["met"] is None  # no figure: nothing judged
    assert checks["floor_headroom"]["met"] is True  # 1000.5 >= 1.2 x 502.5

    points = cr.build_points([1, 256], [256], [False])
    runs = {
        p: {
            FLOOR: [_rs(1.0, 2.0, 450)],
            PD_PROXY: [_rs(1.5, 3.0, 390)],
            VLLM_ROUTER: [_rs(2.0, 2.5, 400)],
        }
        for p in points
    }
    memory = {"results": [{"target": PD_PROXY, "per_stream_kib": 70.0}]}
    checks = cr.build_result({}, points, runs, memory)["checks"]
    assert checks["relay_throughput"] == {"met": False, "judged": 1, "failing": ["nonstream-out256-c256"]}
    # p50 better, p99 worse (2.0 vs 1.5 added ms): a miss at every concurrency
    assert checks["added_ttft"]["failing"] == ["nonstream-out256-c1", "nonstream-out256-c256"]
    assert checks["memory_per_stream"] == {"met": False, "judged": 1, "failing": [PD_PROXY]}
    assert checks["floor_headroom"]["met"] is False  # 450 < 1.2 x 400


def test_table_and_plot_are_written(tmp_path: Path) -> None:
    result = _result()
    table = cr.format_table(result)
    assert "stream-out32-c64" in table
    assert "1.25" in table  # tokens/s ratio 502.5 / 402.5
    assert "relay_throughput" in table
    png = tmp_path / "r.png"
    cr.make_plot(result, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --- parsing ------------------------------------------------------------------------------


# --- configuration ------------------------------------------------------------------------


def test_quick_defaults_and_overrides() -> None:
    quick = cr.parse_args(["--quick", "--proxy-cpus", "", "--worker-cpus", "", "--client-cpus", ""])
    full = cr.parse_args([])
    assert (quick.reps, quick.rounds) == (3, 2)
    assert (full.reps, full.rounds) == (5, 4)
    assert quick.concurrencies == (1, 64, 256)
    assert quick.max_tokens == (32, 256)
    assert quick.streams == (True, False)
    assert quick.proxy_cpus is None
    custom = cr.parse_args(["--targets", "floor,vllm-router", "--modes", "nonstream", "--reps", "5"])
    assert custom.targets == (FLOOR, VLLM_ROUTER)
    assert custom.streams == (False,)
    assert custom.reps == 5


def test_unknown_target_is_refused() -> None:
    with pytest.raises(SystemExit):
        cr.parse_args(["--targets", "floor,nginx"])


def test_commands_render_with_ports_and_urls() -> None:
    cfg = cr.parse_args([])
    argv = cr.proxy_argv(VLLM_ROUTER, cfg, 4321, "http://127.0.0.1:1", "http://127.0.0.1:2")
    assert argv[0].endswith("/vllm-router")
    assert "--vllm-pd-disaggregation" in argv
    assert argv[argv.index("--prefill") + 1] == "http://127.0.0.1:1"
    assert argv[argv.index("--decode") + 1] == "http://127.0.0.1:2"
    assert argv[argv.index("--port") + 1] == "4321"
    assert argv[argv.index("--prometheus-port") + 1].isdigit()
    extra = cr.parse_args(["--pd-proxy-args", "--workers 2"])
    argv = cr.proxy_argv(PD_PROXY, extra, 4321, "http://127.0.0.1:1", "http://127.0.0.1:2")
    assert argv[0].endswith("/pd-proxy")
    assert argv[-2:] == ["--workers", "2"]


def test_the_workers_context_fits_a_long_prompt() -> None:
    cfg = cr.parse_args(["--prompt-len", "2048", "--max-tokens", "32,256"])
    for template in (cfg.sim_cmd, cfg.slow_decode_cmd):
        argv = cr.sim_argv(template, cfg, 4321, "decode")
        assert int(argv[argv.index("--max-model-len") + 1]) >= 2048 + 256
    assert "--max-model-len" in cr.sim_argv(cr.parse_args([]).sim_cmd, cr.parse_args([]), 1, "prefill")


# --- pd-proxy with several processes ------------------------------------------------------


def test_pd_proxy_target_names_carry_the_process_count() -> None:
    assert cr.pd_proxy_name(1) == PD_PROXY
    assert cr.pd_proxy_name(2) == "pd-proxy-w2"
    for n in (1, 2, 8):
        assert cr.pd_proxy_workers(cr.pd_proxy_name(n)) == n
    for other in (FLOOR, VLLM_ROUTER, "pd-proxy-w", "pd-proxy-w1", "pd-proxy-wx"):
        assert cr.pd_proxy_workers(other) is None
    assert cr.is_proxy("pd-proxy-w4") and cr.is_proxy(VLLM_ROUTER) and not cr.is_proxy(FLOOR)


def test_pd_proxy_is_run_once_per_process_count_on_the_same_cores() -> None:
    cfg = cr.parse_args(["--pd-proxy-workers", "2,1"])
    assert cfg.targets == (FLOOR, PD_PROXY, "pd-proxy-w2", VLLM_ROUTER)
    argv = cr.proxy_argv("pd-proxy-w2", cfg, 4321, "http://127.0.0.1:1", "http://127.0.0.1:2")
    assert argv[0].endswith("/pd-proxy") and argv[-2:] == ["--workers", "2"]
    assert "--workers" not in cr.proxy_argv(PD_PROXY, cfg, 4321, "http://127.0.0.1:1", "http://127.0.0.1:2")
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) >= 2:  # every proxy gets the same two cores; so does vllm-router's runtime
        assert cfg.proxy_cpus == ",".join(map(str, cpus[-2:]))
        assert cfg.worker_cpus and cfg.client_cpus
    single = cr.parse_args(["--pd-proxy-workers", "1"])
    assert single.targets == (FLOOR, PD_PROXY, VLLM_ROUTER)
    if len(cpus) >= 2:
        assert single.proxy_cpus == str(cpus[-1])
    with pytest.raises(SystemExit):
        cr.parse_args(["--pd-proxy-workers", "0"])


def test_ratios_and_checks_per_pd_proxy_variant(tmp_path: Path) -> None:
    points = cr.build_points([64], [32], [True])
    runs = {
        p: {
            FLOOR: [_rs(1.0, 2.0, 1000)],
            PD_PROXY: [_rs(1.5, 3.0, 300)],
            "pd-proxy-w2": [_rs(1.2, 2.5, 500)],
            VLLM_ROUTER: [_rs(2.0, 4.0, 400)],
        }
        for p in points
    }
    mem = {"streams_requested": 1000, "streams_open": 1000, "rss_before_kib": 1, "rss_after_kib": 2}
    memory = {"results": [{**mem, "target": PD_PROXY, "per_stream_kib": 40.0},
                          {**mem, "target": "pd-proxy-w2", "per_stream_kib": 80.0}]}
    result = cr.build_result({}, points, runs, memory)
    assert [r["proxy"] for r in result["ratios"]] == [PD_PROXY, "pd-proxy-w2"]
    assert result["ratios"][1]["tokens_per_s"] == pytest.approx(500 / 400)
    by = result["checks_by_proxy"]
    assert by[PD_PROXY]["relay_throughput"]["failing"] == ["stream-out32-c64"]  # 300 < 400
    assert by["pd-proxy-w2"]["relay_throughput"]["met"] is True
    assert by[PD_PROXY]["memory_per_stream"]["met"] is True
    assert by["pd-proxy-w2"]["memory_per_stream"]["failing"] == ["pd-proxy-w2"]
    assert result["checks"] == by[PD_PROXY]
    table = cr.format_table(result)
    assert "pd-proxy-w2" in table and "issue targets on this run for pd-proxy-w2" in table
    cr.make_plot(result, tmp_path / "r.png")
    assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"


# --- load, readiness and memory against a scripted server ------------------------------------


def _answer(body: dict[str, Any]) -> Script:
    """A stream of max_tokens single tokens, or the whole answer at once; the prefill hop (one
    token, non-stream) answers with kv_transfer_params."""
    if body.get("kv_transfer_params", {}).get("do_remote_decode"):
        return Script(json_body={"output_mode": "tokens", "kv_transfer_params": {"remote_block_ids": [1]},
                                 "choices": [{"index": 0, "token_ids": [3], "finish_reason": "length"}]})
    if body["stream"]:
        return echo_stream(body)
    n = int(body["sampling_params"]["max_tokens"])
    return Script(json_body={"output_mode": "tokens",
                             "choices": [{"index": 0, "token_ids": [3] * n, "finish_reason": "length"}]})


async def _serve(aiohttp_server: ServerFactory, script: Callable[[dict[str, Any]], Script]) -> tuple[
        str, web.Application]:
    app = make_app(script)
    server = await aiohttp_server(app)
    return f"http://127.0.0.1:{server.port}", app


@pytest.mark.parametrize("stream", [True, False])
async def test_run_load_is_a_closed_loop_after_an_uncounted_warm_up(
    aiohttp_server: ServerFactory, stream: bool
) -> None:
    url, app = await _serve(aiohttp_server, _answer)
    point = Point(stream=stream, max_tokens=4, concurrency=3)
    run = await cr.run_load(cr.client_options(url, 10.0), point, prompt=[5, 6, 7], n_requests=10,
                            time_limit_s=30.0, proxy_pid=os.getpid())
    seen = app[SEEN]
    assert len(seen.bodies) == 3 + 10  # one warm-up request per concurrent stream, then the run
    assert seen.max_in_flight <= 3
    assert (run.ok, run.errors, run.timed_out) == (10, 0, False)
    assert run.tokens_per_s == pytest.approx(40 / run.wall_s)
    assert run.ttft_p50_ms > 0 and run.ttft_p99_ms >= run.ttft_p50_ms
    assert not math.isnan(run.proxy_cpu_util)  # this process stands in for the proxy
    assert all(b["stream"] is stream and b["token_ids"] == [5, 6, 7] for b in seen.bodies)
    assert "X-PD-Timing" not in seen.headers[0]  # no Server-Timing asked of the proxies
    assert len({b["request_id"] for b in seen.bodies}) == len(seen.bodies)


async def test_the_floor_sends_both_hops(aiohttp_server: ServerFactory) -> None:
    prefill_url, prefill = await _serve(aiohttp_server, _answer)
    decode_url, decode = await _serve(aiohttp_server, _answer)
    floor = cr.client_options(decode_url, 10.0, prefill_url=prefill_url)
    run = await cr.run_load(floor, Point(stream=True, max_tokens=4, concurrency=2), prompt=[5],
                            n_requests=4, time_limit_s=30.0)
    assert (run.ok, run.errors) == (4, 0)
    assert len(prefill[SEEN].bodies) == len(decode[SEEN].bodies) == 2 + 4
    assert all(b["sampling_params"]["max_tokens"] == 1 for b in prefill[SEEN].bodies)
    assert all(b["kv_transfer_params"] == {"remote_block_ids": [1]} for b in decode[SEEN].bodies)
    assert math.isnan(run.proxy_cpu_util)


def _held(body: dict[str, Any]) -> Script:
    """A first token at once, the next after five minutes: the stream stays open."""
    rid = str(body["request_id"])
    return Script(steps=[(0.0, chunk(rid, [3])), (300.0, chunk(rid, [4], "length"))], honour_abort=False)


@pytest.fixture
def running() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    proc.kill()
    proc.wait()


@pytest.fixture
def exited() -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(4)"])
    proc.wait()
    return proc


async def test_wait_serving_needs_only_a_first_token(
    aiohttp_server: ServerFactory, running: subprocess.Popen[bytes]
) -> None:
    url, app = await _serve(aiohttp_server, _held)
    await cr.wait_serving("held", running, cr.client_options(url, 60.0), [5], 30)
    assert len(app[SEEN].bodies) == 1  # ready at the first attempt, without the five minutes


async def test_wait_serving_fails_when_the_process_exits(
    aiohttp_server: ServerFactory, exited: subprocess.Popen[bytes]
) -> None:
    url, _ = await _serve(aiohttp_server, lambda b: Script(status=503))
    with pytest.raises(RuntimeError, match="exited with code 4"):
        await cr.wait_serving("broken", exited, cr.client_options(url, 5.0), [5], 30)


async def test_memory_is_measured_over_streams_held_open(aiohttp_server: ServerFactory) -> None:
    url, app = await _serve(aiohttp_server, _held)
    res = await cr.measure_stream_memory("scripted", url, pid=os.getpid(), n=5, prompt=[5], limit_s=30)
    assert (res["streams_requested"], res["streams_open"], res["warmup_streams_open"]) == (5, 5, 16)
    assert res["rss_before_kib"] > 0 and res["rss_after_kib"] > 0
    assert res["per_stream_kib"] == pytest.approx((res["rss_after_kib"] - res["rss_before_kib"]) / 5)
    seen = app[SEEN]
    for _ in range(100):  # the server notices the last closes a moment later (bounded)
        if seen.disconnects == 16 + 5:
            break
        await asyncio.sleep(0.05)
    assert seen.disconnects == 16 + 5  # every held stream was closed
    assert seen.in_flight == 0


# --- pinning modes and CPU per request ---------------------------------------------------------


def test_pinning_modes_parse() -> None:
    assert cr.parse_args([]).pinnings == (cr.PINNED,)  # the default is unchanged
    assert cr.parse_args([]).pinning == cr.PINNED
    assert cr.parse_args(["--pinning", "unpinned"]).pinnings == (cr.UNPINNED,)
    both = cr.parse_args(["--pinning", "both"])
    assert both.pinnings == (cr.PINNED, cr.UNPINNED)
    assert both.pinning == cr.BOTH
    with pytest.raises(SystemExit):
        cr.parse_args(["--pinning", "sometimes"])
    with pytest.raises(SystemExit):  # unpinned and a CPU list contradict each other
        cr.parse_args(["--pinning", "unpinned", "--proxy-cpus", "1"])
    assert cr.parse_args(["--pinning", "both", "--proxy-cpus", "1"]).proxy_cpus == "1"  # for the pinned half


def test_unpinned_runs_nothing_under_taskset(tmp_path: Path) -> None:
    cfg = cr.parse_args(["--pinning", "both", "--proxy-cpus", "0", "--worker-cpus", "0", "--client-cpus", "0",
                         "--out", str(tmp_path)])
    pinned, unpinned = cr.for_pinning(cfg, cr.PINNED), cr.for_pinning(cfg, cr.UNPINNED)
    assert (pinned.proxy_cpus, pinned.worker_cpus, pinned.client_cpus) == ("0", "0", "0")
    assert (unpinned.proxy_cpus, unpinned.worker_cpus, unpinned.client_cpus) == (None, None, None)
    assert (pinned.out_dir, unpinned.out_dir) == (tmp_path / "pinned", tmp_path / "unpinned")
    assert (pinned.pinning, unpinned.pinning) == (cr.PINNED, cr.UNPINNED)
    single = cr.parse_args(["--pinning", "unpinned", "--out", str(tmp_path)])
    assert cr.for_pinning(single, cr.UNPINNED).out_dir == tmp_path  # one mode: no subfolder
    # The command line each process is started with: taskset when pinned, none at all unpinned.
    from benchmarks.sim_stack import start_logged, stop_all  # noqa: PLC0415

    for run_cfg, log in ((pinned, tmp_path / "p.log"), (unpinned, tmp_path / "u.log")):
        proc = start_logged([sys.executable, "-c", "pass"], log, run_cfg.proxy_cpus)
        proc.wait(30)
        stop_all([proc])
    assert (tmp_path / "p.log").read_text().startswith("$ taskset -c 0 ")
    assert "taskset" not in (tmp_path / "u.log").read_text()


def _rs_cpu(tps: float, ok: int, cpu_s: float) -> RunStats:
    return cr.run_stats([_record(0.001, int(tps // max(ok, 1))) for _ in range(ok)], 1.0, proxy_cpu_s=cpu_s)


def test_cpu_per_request_is_proxy_cpu_over_completed_requests() -> None:
    run = cr.run_stats([_record(0.01, 4), _record(0.01, 4), _record(None, 0, FAIL_TRANSPORT)], 2.0,
                       proxy_cpu_s=0.002)
    assert run.proxy_cpu_us_per_request == pytest.approx(1000.0)  # 2 ms over the 2 completed
    assert math.isnan(cr.run_stats([_record(0.01, 4)], 1.0).proxy_cpu_us_per_request)  # the floor
    assert math.isnan(cr.run_stats([], 1.0, proxy_cpu_s=0.5).proxy_cpu_us_per_request)  # none completed


def _mode_result(mode: str, ours_cpu: float, router_cpu: float) -> dict[str, Any]:
    points = cr.build_points([64], [32], [True, False])
    runs = {p: {FLOOR: [_rs_cpu(1000, 10, math.nan)], PD_PROXY: [_rs_cpu(500, 10, ours_cpu)],
                VLLM_ROUTER: [_rs_cpu(400, 8, router_cpu)]} for p in points}
    meta = {"pinning": mode, "proxy_cpus": "1" if mode == cr.PINNED else None,
            "loadavg_start": [1.5, 1.0, 0.5], "loadavg_end": [2.0, 1.25, 0.75]}
    return cr.build_result(meta, points, runs, {"results": []})


def test_every_proxy_target_reports_cpu_per_request_and_its_ratio() -> None:
    result = _mode_result(cr.PINNED, 0.010, 0.004)
    doc = json.loads(json.dumps(result, allow_nan=False))
    for point in doc["points"]:
        assert point["targets"][PD_PROXY]["median"]["proxy_cpu_us_per_request"] == pytest.approx(1000.0)
        assert point["targets"][VLLM_ROUTER]["median"]["proxy_cpu_us_per_request"] == pytest.approx(500.0)
        assert point["targets"][FLOOR]["median"]["proxy_cpu_us_per_request"] is None  # no proxy
    for row in doc["ratios"]:
        assert tuple(row) == cr.RATIO_KEYS
        assert row["proxy_cpu_us_per_request"] == pytest.approx(2.0)
    assert doc["meta"]["pinning"] == cr.PINNED
    table = cr.format_table(result)
    assert table.splitlines()[0] == (
        "pinned (taskset): proxies 1, workers all cores, client all cores; "
        "load average at start / end: 1.50 1.00 0.50 / 2.00 1.25 0.75")
    assert "cpu/req" in table and "1000 us/req" in table and "500 us/req" in table
    assert cr.format_table(_mode_result(cr.UNPINNED, 0.01, 0.01)).startswith(
        "unpinned: no taskset, every proxy, the workers and the client share all the cores")


def test_a_pinning_that_keeps_nothing_apart_says_so() -> None:
    """On 2 cores with pd-proxy-w2 among the targets every process is pinned to both cores: the
    line says the proxies were not kept apart and how to have them so."""
    shared = cr.describe_pinning({"pinning": cr.PINNED, "proxy_cpus": "0,1", "worker_cpus": "0,1",
                                  "client_cpus": "0,1"})
    assert shared.startswith("pinned (taskset): proxies 0,1, workers 0,1, client 0,1 (the proxies share")
    assert "--pd-proxy-workers 1" in shared
    apart = cr.describe_pinning({"pinning": cr.PINNED, "proxy_cpus": "1", "worker_cpus": "0",
                                 "client_cpus": "0"})
    assert apart == "pinned (taskset): proxies 1, workers 0, client 0"


def test_both_modes_side_by_side() -> None:
    combined = cr.combine({cr.PINNED: _mode_result(cr.PINNED, 0.010, 0.004),
                           cr.UNPINNED: _mode_result(cr.UNPINNED, 0.006, 0.006)})
    doc = json.loads(json.dumps(combined, allow_nan=False))
    assert tuple(doc) == cr.BOTH_KEYS
    assert doc["meta"]["pinning"] == cr.BOTH and doc["meta"]["modes"] == list(cr.PINNINGS)
    assert doc["runs"][cr.UNPINNED]["meta"]["pinning"] == cr.UNPINNED
    assert tuple(doc["runs"][cr.PINNED]) == cr.RESULT_KEYS
    rows = doc["side_by_side"]
    labels = ("stream-out32-c64", "nonstream-out32-c64")
    assert [(r["label"], r["target"]) for r in rows] == [
        (label, t) for label in labels for t in (FLOOR, PD_PROXY, VLLM_ROUTER)]
    ours = rows[1]
    assert tuple(ours) == cr.SIDE_KEYS
    assert tuple(ours[cr.PINNED]) == cr.SIDE_METRICS
    assert ours[cr.PINNED]["proxy_cpu_us_per_request"] == pytest.approx(1000.0)
    assert ours[cr.PINNED]["cpu_per_request_vs_router"] == pytest.approx(2.0)
    assert ours[cr.UNPINNED]["cpu_per_request_vs_router"] == pytest.approx(600.0 / 750.0)
    assert ours[cr.PINNED]["requests_per_s_vs_router"] == pytest.approx(10 / 8)
    assert rows[0][cr.PINNED]["proxy_cpu_us_per_request"] is None  # the floor: no proxy
    table = cr.format_side_by_side(combined)
    assert "pinned us/req" in table and "unpinned us/req" in table
    assert "1000 (2.00)" in table and "600 (0.80)" in table
    assert "load average unpinned: 1.50 1.00 0.50 / 2.00 1.25 0.75 (start / end)" in table


def test_a_mode_missing_from_a_point_is_none() -> None:
    only = cr.combine({cr.UNPINNED: _mode_result(cr.UNPINNED, 0.006, 0.006)})
    assert all(row[cr.PINNED] is None for row in only["side_by_side"])


def test_both_runs_every_mode_and_writes_each_and_the_combined_result(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """main with --pinning both: one full comparison per mode (each in its folder, the client's own
    CPU list set for each), then the side-by-side document; no process is started here."""
    seen: list[tuple[str, str | None, str | None, set[int]]] = []

    async def fake_run(cfg: cr.Config, procs: list[Any]) -> dict[str, Any]:
        seen.append((cfg.pinning, cfg.proxy_cpus, cfg.worker_cpus, os.sched_getaffinity(0)))
        return _mode_result(cfg.pinning, 0.010, 0.004)

    monkeypatch.setattr(cr, "run_comparison", fake_run)
    monkeypatch.setattr(cr, "ensure_router", lambda cfg: None)
    cpus = sorted(os.sched_getaffinity(0))
    first = str(cpus[0])
    assert cr.main(["--pinning", "both", "--targets", "floor,pd-proxy,vllm-router", "--pd-proxy-workers", "1",
                    "--proxy-cpus", first, "--worker-cpus", first, "--client-cpus", first,
                    "--out", str(tmp_path), "--memory-streams", "0"]) == 0
    assert [s[:3] for s in seen] == [(cr.PINNED, first, first), (cr.UNPINNED, None, None)]
    assert seen[0][3] == {cpus[0]} and seen[1][3] == set(cpus)  # the client: pinned, then every core
    assert os.sched_getaffinity(0) == set(cpus)  # given back
    for mode in cr.PINNINGS:
        assert json.loads((tmp_path / mode / "result.json").read_text())["meta"]["pinning"] == mode
    combined = json.loads((tmp_path / "result.json").read_text())
    assert tuple(combined) == cr.BOTH_KEYS
    assert "pinned vs unpinned" in capsys.readouterr().out
