"""pd-bench's ``--endpoint /v1/chat/completions`` and ``/v1/completions`` (vLLM's ``openai-chat``
and ``openai`` bench backends) against pd-sim's aggregated OpenAI endpoints."""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks import BenchConfig, DatasetConfig, arun_benchmark
from benchmarks.cancel import CancelConfig
from benchmarks.client import CHAT_PATH, COMPLETIONS_PATH, ClientOptions, build_body
from benchmarks.datasets import RequestSpec
from benchmarks.runner import ConfigError
from tests.fixtures_sim import SimFactory


def cfg(url: str, endpoint: str, **kw: Any) -> BenchConfig:
    ds = DatasetConfig(num_requests=6, input_len=24, output_len=9, seed=3)
    return BenchConfig(
        url=url, dataset=ds, progress=False, request_timeout_s=30.0, endpoint_path=endpoint, **kw
    )


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("endpoint", [CHAT_PATH, COMPLETIONS_PATH])
async def test_openai_endpoint_counts_tokens_from_usage(
    sim_factory: SimFactory, endpoint: str, stream: bool
) -> None:
    sim = await sim_factory(enable_scale_out=True, itl_ms=2.0, prefill_base_ms=5.0, prefill_per_token_ms=0.0)
    res = await arun_benchmark(cfg(sim.url, endpoint, stream=stream, max_concurrency=2))
    d = res.data
    assert d["completed"] == 6 and d["failed"] == 0, d.get("errors")
    assert d["total_output_tokens"] == 6 * 9
    assert d["num_output_len_mismatch"] == 0
    if stream:
        assert d["mean_ttft_ms"] > 0 and d["mean_itl_ms"] > 0


def test_openai_bodies_are_vllms_bench_bodies() -> None:
    spec = RequestSpec(prompt=[3, 4, 5], output_len=7)
    chat = build_body(spec, "r1", ClientOptions(url="http://127.0.0.1:1", endpoint_path=CHAT_PATH))
    assert chat == {
        "messages": [{"role": "user", "content": "def"}],
        "max_completion_tokens": 7,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    cmpl = build_body(
        spec, "r1", ClientOptions(url="http://127.0.0.1:1", endpoint_path=COMPLETIONS_PATH, stream=False)
    )
    assert cmpl == {
        "prompt": [3, 4, 5],
        "max_tokens": 7,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": False,
    }


async def test_openai_error_is_a_failed_request(sim_factory: SimFactory) -> None:
    sim = await sim_factory(enable_scale_out=True, zero_latency=True)
    ds = DatasetConfig(num_requests=2, input_len=24, output_len=600, seed=3)
    res = await arun_benchmark(
        BenchConfig(url=sim.url, dataset=ds, progress=False, endpoint_path=CHAT_PATH, request_timeout_s=30.0)
    )
    assert res.data["completed"] == 0 and res.data["failed"] == 2


def test_openai_endpoint_refuses_generate_only_options() -> None:
    with pytest.raises(ConfigError, match="two-hop"):
        cfg("http://127.0.0.1:1", CHAT_PATH, two_hop=("http://127.0.0.1:1", "http://127.0.0.1:2")).check()
    with pytest.raises(ConfigError, match="abort"):
        cfg("http://127.0.0.1:1", CHAT_PATH, cancel=CancelConfig(rate=0.5, after_s=0.1, mode="abort")).check()
