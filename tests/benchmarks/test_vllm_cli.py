"""``vllm bench serve``'s command lines, meanings and result keys, as pd-bench takes them."""

from __future__ import annotations

import asyncio
import json
import math
import shlex
import subprocess
import sys
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestServer

from benchmarks import BenchConfig, DatasetConfig, arun_benchmark
from benchmarks.cli import _argv, build_parser, config_from_args, main
from benchmarks.loadgen import ramp_up_offsets, ramp_up_rates
from benchmarks.metrics import peak_concurrency, peak_output_tokens_per_s
from benchmarks.records import RequestRecord
from benchmarks.runner import RampUp, TargetNotReady, vllm_result_filename
from proxy.config.settings import ProxySettings
from proxy.http.app import build_app
from tests.benchmarks.scripted import SEEN, Script, echo_stream, make_app

ServerFactory = Callable[..., Awaitable[TestServer]]
SimFactory = Callable[..., Awaitable[Any]]

# A command line as vLLM's documentation writes them (``vllm bench serve`` + these flags).
VLLM_DOC_LINE = shlex.split(
    "--dataset-name random --random-input-len 32 --random-output-len 8 --num-prompts 8 "
    "--request-rate 4 --max-concurrency 4 --save-result --result-filename x.json "
    "--percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,99 --goodput ttft:500 tpot:50"
)

# The keys vLLM 0.32's `vllm bench serve` writes for VLLM_DOC_LINE (serve.py: main_async's run keys,
# benchmark()'s result without the --save-detailed lists, process_one_metric for the 4 metrics at
# p50 and p99).
VLLM_RESULT_KEYS = {
    "date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id", "num_prompts",
    "request_rate", "burstiness", "max_concurrency", "duration", "completed", "failed",
    "total_input_tokens", "total_output_tokens", "request_throughput", "request_goodput",
    "output_throughput", "total_token_throughput", "latencies", "queue_times",
    "max_output_tokens_per_s", "max_concurrent_requests", "rtfx",
} | {
    f"{s}_{m}_ms" for s in ("mean", "median", "std", "p50", "p99") for m in ("ttft", "tpot", "itl", "e2el")
}  # fmt: skip


async def test_a_vllm_doc_command_line_against_pd_sim_behind_pd_proxy(
    sim_factory: SimFactory,
    aiohttp_server: ServerFactory,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    p = await sim_factory(role="prefill", zero_latency=True)
    d = await sim_factory(role="decode", zero_latency=True)
    server = await aiohttp_server(build_app(ProxySettings(prefill_urls=(p.url,), decode_urls=(d.url,))))
    monkeypatch.chdir(tmp_path)  # --result-filename without --result-dir: the current directory
    argv = ["--base-url", f"http://127.0.0.1:{server.port}", *VLLM_DOC_LINE]  # no subcommand: run
    assert await asyncio.to_thread(main, argv) == 0
    data = json.loads((tmp_path / "x.json").read_text())
    assert set(data) >= VLLM_RESULT_KEYS, VLLM_RESULT_KEYS - set(data)
    # only the metrics and percentiles asked for, as vLLM; besides them pd-bench's own (the hops,
    # the second token's gap)
    stats = ("mean", "median", "std", "p50", "p90", "p95", "p99")
    stat_keys = {k for k in data if k.endswith("_ms") and k.split("_")[0] in stats}
    own = ("hop", "unattributed", "second_token_gap")
    assert {k for k in stat_keys if not any(o in k for o in own)} == {
        k for k in VLLM_RESULT_KEYS if k.endswith("_ms")
    }
    assert (data["num_prompts"], data["request_rate"], data["max_concurrency"]) == (8, 4.0, 4)
    assert data["completed"] == 8 and data["failed"] == 0
    assert (data["total_input_tokens"], data["total_output_tokens"]) == (8 * 32, 8 * 8)
    assert data["request_goodput"] is not None and data["goodput_slos_ms"] == {"ttft": 500.0, "tpot": 50.0}
    assert 1 <= data["max_concurrent_requests"] <= 4  # the cap held with the rate
    assert 0 < data["max_output_tokens_per_s"] <= 64
    assert len(data["latencies"]) == len(data["queue_times"]) == 8
    out = capsys.readouterr().out
    assert "Peak output token throughput (tok/s):" in out and "Peak concurrent requests:" in out


def _parse(*argv: str) -> BenchConfig:
    return config_from_args(build_parser().parse_args(_argv(list(argv))))


def test_vllm_flags_carry_vllm_meanings(tmp_path: Path) -> None:
    cfg = _parse(
        "--base-url", "http://127.0.0.1:9", "--seed", "7", "--num-prompts", "12", "--dataset-name", "random",
        "--random-input-len", "100", "--random-output-len", "20", "--random-range-ratio", "0.1",
        "--random-prefix-len", "5", "--request-rate", "3", "--max-concurrency", "2", "--burstiness", "0.5",
        "--num-warmups", "2", "--disable-tqdm", "--save-result", "--save-detailed", "--result-dir",
        str(tmp_path), "--result-filename", "r.json", "--metadata", "version=0.3.3", "tp=1", "--header",
        "x-a=1", "x-b=two", "--percentile-metrics", "ttft,e2el,client_queue_time", "--metric-percentiles",
        "25,50,99.9", "--goodput", "ttft:500", "tpot:50", "e2el:2000", "--ready-check-timeout-sec", "30",
        "--label", "lab", "--model", "tiny-llama", "--request-id-prefix", "bench-1-", "--endpoint",
        "/inference/v1/generate",
    )  # fmt: skip
    ds = cfg.dataset
    assert (ds.seed, ds.num_requests, ds.name, ds.input_len, ds.output_len) == (7, 12, "random", 100, 20)
    assert (ds.range_ratio, ds.random_prefix_len) == (0.1, 5)
    assert (cfg.request_rate, cfg.max_concurrency, cfg.burstiness) == (3.0, 2, 0.5)  # both: vLLM combines
    assert cfg.warmup == 2 and cfg.progress is False and cfg.save_result and cfg.save_detailed
    assert (cfg.result_dir, cfg.result_filename, cfg.label) == (str(tmp_path), "r.json", "lab")
    assert cfg.metadata == (("version", "0.3.3"), ("tp", "1"))
    assert cfg.headers == (("x-a", "1"), ("x-b", "two"))
    assert cfg.percentile_metrics == ("ttft", "e2el", "client_queue_time")
    assert cfg.percentiles == (25.0, 50.0, 99.9)
    assert cfg.goodput_ms == {"ttft": 500.0, "tpot": 50.0, "e2el": 2000.0}
    assert cfg.ready_check_timeout_s == 30.0 and cfg.model_id == "tiny-llama"
    assert cfg.request_id_prefix == "bench-1-" and cfg.url == "http://127.0.0.1:9"
    # --input-len/--output-len map onto the random dataset's lengths (and win, as in vLLM)
    general = _parse("--input-len", "40", "--random-input-len", "100", "--output-len", "4")
    assert (general.dataset.input_len, general.dataset.output_len) == (40, 4)
    # no --base-url: vLLM's --host/--port
    assert _parse("--host", "127.0.0.2", "--port", "8123").url == "http://127.0.0.2:8123"
    ramp = _parse("--ramp-up-strategy", "linear", "--ramp-up-start-rps", "1", "--ramp-up-end-rps", "5")
    assert ramp.ramp_up == RampUp("linear", 1.0, 5.0) and math.isinf(ramp.request_rate)


def test_pd_bench_spellings_stay_aliases() -> None:
    old = _parse(
        "run", "--url", "http://127.0.0.1:9", "--num-requests", "5", "--dataset", "random",
        "--input-len", "7", "--output-len", "3", "--range-ratio", "0.2", "--warmup", "1",
        "--percentiles", "50,99", "--no-progress", "--goodput", "ttft:500,tpot:50",
    )  # fmt: skip
    new = _parse(
        "serve", "--base-url", "http://127.0.0.1:9", "--num-prompts", "5", "--dataset-name", "random",
        "--random-input-len", "7", "--random-output-len", "3", "--random-range-ratio", "0.2",
        "--num-warmups", "1", "--metric-percentiles", "50,99", "--disable-tqdm", "--goodput", "ttft:500",
        "tpot:50",
    )  # fmt: skip
    # --output-len is vLLM's general output length: it sets the text datasets' lengths too
    assert (old.dataset.sharegpt_output_len, old.dataset.custom_output_len) == (3, 3)
    assert replace(old, dataset=replace(old.dataset, sharegpt_output_len=None, custom_output_len=256)) == new


def test_compare_takes_salt_per_target_and_run_does_not(capsys: pytest.CaptureFixture[str]) -> None:
    urls = ("--url", "http://127.0.0.1:9", "--url", "http://127.0.0.1:10")
    assert _parse("compare", *urls, "--salt-per-target").salt_per_target is True
    assert _parse("compare", *urls).salt_per_target is False
    with pytest.raises(SystemExit):  # one target has nobody to share a prefix cache with
        _parse("run", "--base-url", "http://127.0.0.1:9", "--salt-per-target")
    assert "--salt-per-target" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--metadata", "version"], "Invalid metadata format. Please use KEY=VALUE format."),
        (["--header", "x-a"], "Invalid header format. Please use KEY=VALUE format."),
        (["--goodput", "ttft:500", "itl:5"], "goodput entries are KEY:MS"),
        (["--percentile-metrics", "ttft,latency"], "unknown metric(s) latency"),
        (["--dataset-path", "x.json"], "Cannot use 'random' dataset with --dataset-path"),
        (["--ramp-up-strategy", "linear", "--ramp-up-start-rps", "1"], "both --ramp-up-start-rps"),
        (
            [
                "--ramp-up-strategy",
                "linear",
                "--ramp-up-start-rps",
                "1",
                "--ramp-up-end-rps",
                "4",
                "--request-rate",
                "2",
            ],
            "When using ramp-up, do not specify --request-rate",
        ),
        (["--dataset-name", "sharegpt", "--dataset-path", "x.json"], "give a local tokenizer"),
        (["--cancel-rate", "0.5"], "exactly one of --cancel-at and --cancel-after"),
        (["--kv-settle"], "--kv-settle needs at least one --kv-probe"),
    ],
)
def test_bad_command_lines_say_what_is_wrong(
    extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--base-url", "http://127.0.0.1:9", "--num-prompts", "1", *extra])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_help_is_grouped_as_vllms(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for group in (
        "custom dataset options:",
        "sharegpt dataset options:",
        "random dataset options:",
        "cancellation:",
        "KV probes:",
    ):
        assert group in text
    for flag in (
        "--num-prompts",
        "--dataset-name",
        "--random-input-len",
        "--random-range-ratio",
        "--goodput",
        "--percentile-metrics",
        "--metric-percentiles",
        "--num-warmups",
        "--disable-tqdm",
        "--save-result",
        "--result-filename",
        "--metadata",
        "--ramp-up-strategy",
        "--header",
        "--ready-check-timeout-sec",
        "--tokenizer",
        "--sharegpt-output-len",
        "--custom-output-len",
    ):
        assert flag in text
    # vLLM's top-level options come before its dataset groups
    assert text.index("--ready-check-timeout-sec") < text.index("random dataset options:")


def test_the_command_line_imports_nothing_heavy() -> None:
    code = (
        "import sys, benchmarks.cli as c; c.build_parser().format_help(); "
        "heavy = [m for m in ('numpy', 'matplotlib', 'tokenizers', 'jinja2') if m in sys.modules]; "
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2])


def test_ramp_up_rates_follow_vllm() -> None:
    assert ramp_up_rates(5, "linear", 1.0, 5.0) == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert ramp_up_rates(3, "exponential", 1.0, 4.0) == pytest.approx([1.0, 2.0, 4.0])
    offsets = ramp_up_offsets([1.0, 2.0, 4.0], math.inf)
    assert offsets == pytest.approx([0.0, 0.5, 0.75])  # evenly spaced at the rate in force
    with pytest.raises(ValueError):
        ramp_up_rates(3, "linear", 0.0, 4.0)


async def test_ramp_up_run_writes_vllms_ramp_keys(aiohttp_server: ServerFactory, tmp_path: Path) -> None:
    app = make_app(echo_stream)
    server = await aiohttp_server(app)
    cfg = BenchConfig(
        url=f"http://127.0.0.1:{server.port}",
        dataset=DatasetConfig(num_requests=6, input_len=4, output_len=2),
        progress=False,
        ramp_up=RampUp("linear", 20.0, 60.0),
        burstiness=math.inf,
        save_result=True,
        result_dir=str(tmp_path),
        plots=False,
        max_concurrency=2,
    )
    res = await arun_benchmark(cfg)
    path = res.files["result_json"]
    assert path.name == vllm_result_filename(cfg, res.data["date"])
    assert path.name.startswith("pd-generate-ramp-up-linear-20qps-60qps-concurrency2-pd-generate-")
    data = json.loads(path.read_text())
    assert (data["ramp_up_strategy"], data["ramp_up_start_rps"], data["ramp_up_end_rps"]) == (
        "linear",
        20,
        60,
    )
    assert [e["rps"] for e in data["rps_change_events"]] == list(range(20, 61))
    assert data["completed"] == 6 and len(app[SEEN].bodies) == 6


def test_vllms_default_result_file_name() -> None:
    cfg = BenchConfig(url="http://x:1", request_rate=4.0, max_concurrency=4, model_id="org/tiny-llama")
    assert vllm_result_filename(cfg, "20261204-120000") == (
        "pd-generate-4.0qps-concurrency4-tiny-llama-20261204-120000.json"
    )
    assert (
        vllm_result_filename(BenchConfig(url="http://x:1", label="l"), "d") == "l-infqps-pd-generate-d.json"
    )


async def test_metadata_and_headers_reach_the_result_and_the_wire(
    aiohttp_server: ServerFactory, tmp_path: Path
) -> None:
    app = make_app(echo_stream)
    server = await aiohttp_server(app)
    argv = [
        "--base-url", f"http://127.0.0.1:{server.port}", "--num-prompts", "2", "--input-len", "4",
        "--output-len", "2", "--disable-tqdm", "--metadata", "version=0.3.3", "tp=1", "--header",
        "x-extra=1", "X-Request-Id=theirs", "--save-result", "--result-dir", str(tmp_path),
    ]  # fmt: skip
    assert await asyncio.to_thread(main, argv) == 0
    (path,) = await asyncio.to_thread(lambda: list(tmp_path.glob("pd-generate-infqps-pd-generate-*.json")))
    data = json.loads(path.read_text())
    assert (data["version"], data["tp"]) == ("0.3.3", "1")
    keys = list(data)
    assert keys.index("num_prompts") < keys.index("version") < keys.index("request_rate")  # vLLM's order
    for headers, body in zip(app[SEEN].headers, app[SEEN].bodies, strict=True):
        assert headers["x-extra"] == "1"
        assert headers["X-Request-Id"] == body["request_id"]  # pd-bench's own header wins, as in vLLM


async def test_ready_check_waits_for_a_success(aiohttp_server: ServerFactory) -> None:
    calls: list[int] = []

    def script(body: dict[str, Any]) -> Script:
        calls.append(1)
        return Script(status=503) if len(calls) == 1 else echo_stream(body)

    server = await aiohttp_server(make_app(script))
    ds = DatasetConfig(num_requests=2, input_len=4, output_len=2)
    cfg = BenchConfig(
        url=f"http://127.0.0.1:{server.port}", dataset=ds, progress=False, ready_check_timeout_s=30.0
    )
    res = await arun_benchmark(cfg)
    assert res.data["completed"] == 2 and len(calls) == 4  # a failed and a passed check, then the run
    with pytest.raises(TargetNotReady):
        await arun_benchmark(
            BenchConfig(
                url="http://127.0.0.1:9",
                progress=False,
                ready_check_timeout_s=0.5,
                dataset=DatasetConfig(num_requests=1),
            )
        )


def test_peaks_as_vllm_defines_them() -> None:
    def rec(start: float, e2e: float, chunks: list[tuple[float, int]]) -> RequestRecord:
        r = RequestRecord(0, "r", "t", 4, 4, success=True, start_s=start, e2e_s=e2e, ttft_s=chunks[0][0])
        r.chunk_times_s = [t for t, _ in chunks]
        r.chunk_tokens = [n for _, n in chunks]
        return r

    a = rec(0.0, 1.5, [(0.2, 1), (0.4, 2), (1.4, 1)])  # tokens at 0.2, 0.4 (x2), 1.4
    b = rec(0.5, 1.0, [(0.1, 3), (0.9, 1)])  # tokens at 0.6 (x3), 1.4
    c = rec(1.5, 0.5, [(0.2, 1)])  # starts when a ends: half-open intervals do not overlap
    assert peak_output_tokens_per_s([a, b, c]) == 6.0  # second 0: 1 + 2 + 3
    assert peak_concurrency([a, b, c]) == 2
    assert peak_output_tokens_per_s([]) == 0.0 and peak_concurrency([]) == 0
