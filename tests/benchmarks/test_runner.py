"""Whole runs against scripted servers: result files, golden keys, load shapes, compare, sweep, CLI."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestServer

from benchmarks import BenchConfig, DatasetConfig, arun_benchmark, arun_compare, arun_sweep, summary_text
from benchmarks.cli import main
from benchmarks.runner import ConfigError
from tests.benchmarks.scripted import SEEN, Script, ScriptFn, echo_stream, make_app, stream_of

ServerFactory = Callable[..., Awaitable[TestServer]]

# The result JSON's keys with the default percentiles (50, 90, 95, 99), without --goodput,
# --save-detailed or per-hop timings. vllm bench serve's names where vllm has the metric.
GOLDEN_KEYS = {
    # run metadata (vllm bench serve's)
    "date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id", "num_prompts",
    "request_rate", "burstiness", "max_concurrency",
    # pd-bench's own metadata
    "base_url", "endpoint", "dataset_name", "input_len", "output_len", "range_ratio", "seed",
    "stream", "output_mode", "warmup", "time_limit", "percentiles",
    # totals and throughputs (vllm's)
    "duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
    "request_throughput", "request_goodput", "output_throughput", "total_token_throughput",
    # vllm's peaks, its per-request lists kept without --save-detailed, its ASR factor
    "max_output_tokens_per_s", "max_concurrent_requests", "latencies", "queue_times", "rtfx",
    # pd-bench's own
    "failures", "num_output_len_mismatch", "server_timing_requests", "hops",
    "client_cpu_seconds", "client_cpu_utilization", "percentile_metrics",
}  # fmt: skip
for _m in ("ttft", "tpot", "itl", "itl_token", "e2el", "second_token_gap"):
    GOLDEN_KEYS |= {f"{s}_{_m}_ms" for s in ("mean", "median", "std", "p50", "p90", "p95", "p99")}
VLLM_KEYS = {
    "duration", "completed", "failed", "total_input_tokens", "total_output_tokens", "request_throughput",
    "request_goodput", "output_throughput", "total_token_throughput", "mean_ttft_ms", "median_ttft_ms",
    "std_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "std_tpot_ms", "p99_tpot_ms",
    "mean_itl_ms", "median_itl_ms", "std_itl_ms", "p99_itl_ms", "mean_e2el_ms", "median_e2el_ms",
    "std_e2el_ms", "p99_e2el_ms", "date", "backend", "num_prompts", "request_rate", "burstiness",
    "max_concurrency", "max_output_tokens_per_s", "max_concurrent_requests",
}  # fmt: skip


async def serve(aiohttp_server: ServerFactory, script: ScriptFn = echo_stream) -> tuple[str, Any]:
    app = make_app(script)
    server = await aiohttp_server(app)
    return f"http://127.0.0.1:{server.port}", app


def cfg(url: str, n: int = 6, **kw: Any) -> BenchConfig:
    ds = DatasetConfig(num_requests=n, input_len=8, output_len=3, seed=1)
    return BenchConfig(url=url, dataset=ds, progress=False, **kw)


def test_golden_keys_cover_vllm() -> None:
    assert VLLM_KEYS <= GOLDEN_KEYS


async def test_run_writes_result_files_with_golden_keys(
    aiohttp_server: ServerFactory, tmp_path: Path
) -> None:
    url, app = await serve(aiohttp_server)
    res = await arun_benchmark(cfg(url, max_concurrency=2, result_dir=str(tmp_path), label="golden"))
    data = json.loads(res.files["result_json"].read_text())
    assert set(data) == GOLDEN_KEYS
    assert data["completed"] == 6
    assert data["failed"] == 0
    assert data["total_output_tokens"] == 18
    assert data["request_rate"] == "inf"
    assert data["max_concurrency"] == 2
    lines = res.files["records_jsonl"].read_text().splitlines()
    assert len(lines) == 6
    assert {json.loads(x)["request_id"] for x in lines} == {b["request_id"] for b in app[SEEN].bodies}
    assert res.files["cdf_png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "hops_png" not in res.files  # the server reported no per-hop timings
    text = summary_text(res)
    assert "Successful requests:" in text and "TTFT" in text and str(res.files["result_json"]) in text


async def test_goodput_and_detailed_keys(aiohttp_server: ServerFactory, tmp_path: Path) -> None:
    url, _ = await serve(aiohttp_server)
    res = await arun_benchmark(
        cfg(url, goodput_ms={"e2el": 60_000.0}, save_detailed=True, result_dir=str(tmp_path), plots=False)
    )
    data = json.loads(res.files["result_json"].read_text())
    assert set(data) - GOLDEN_KEYS == {
        "goodput_fraction", "goodput_slos_ms", "input_lens", "output_lens", "ttfts", "itls",
        "start_times", "errors",
    }  # fmt: skip
    assert data["goodput_fraction"] == 1.0
    assert len(data["itls"]) == 6 and all(len(x) == 2 for x in data["itls"])
    assert "cdf_png" not in res.files


async def test_failures_are_counted_by_kind(aiohttp_server: ServerFactory) -> None:
    def script(body: dict[str, Any]) -> Script:
        i = int(str(body["request_id"]).rsplit("-", 1)[1])
        if i % 3 == 0:
            return Script(status=500)
        if i % 3 == 1:
            return Script(steps=stream_of(str(body["request_id"]), [1, 1, 1])[:-1])  # no [DONE]
        return echo_stream(body)

    url, _ = await serve(aiohttp_server, script)
    res = await arun_benchmark(cfg(url, n=9))
    assert res.data["completed"] == 3
    assert res.data["failed"] == 6
    assert res.data["failures"]["http_status"] == 3
    assert res.data["failures"]["no_done"] == 3


async def test_concurrency_cap_is_respected(aiohttp_server: ServerFactory) -> None:
    url, app = await serve(aiohttp_server, lambda b: Script(steps=stream_of("x", [1, 1, 1], gap_s=0.01)))
    res = await arun_benchmark(cfg(url, n=10, max_concurrency=3))
    assert res.data["completed"] == 10
    assert app[SEEN].max_in_flight <= 3


async def test_time_limit_stops_sending(aiohttp_server: ServerFactory) -> None:
    url, app = await serve(aiohttp_server)
    res = await arun_benchmark(cfg(url, n=1000, request_rate=20.0, burstiness=math.inf, time_limit_s=0.3))
    sent = len(app[SEEN].bodies)
    assert 1 <= sent < 1000
    assert res.data["completed"] == sent  # requests already sent were allowed to finish


async def test_warmup_is_not_counted(aiohttp_server: ServerFactory) -> None:
    url, app = await serve(aiohttp_server)
    res = await arun_benchmark(cfg(url, n=4, warmup=2))
    assert len(app[SEEN].bodies) == 6
    assert res.data["completed"] == 4
    assert len(res.records) == 4
    assert all("warmup" not in r.request_id for r in res.records)
    assert sum("warmup" in b["request_id"] for b in app[SEEN].bodies) == 2


async def test_server_timing_dropped_when_request_id_does_not_match(aiohttp_server: ServerFactory) -> None:
    comment = (
        b": server-timing queue;dur=1, prefill;dur=2, handoff;dur=3, decode_ttft;dur=4, total;dur=10\n\n"
    )

    def script(body: dict[str, Any]) -> Script:
        rid = str(body["request_id"])
        steps = stream_of(rid, [1, 1, 1])
        echoed = rid if rid.endswith("-0") else "someone-else"
        return Script(steps=[*steps[:-1], (0, comment), steps[-1]], headers={"X-Request-Id": echoed})

    url, _ = await serve(aiohttp_server, script)
    res = await arun_benchmark(cfg(url, n=3))
    assert res.data["server_timing_requests"] == 1
    assert res.data["mean_hop_prefill_ms"] == 2.0
    assert res.data["hops"] == ["queue", "prefill", "handoff", "decode_ttft", "total"]


async def test_compare_interleaves_the_same_requests(aiohttp_server: ServerFactory, tmp_path: Path) -> None:
    url_a, app_a = await serve(aiohttp_server)
    url_b, app_b = await serve(aiohttp_server)
    res = await arun_compare(cfg(url_a, n=5, max_concurrency=1, result_dir=str(tmp_path)), [url_a, url_b])
    prompts_a = [b["token_ids"] for b in app_a[SEEN].bodies]
    prompts_b = [b["token_ids"] for b in app_b[SEEN].bodies]
    assert sorted(map(tuple, prompts_a)) == sorted(map(tuple, prompts_b))
    assert len(prompts_a) == 5
    assert [r.data["completed"] for r in res.results] == [5, 5]
    assert res.ratios["failed"] is None  # 0 failures on the baseline: no ratio
    for r in res.results:  # each target's duration is its own first send to last answer
        assert r.data["duration"] == pytest.approx(
            max(x.start_s + (x.e2e_s or 0.0) for x in r.records) - min(x.start_s for x in r.records)
        )
    assert res.ratios["request_throughput"] == pytest.approx(
        res.results[1].data["request_throughput"] / res.results[0].data["request_throughput"]
    )
    assert res.files["compare_cdf_png"].exists()
    assert "ratio" in summary_text(res)
    with pytest.raises(ConfigError):
        await arun_compare(cfg(url_a), [url_a])


@pytest.mark.parametrize("per_target", [False, True])
async def test_compare_salts_each_target_apart_when_asked(
    aiohttp_server: ServerFactory, per_target: bool
) -> None:
    # Two proxies in front of the same workers get the same prompts: with salt_per_target each
    # target's requests (warm-ups too) carry a cache_salt of their own, so neither is served from the
    # prefix cache the other filled; without it no salt is sent (vLLM's request as it was).
    url_a, app_a = await serve(aiohttp_server)
    url_b, app_b = await serve(aiohttp_server)
    await arun_compare(cfg(url_a, n=3, warmup=1, max_concurrency=1, salt_per_target=per_target),
                       [url_a, url_b])
    salts_a = {b.get("cache_salt") for b in app_a[SEEN].bodies}
    salts_b = {b.get("cache_salt") for b in app_b[SEEN].bodies}
    assert len(app_a[SEEN].bodies) == len(app_b[SEEN].bodies) == 4  # 3 measured + 1 warm-up each
    if per_target:
        assert len(salts_a) == len(salts_b) == 1 and salts_a.isdisjoint(salts_b) and None not in salts_a
    else:
        assert salts_a == salts_b == {None}


async def test_sweep_over_concurrency(aiohttp_server: ServerFactory, tmp_path: Path) -> None:
    url, _ = await serve(aiohttp_server)
    sw = await arun_sweep(cfg(url, n=4, result_dir=str(tmp_path), label="sw"), concurrencies=[1, 2])
    assert sw.loads == [1.0, 2.0]
    assert [p.data["max_concurrency"] for p in sw.points] == [1, 2]
    for key in ("sweep_json", "sweep_png", "sweep_cdf_png"):
        assert sw.files[key].exists()
    summary = json.loads(sw.files["sweep_json"].read_text())
    assert [p["load"] for p in summary] == [1.0, 2.0]
    with pytest.raises(ConfigError):
        await arun_sweep(cfg(url), rates=[1.0], concurrencies=[1])
    with pytest.raises(ConfigError):
        await arun_sweep(cfg(url), rates=[0.0])


async def test_cli_rate_sweep_with_a_concurrency_cap(aiohttp_server: ServerFactory, tmp_path: Path) -> None:
    url, app = await serve(aiohttp_server)
    argv = [
        "sweep", "--url", url, "--request-rates", "50,inf", "--max-concurrency", "2", "--num-requests", "4",
        "--input-len", "5", "--output-len", "2", "--no-progress", "--result-dir", str(tmp_path),
    ]  # fmt: skip
    assert await asyncio.to_thread(main, argv) == 0
    assert len(app[SEEN].bodies) == 8
    assert app[SEEN].max_in_flight <= 2
    text = await asyncio.to_thread(lambda: next(tmp_path.glob("*-sweep.json")).read_text())
    points = json.loads(text, parse_constant=lambda c: pytest.fail(f"not strict JSON: {c}"))
    assert [(p["load"], p["request_rate"], p["max_concurrency"]) for p in points] == [
        (50.0, 50.0, 2),
        ("inf", "inf", 2),
    ]


@pytest.mark.parametrize(
    "bad",
    [
        {"url": "127.0.0.1:8000"},
        {"request_rate": 0.0},
        {"max_concurrency": 0},
        {"output_mode": "derender"},
        {"burstiness": -1.0},
        {"time_limit_s": 0.0},
    ],
)
async def test_bad_config_is_rejected(bad: dict[str, Any]) -> None:
    base = {"url": "http://127.0.0.1:9"} | bad
    url = base.pop("url")
    with pytest.raises(ConfigError):
        await arun_benchmark(cfg(str(url), **base))


async def test_cli_run(
    aiohttp_server: ServerFactory, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url, app = await serve(aiohttp_server)
    # main() runs its own event loop: call it from a worker thread of this test's loop.
    argv = [
        "run", "--url", url, "--dataset", "random", "--input-len", "10", "--output-len", "2",
        "--num-requests", "3", "--max-concurrency", "2", "--result-dir", str(tmp_path),
        "--no-progress", "--goodput", "ttft:60000", "--api-key", "k", "--output-mode", "text",
    ]  # fmt: skip
    rc = await asyncio.to_thread(main, argv)
    assert rc == 0
    out = capsys.readouterr().out
    assert "Successful requests:" in out and "Request goodput" in out
    assert len(app[SEEN].bodies) == 3
    assert all(b["output_mode"] == "text" and len(b["token_ids"]) == 10 for b in app[SEEN].bodies)
    written = await asyncio.to_thread(lambda: sorted(p.suffix for p in tmp_path.iterdir()))
    assert written == [".json", ".jsonl", ".png"]


@pytest.mark.parametrize(
    "argv",
    [
        ["run", "--url", "http://127.0.0.1:9", "--goodput", "ttft"],
        ["run", "--url", "http://127.0.0.1:9", "--dataset", "trace"],
        ["sweep", "--url", "http://127.0.0.1:9"],
        ["sweep", "--url", "http://127.0.0.1:9", "--concurrencies", "1,0"],
    ],
)
def test_cli_rejects_bad_arguments(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert "error" in capsys.readouterr().err


async def test_trace_replay_keeps_the_schedule(aiohttp_server: ServerFactory, tmp_path: Path) -> None:
    url, app = await serve(aiohttp_server)
    trace = tmp_path / "t.jsonl"
    rows = [(300, 4, 2), (0, 3, 1), (100, 5, 3)]  # (ms, input, output), out of order on purpose
    await asyncio.to_thread(
        trace.write_text,
        "\n".join(json.dumps({"timestamp": t, "input_length": i, "output_length": o}) for t, i, o in rows),
    )
    ds = DatasetConfig(name="trace", path=str(trace), num_requests=10, trace_time_unit="ms")
    res = await arun_benchmark(BenchConfig(url=url, dataset=ds, progress=False))
    assert [r.scheduled_s for r in res.records] == pytest.approx([0.0, 0.1, 0.3])
    assert [len(b["token_ids"]) for b in app[SEEN].bodies] == [3, 5, 4]  # sent in timestamp order
    assert all(r.start_s >= r.scheduled_s for r in res.records)
    assert res.data["total_output_tokens"] == 6
