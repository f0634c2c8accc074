"""What pd-proxy's OpenAI chat stream adds over its generate stream, per token, on pd-sim.

``python -m benchmarks.internals.openai_overhead [--requests 40] [--tokens 64] [--itl-ms 5]``: a pd-sim
prefill and decode worker (subprocesses), pd-proxy in this process; the same greedy prompt sent
sequentially as a generate stream and as a ``/v1/chat/completions`` stream (one render call, then
the same walk). Prints, per output token: the time from the second chunk to the last (ITL; a chat
stream skips tokens that give no text yet, so it has fewer chunks) and
this process's CPU time (the proxy's and the client's; the client's parse is alike for both).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import subprocess
import sys
import time
from typing import Any

import aiohttp
from aiohttp import web

from proxy.config.settings import ProxySettings
from proxy.http.app import build_app


def _start_sim(role: str, port: int, itl_ms: float) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "workers.sim.cli", "--role", role, "--port", str(port),
                             "--itl-ms", str(itl_ms), "--prefill-base-ms", "1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


async def _ready(session: aiohttp.ClientSession, url: str) -> None:
    for _ in range(200):
        try:
            async with session.get(url + "/health") as r:
                if r.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.05)
    raise RuntimeError(f"{url} did not start")


async def _one(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[int, list[float]]:
    """Chunks with content, and the gaps between them."""
    times: list[float] = []
    async with session.post(url, json=body) as r:
        assert r.status == 200, await r.read()
        async for line in r.content:
            if line.startswith(b"data: {"):
                times.append(time.perf_counter())
    return len(times), [b - a for a, b in itertools.pairwise(times[1:])]


async def run(args: argparse.Namespace) -> None:
    procs = [_start_sim("prefill", 18301, args.itl_ms), _start_sim("decode", 18302, args.itl_ms)]
    p, d = "http://127.0.0.1:18301", "http://127.0.0.1:18302"
    runner = None
    try:
        async with aiohttp.ClientSession() as session:
            await _ready(session, p)
            await _ready(session, d)
            runner = web.AppRunner(build_app(ProxySettings(prefill_urls=(p,), decode_urls=(d,))),
                                   handler_cancellation=True, access_log=None)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", 18300).start()
            base = "http://127.0.0.1:18300"
            chat = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hello " * 20}],
                    "max_tokens": args.tokens, "temperature": 0, "ignore_eos": True, "stream": True}
            async with session.post(d + "/v1/chat/completions/render", json=chat) as r:
                ids = (await r.json())["token_ids"]
            gen = {"token_ids": ids, "stream": True,
                   "sampling_params": {"max_tokens": args.tokens, "temperature": 0, "ignore_eos": True}}
            for name, url, body in (("generate", base + "/inference/v1/generate", gen),
                                    ("chat", base + "/v1/chat/completions", chat)) * 2:
                cpu0, gaps, tokens = time.process_time(), [], 0
                for _ in range(args.requests):
                    n, g = await _one(session, url, body)
                    tokens += n
                    gaps += g
                cpu = time.process_time() - cpu0
                out = args.requests * (args.tokens - 1)  # tokens after the first, per request
                print(json.dumps({"endpoint": name, "requests": args.requests, "chunks": tokens,
                                  "itl_ms_per_token": round(1000 * sum(gaps) / out, 4),
                                  "cpu_us_per_token": round(1e6 * cpu / (args.requests * args.tokens), 2)}))
    finally:
        if runner is not None:
            await runner.cleanup()
        for proc in procs:
            proc.terminate()
            proc.wait(10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--itl-ms", type=float, default=5.0)
    asyncio.run(run(ap.parse_args()))


if __name__ == "__main__":
    main()
