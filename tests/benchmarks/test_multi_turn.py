"""Multi-turn conversations: the dataset's shape, the runner against pd-sim (turn k+1 carries
turn k's actual answer and is sent only after it), and ``pd-bench --dataset-name multi-turn``
through pd-proxy to a pd-sim P/D pair (per-turn TTFT, the prefill worker's prefix-cache hit rate)."""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from benchmarks import cli
from benchmarks.conversations import run_conversations
from benchmarks.datasets import DatasetError, interleaved_turns, multi_turn_dataset, next_turn_prompt
from benchmarks.multi_turn import MultiTurnConfig, arun_multi_turn, multi_turn_config, summary
from proxy.config.settings import ProxySettings
from proxy.http.app import build_app
from tests.fixtures_sim import SimFactory

GEN = "/inference/v1/generate"


def test_dataset_shares_the_system_prompt_and_is_deterministic() -> None:
    convs = multi_turn_dataset(3, 4, user_len=5, output_len=2, system_len=40, seed=7)
    assert convs == multi_turn_dataset(3, 4, user_len=5, output_len=2, system_len=40, seed=7)
    assert len({tuple(c.system) for c in convs}) == 1 and len(convs[0].system) == 40
    assert all(len(c.users) == 4 and all(len(u) == 5 for u in c.users) for c in convs)
    assert len({tuple(c.users[0]) for c in convs}) == 3
    assert interleaved_turns(convs)[:4] == [(0, 0), (1, 0), (2, 0), (0, 1)]
    first = next_turn_prompt(None, [], convs[0], 0)
    assert first == convs[0].system + convs[0].users[0]
    assert next_turn_prompt(first, [9, 9], convs[0], 1) == first + [9, 9] + convs[0].users[1]
    with pytest.raises(DatasetError):
        next_turn_prompt(None, [1], convs[0], 1)
    with pytest.raises(DatasetError):
        multi_turn_dataset(0, 1, user_len=1, output_len=1)


async def prefix_hits(session: aiohttp.ClientSession, url: str) -> float:
    async with session.get(url + "/metrics") as r:
        text = await r.text()
    return sum(s.value for f in text_string_to_metric_families(text) if f.name == "vllm:prefix_cache_hits"
               for s in f.samples if s.name.endswith("_total"))


async def test_each_turn_carries_the_previous_answer_and_waits_for_it(sim_factory: SimFactory) -> None:
    sim = await sim_factory(role="aggregated", block_size=16, zero_latency=True, itl_ms=1.0)
    convs = multi_turn_dataset(3, 3, user_len=8, output_len=5, system_len=48, seed=1)
    async with aiohttp.ClientSession() as session:
        records = await run_conversations(session, sim.url + GEN, convs, max_concurrency=2)
        hits = await prefix_hits(session, sim.url)
    assert all(r.success for r in records) and len(records) == 9
    by = {(r.conversation, r.turn): r for r in records}
    for c in convs:
        for t in range(1, 3):
            prev, cur = by[(c.index, t - 1)], by[(c.index, t)]
            assert len(prev.answer) == 5
            assert cur.prompt == prev.prompt + prev.answer + c.users[t]
            assert cur.order > prev.order  # sent after the previous turn finished
            assert cur.start_s >= prev.start_s + (prev.e2e_s or 0.0)
    # Later turns and other conversations reuse the cached system prompt and history.
    assert hits >= 3 * 48


async def test_a_failed_turn_ends_its_conversation_only(sim_factory: SimFactory) -> None:
    sim = await sim_factory(role="aggregated", zero_latency=True, faults={"fail_next": 1})
    convs = multi_turn_dataset(2, 3, user_len=4, output_len=2, seed=2)
    async with aiohttp.ClientSession() as session:
        records = await run_conversations(session, sim.url + GEN, convs, max_concurrency=1)
    failed = [r for r in records if r.error]
    assert len(failed) == 1 and "HTTP 500" in (failed[0].error or "")
    later = [r for r in records if r.conversation == failed[0].conversation and r.turn > failed[0].turn]
    assert all(not r.sent for r in later)
    other = [r for r in records if r.conversation != failed[0].conversation]
    assert all(r.success for r in other)


# --------------------------------------------------------------------------------------------
# pd-bench --dataset-name multi-turn: through pd-proxy to a pd-sim P/D pair.


async def _pd_stack(sim_factory: SimFactory, aiohttp_server: Any) -> tuple[Any, str]:
    p = await sim_factory(role="prefill", block_size=16, zero_latency=True, itl_ms=1.0)
    d = await sim_factory(role="decode", block_size=16, zero_latency=True, itl_ms=1.0)
    server = await aiohttp_server(build_app(ProxySettings(prefill_urls=(p.url,), decode_urls=(d.url,))))
    return p, f"http://127.0.0.1:{server.port}"


async def prefix_counters(url: str) -> tuple[float, float]:
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        text = await r.text()
    fams = {f.name: sum(x.value for x in f.samples if x.name.endswith("_total"))
            for f in text_string_to_metric_families(text)}
    return fams["vllm:prefix_cache_queries"], fams["vllm:prefix_cache_hits"]


async def test_pd_bench_multi_turn_reports_per_turn_ttft_and_the_prefill_hit_rate(
    sim_factory: SimFactory, aiohttp_server: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    p, url = await _pd_stack(sim_factory, aiohttp_server)
    q0, h0 = await prefix_counters(p.url)  # pd-proxy's start-up reads; no prompt yet
    argv = ["--base-url", url, "--dataset-name", "multi-turn", "--num-conversations", "3",
            "--num-turns", "3", "--system-prompt-len", "48", "--turn-input-len", "8", "--output-len", "5",
            "--max-concurrency", "2", "--seed", "4", "--prefill-workers", p.url,
            "--result-dir", str(tmp_path), "--result-filename", "mt.json"]  # fmt: skip
    # pd-bench runs its own event loop: in a thread, while this loop serves the proxy and the workers
    assert await asyncio.to_thread(cli.main, argv) == 0
    out = capsys.readouterr().out
    result = json.loads((tmp_path / "mt.json").read_text())
    assert (result["completed"], result["failed"], result["not_sent"]) == (9, 0, 0)
    rows = result["per_turn"]
    assert [r["turn"] for r in rows] == [0, 1, 2] and all(r["completed"] == 3 for r in rows)
    # every turn's prompt carries the history: the system prompt, then (user + answer) per turn
    assert [r["mean_prompt_tokens"] for r in rows] == [48 + 8, 48 + 8 + 5 + 8, 48 + 2 * (8 + 5) + 8]
    for r in rows:  # streamed: a TTFT per turn, before the answer's end
        assert 0 < r["p50_ttft_ms"] <= r["p99_ttft_ms"] and r["p50_ttft_ms"] < r["p50_e2el_ms"]
    assert all(t["ttft_ms"] < t["e2el_ms"] and t["answer_tokens"] == 5 for t in result["turns"])
    # the hit rate over the run is the prefill worker's own counters' growth
    q1, h1 = await prefix_counters(p.url)
    cache = result["prefix_cache"]
    assert cache["queries"] == q1 - q0 == sum(t["prompt_tokens"] for t in result["turns"])
    assert cache["hits"] == h1 - h0 >= 2 * 48  # later conversations find the shared system prompt
    assert cache["hit_rate"] == pytest.approx((h1 - h0) / (q1 - q0))
    assert "| 2 | 3/3 |" in out and f"{cache['hit_rate']:.1%}" in out and "prefix-cache hit rate" in out


async def test_a_prefill_worker_without_metrics_gives_no_hit_rate(
    sim_factory: SimFactory, aiohttp_server: Any
) -> None:
    _, url = await _pd_stack(sim_factory, aiohttp_server)
    with socket.socket() as closed:  # a loopback port nobody listens on
        closed.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{closed.getsockname()[1]}"
    cfg = MultiTurnConfig(url=url, conversations=2, turns=2, system_len=16, user_len=4, output_len=2,
                          prefill_workers=(dead,), request_timeout_s=30.0)
    result = await arun_multi_turn(cfg)
    assert result["completed"] == 4
    assert result["prefix_cache"]["hit_rate"] is None
    assert result["prefix_cache"]["workers"][dead] == {"queries": None, "hits": None, "hit_rate": None}
    assert "no /metrics answer" in summary(result)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--request-rate", "2"], "does not take --request-rate"),
        (["--no-stream"], "does not take --no-stream"),
        (["--endpoint", "/v1/completions"], "does not take --endpoint"),
        (["--num-conversations", "0"], "multi-turn needs conversations"),
    ],
)
def test_multi_turn_refuses_options_it_would_ignore(
    extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["--base-url", "http://127.0.0.1:9", "--dataset-name", "multi-turn", *extra])
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_multi_turn_is_a_run_only_and_takes_input_len_as_the_turn_length(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        cli.main(["sweep", "--dataset-name", "multi-turn", "--concurrencies", "1,2"])
    assert "pd-bench run" in capsys.readouterr().err
    args = cli.build_parser().parse_args(["run", "--dataset-name", "multi-turn", "--input-len", "32",
                                          "--api-key", "k-1"])
    cfg = multi_turn_config(args)
    assert (cfg.user_len, cfg.output_len, cfg.system_len, cfg.conversations, cfg.turns) == (32, 64, 256, 8, 4)
    assert cfg.api_key == "k-1" and cfg.prefill_workers == ()
