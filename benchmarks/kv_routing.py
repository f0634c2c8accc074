"""Prefill routing policies on multi-turn conversations on loopback: pd-sim prefill workers (in
this process; prefix caching, KV events on) and decode workers behind a pd-proxy process, run once
per policy with cold caches. Reports the prefill workers' prefix-cache hit rate (their own
``vllm:prefix_cache_hits`` / ``vllm:prefix_cache_queries``) and TTFT (first streamed chunk).

    python -m benchmarks.kv_routing --prefill 16 --conversations 40 --turns 4

``oracle`` pins each conversation to one prefill worker (the ``session`` policy keyed by the
conversation). Every loop is bounded (turns, conversations, a timeout per request).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.datasets import Conversation, multi_turn_dataset, next_turn_prompt
from benchmarks.sim_stack import free_port, stop_all, wait_ready
from kv_transfer.kv_events import KvEventsConfig, loopback_bind_endpoint
from workers.sim import SimSettings
from workers.sim import build_app as build_sim
from workers.sim.server import KV_EVENTS

POLICIES = ("round_robin", "least_loaded", "prefix", "kv_events", "oracle")


@dataclass(frozen=True)
class Setup:
    prefill: int
    decode: int
    conversations: int
    turns: int
    system_len: int
    user_len: int
    output_len: int
    concurrency: int
    block_size: int
    kv_blocks: int
    prefill_per_token_ms: float
    timeout_s: float = 60.0
    proxy_args: tuple[str, ...] = ()
    """More pd-proxy flags (e.g. ``--use-scraped-load``)."""


async def _serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = next(int(a[1]) for a in runner.addresses if isinstance(a, tuple))
    return runner, f"http://127.0.0.1:{port}"


@contextlib.asynccontextmanager
async def stack(setup: Setup, policy: str) -> AsyncIterator[tuple[str, list[str]]]:
    """The workers and the proxy for one run: (proxy URL, prefill URLs)."""
    runners: list[web.AppRunner] = []
    procs: list[subprocess.Popen[bytes]] = []
    common: dict[str, Any] = {"block_size": setup.block_size, "max_model_len": 4096, "itl_ms": 1.0,
                              "prefill_base_ms": 1.0, "prefill_per_token_ms": setup.prefill_per_token_ms}
    try:
        prefill, specs = [], []
        for _ in range(setup.prefill):
            app = build_sim(SimSettings(role="prefill", num_kv_blocks=setup.kv_blocks, **common,
                                        kv_events=KvEventsConfig(enable_kv_cache_events=True,
                                                                 endpoint=loopback_bind_endpoint(0),
                                                                 replay_endpoint="tcp://127.0.0.1:0")))
            runner, url = await _serve(app)
            runners.append(runner)
            prefill.append(url)
            pub = app[KV_EVENTS]
            specs.append(f"{pub.endpoint},{pub.replay_endpoint}")
        decode = []
        for _ in range(setup.decode):
            runner, url = await _serve(build_sim(SimSettings(role="decode", **common)))
            runners.append(runner)
            decode.append(url)
        port = free_port()
        argv = [sys.executable, "-m", "proxy.cli", "--host", "127.0.0.1", "--port", str(port),
                "--prefill", *prefill, "--decode", *decode, "--log-level", "WARNING", "--no-active-health",
                "--prefill-policy", "session" if policy == "oracle" else policy]
        if policy == "kv_events":
            argv += ["--kv-events", *specs]
        argv += setup.proxy_args
        proc = _start(argv)
        procs.append(proc)
        url = f"http://127.0.0.1:{port}"
        await wait_ready(url, proc)
        if policy == "kv_events":
            await _feeds_usable(url, setup.prefill)
        yield url, prefill
    finally:
        stop_all(procs)
        for r in reversed(runners):
            await r.cleanup()


def _start(argv: list[str]) -> subprocess.Popen[bytes]:
    """The proxy's process (started once per run, before any request)."""
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


async def _feeds_usable(url: str, n: int) -> None:
    """Until the proxy follows every prefill worker's events (its ``pd_proxy_kv_events_usable``)."""
    async with aiohttp.ClientSession() as session:
        for _ in range(200):
            async with session.get(url + "/metrics") as r:
                text = await r.text()
            if text.count("pd_proxy_kv_events_usable{") == n and \
                    all(line.endswith(" 1.0") for line in text.splitlines()
                        if line.startswith("pd_proxy_kv_events_usable{")):
                return
            await asyncio.sleep(0.05)
    raise RuntimeError("the proxy did not connect to every worker's KV events")


async def _turn(session: aiohttp.ClientSession, url: str, prompt: list[int], conv: Conversation,
                *, turn: int, headers: dict[str, str]) -> tuple[float, list[int]]:
    """(TTFT in seconds, the answer's token ids) of one streamed turn."""
    body = {"request_id": f"c{conv.index}t{turn}", "token_ids": prompt, "stream": True,
            "sampling_params": {"max_tokens": conv.output_len, "temperature": 0.0, "ignore_eos": True}}
    t0 = time.perf_counter()
    ttft: float | None = None
    answer: list[int] = []
    async with session.post(url + "/inference/v1/generate", json=body, headers=headers) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {await r.text()}")
        async for line in r.content:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            if ttft is None:
                ttft = time.perf_counter() - t0
            for choice in json.loads(line[6:]).get("choices", []):
                answer += choice.get("token_ids") or []
    if ttft is None:
        raise RuntimeError("no chunk")
    return ttft, answer


async def _hit_rate(session: aiohttp.ClientSession, urls: Sequence[str]) -> tuple[float, float]:
    hits = queries = 0.0
    for u in urls:
        async with session.get(u + "/metrics") as r:
            text = await r.text()
        for f in text_string_to_metric_families(text):
            total = sum(s.value for s in f.samples if s.name.endswith("_total"))
            if f.name == "vllm:prefix_cache_hits":
                hits += total
            elif f.name == "vllm:prefix_cache_queries":
                queries += total
    return hits, queries


async def run_policy(setup: Setup, policy: str) -> dict[str, Any]:
    convs = multi_turn_dataset(setup.conversations, setup.turns, setup.user_len, setup.output_len,
                               system_len=setup.system_len, seed=7)
    ttfts: list[float] = []
    failed = 0
    sem = asyncio.Semaphore(setup.concurrency)
    async with stack(setup, policy) as (url, prefill), aiohttp.ClientSession() as session:

        async def converse(conv: Conversation) -> None:
            nonlocal failed
            prompt: list[int] | None = None
            answer: list[int] = []
            headers = {"X-Session-ID": f"conv-{conv.index}"} if policy == "oracle" else {}
            for turn in range(len(conv.users)):
                prompt = next_turn_prompt(prompt, answer, conv, turn)
                async with sem:
                    try:
                        ttft, answer = await asyncio.wait_for(
                            _turn(session, url, prompt, conv, turn=turn, headers=headers), setup.timeout_s)
                    except (aiohttp.ClientError, RuntimeError, TimeoutError, ValueError):
                        failed += 1
                        return
                ttfts.append(ttft)

        await asyncio.gather(*(converse(c) for c in convs))
        hits, queries = await _hit_rate(session, prefill)
    qs = statistics.quantiles(ttfts, n=100) if len(ttfts) > 1 else [0.0] * 99
    return {"policy": policy, "turns": len(ttfts), "failed": failed,
            "hit_rate": hits / queries if queries else 0.0,
            "ttft_p50_ms": qs[49] * 1000, "ttft_p99_ms": qs[98] * 1000}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    p.add_argument("--prefill", type=int, default=16)
    p.add_argument("--decode", type=int, default=2)
    p.add_argument("--conversations", type=int, default=40)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-len", type=int, default=256, help="shared system prompt (tokens)")
    p.add_argument("--user-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-blocks", type=int, default=128, help="KV blocks per prefill worker")
    p.add_argument("--prefill-per-token-ms", type=float, default=0.2,
                   help="pd-sim's prefill time per uncached prompt token")
    p.add_argument("--proxy-args", default="", help="more pd-proxy flags, space-separated")
    a = p.parse_args(argv)
    setup = Setup(a.prefill, a.decode, a.conversations, a.turns, a.system_len, a.user_len, a.output_len,
                  a.concurrency, a.block_size, a.kv_blocks, a.prefill_per_token_ms,
                  proxy_args=tuple(a.proxy_args.split()))
    print("| policy | turns | failed | P prefix-cache hit rate | TTFT p50 ms | TTFT p99 ms |")
    print("| --- | --- | --- | --- | --- | --- |")
    for policy in a.policies:
        r = asyncio.run(run_policy(setup, policy))
        print(f"| {r['policy']} | {r['turns']} | {r['failed']} | {r['hit_rate']:.3f} | "
              f"{r['ttft_p50_ms']:.1f} | {r['ttft_p99_ms']:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
