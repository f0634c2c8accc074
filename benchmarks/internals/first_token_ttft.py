"""TTFT and the first-to-second token gap, ``--first-token-from-prefill`` off then on, side by side,
against in-process pd-sim workers with GPU-like timings (prefill 50 ms; hand-off + decode first
step about 150 ms), all on 127.0.0.1.

    python -m benchmarks.internals.first_token_ttft [--requests 20]

Sequential greedy streams of 16 tokens; client-side times from the request to the first and the
second data event. Bounded: ``--requests`` at most 1000.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Sequence

import aiohttp
from aiohttp import web

from proxy.config.settings import ProxySettings
from proxy.http.app import build_app
from proxy.pools import PoolSettings
from workers.sim import SimSettings
from workers.sim import build_app as sim_app


async def _serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = next(int(a[1]) for a in runner.addresses if isinstance(a, tuple))
    return runner, f"http://127.0.0.1:{port}"


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def run(requests: int) -> list[str]:
    p_run, p = await _serve(sim_app(SimSettings(role="prefill", prefill_base_ms=50, prefill_per_token_ms=0.0,
                                                itl_ms=10)))
    d_run, d = await _serve(sim_app(SimSettings(role="decode", itl_ms=10, remote_prefill_step_ms=140,
                                                transfer_per_block_ms=0.5)))
    body = {"token_ids": [65 + i % 50 for i in range(64)], "stream": True,
            "sampling_params": {"temperature": 0, "max_tokens": 16}}
    lines: list[str] = []
    try:
        async with aiohttp.ClientSession() as s:
            for on in (False, True):
                settings = ProxySettings(prefill_urls=(p,), decode_urls=(d,), kv_block_size=16,
                                         first_token_from_prefill=on, pools=PoolSettings.plain())
                runner, url = await _serve(build_app(settings))
                ttft: list[float] = []
                second: list[float] = []
                for _ in range(requests):
                    t0 = time.perf_counter()
                    times: list[float] = []
                    async with s.post(url + "/inference/v1/generate", json=body) as r:
                        async for line in r.content:
                            if line.startswith(b"data: {"):
                                times.append(time.perf_counter())
                    ttft.append((times[0] - t0) * 1000.0)
                    second.append((times[1] - times[0]) * 1000.0)
                await runner.cleanup()
                lines.append(f"first-token-from-prefill {'on ' if on else 'off'}: TTFT p50 "
                             f"{statistics.median(ttft):.1f} ms p90 {_pct(ttft, 0.9):.1f} ms; "
                             f"first to second token p50 {statistics.median(second):.1f} ms "
                             f"({requests} streams)")
    finally:
        await p_run.cleanup()
        await d_run.cleanup()
    return lines


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=20, help="streams per setting (at most 1000)")
    a = ap.parse_args(argv)
    for line in asyncio.run(run(max(2, min(a.requests, 1000)))):
        print(line)


if __name__ == "__main__":
    main()
