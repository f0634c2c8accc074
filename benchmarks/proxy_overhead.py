"""What pd-proxy costs: added TTFT, relay throughput and memory per open stream.

    python -m benchmarks.proxy_overhead [--quick] [--out results.json]

Runs pd-sim prefill and decode workers at zero latency and one pd-proxy, each in its own process
on 127.0.0.1, and measures with an aiohttp client in this process:

1. TTFT added: the time to the first streamed token through the proxy, against a client that
   calls the two hops itself (prefill non-stream max_tokens=1, then the decode stream with the
   prefill's kv_transfer_params), p50/p99 at 1, 64 and 256 concurrent streams.
2. Relay throughput: tokens/s streamed through the one proxy process (64 long streams).
3. Memory per open stream: the proxy's RSS growth with 256 streams held open (slow decode).

Every run is bounded in request count and wall time. On a 2-core machine the workers, the proxy
and this client share the CPU, so the numbers are upper bounds of the proxy's cost.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import statistics
import sys
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

PROMPT = list(range(300, 364))
GEN = "/inference/v1/generate"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class Proc:
    url: str
    process: asyncio.subprocess.Process

    async def stop(self) -> None:
        if self.process.returncode is None:
            self.process.terminate()
            try:
                await asyncio.wait_for(self.process.wait(), 10)
            except TimeoutError:
                self.process.kill()
                await self.process.wait()

    def cpu_seconds(self) -> float:
        with open(f"/proc/{self.process.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def rss_kib(self) -> int:
        with open(f"/proc/{self.process.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
        return 0


async def _wait_http(url: str, limit: float = 30.0) -> None:
    deadline = time.monotonic() + limit
    async with aiohttp.ClientSession() as s:
        while True:
            try:
                async with s.get(url + "/health") as r:
                    if r.status in (200, 503):
                        return
            except aiohttp.ClientError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url} did not start")
            await asyncio.sleep(0.1)


async def start_sim(role: str, *extra: str) -> Proc:
    port = _free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "workers.sim.cli", "--host", "127.0.0.1", "--port", str(port), "--role", role,
        "--max-model-len", "8192", "--max-num-seqs", "2048", "--max-running", "4096",
        "--num-kv-blocks", "200000", *extra,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    await _wait_http(url)
    return Proc(url, proc)


async def start_proxy(prefill: str, decode: str) -> Proc:
    port = _free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "proxy.cli", "--prefill", prefill, "--decode", decode, "--port", str(port),
        "--log-level", "WARNING",
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    await _wait_http(url)
    return Proc(url, proc)


@contextlib.asynccontextmanager
async def stack(decode_args: Sequence[str] = ()) -> AsyncIterator[tuple[Proc, Proc, Proc]]:
    p = await start_sim("prefill", "--zero-latency")
    d = await start_sim("decode", *(decode_args or ("--zero-latency",)))
    px = await start_proxy(p.url, d.url)
    try:
        yield p, d, px
    finally:
        for proc in (px, d, p):
            await proc.stop()


def _body(rid: str, max_tokens: int, stream: bool = True) -> dict[str, Any]:
    return {"request_id": rid, "token_ids": PROMPT, "stream": stream,
            "sampling_params": {"temperature": 0, "max_tokens": max_tokens, "ignore_eos": True}}


async def _first_token(resp: aiohttp.ClientResponse) -> None:
    async for line in resp.content:
        if line.startswith(b"data: {"):
            return
    raise RuntimeError("stream ended before a token")


async def ttft_direct(s: aiohttp.ClientSession, p: str, d: str, rid: str) -> float:
    t0 = time.perf_counter()
    hop = _body(rid, 1, stream=False)
    hop["sampling_params"]["max_tokens"] = 1
    hop["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False}
    async with s.post(p + GEN, json=hop) as r:
        kv = (await r.json())["kv_transfer_params"]
    async with s.post(d + GEN, json={**_body(rid, 16), "kv_transfer_params": kv}) as r:
        await _first_token(r)
        t = time.perf_counter() - t0
        await r.read()
    return t


async def ttft_proxy(s: aiohttp.ClientSession, px: str, rid: str) -> float:
    t0 = time.perf_counter()
    async with s.post(px + GEN, json=_body(rid, 16)) as r:
        await _first_token(r)
        t = time.perf_counter() - t0
        await r.read()
    return t


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def measure_ttft(p: Proc, d: Proc, px: Proc, concurrency: int, total: int) -> dict[str, Any]:
    out: dict[str, Any] = {"concurrency": concurrency, "requests": total}
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=60)) as s:
        for name in ("direct", "proxy", "direct2", "proxy2"):
            sem = asyncio.Semaphore(concurrency)
            times: list[float] = []

            async def one(i: int, name: str = name, sem: asyncio.Semaphore = sem,
                          times: list[float] = times) -> None:
                async with sem:
                    rid = f"{name}-{concurrency}-{i}"
                    if name.startswith("direct"):
                        times.append(await ttft_direct(s, p.url, d.url, rid))
                    else:
                        times.append(await ttft_proxy(s, px.url, rid))

            cpu0 = px.cpu_seconds()
            await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(total))), 300)
            key = name.rstrip("2")
            out.setdefault(key, []).extend(times)
            if key == "proxy":
                out["proxy_cpu_s"] = out.get("proxy_cpu_s", 0.0) + px.cpu_seconds() - cpu0
    res: dict[str, Any] = {"concurrency": concurrency, "requests_per_path": 2 * total}
    for key in ("direct", "proxy"):
        xs = out[key]
        res[f"{key}_p50_ms"] = round(statistics.median(xs) * 1000, 3)
        res[f"{key}_p99_ms"] = round(_pct(xs, 0.99) * 1000, 3)
    res["proxy_cpu_ms_per_request"] = round(1000 * out["proxy_cpu_s"] / (2 * total), 3)
    res["added_p50_ms"] = round(res["proxy_p50_ms"] - res["direct_p50_ms"], 3)
    res["added_p99_ms"] = round(res["proxy_p99_ms"] - res["direct_p99_ms"], 3)
    return res


async def measure_throughput(px: Proc, streams: int, max_tokens: int) -> dict[str, Any]:
    tokens = 0
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=300)) as s:
        async def one(i: int) -> int:
            n = 0
            async with s.post(px.url + GEN, json=_body(f"tp-{i}", max_tokens)) as r:
                async for line in r.content:
                    if line.startswith(b"data: {") and b'"choices":[{' in line:
                        n += len(json.loads(line[6:])["choices"][0]["token_ids"])
            return n

        t0 = time.perf_counter()
        cpu0 = px.cpu_seconds()
        counts = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(streams))), 300)
        dt = time.perf_counter() - t0
        cpu = px.cpu_seconds() - cpu0
        tokens = sum(counts)
    return {"streams": streams, "max_tokens": max_tokens, "tokens": tokens, "seconds": round(dt, 3),
            "tokens_per_s": round(tokens / dt, 1), "proxy_cpu_s": round(cpu, 3),
            "proxy_cpu_us_per_token": round(1e6 * cpu / max(tokens, 1), 2),
            "tokens_per_proxy_cpu_s": round(tokens / max(cpu, 1e-9), 1)}


async def measure_memory(px: Proc, streams: int) -> dict[str, Any]:
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=120)) as s:
        # warm up the proxy (imports, pools, buffers) before the baseline
        for i in range(8):
            async with s.post(px.url + GEN, json=_body(f"warm-{i}", 2)) as r:
                await r.read()
        await asyncio.sleep(0.5)
        base = px.rss_kib()
        async def open_one(i: int) -> aiohttp.ClientResponse:
            r = await s.post(px.url + GEN, json=_body(f"mem-{i}", 100000))
            await _first_token(r)
            return r

        # Opened together: the slow decode worker emits tokens in 10 s steps.
        responses = await asyncio.wait_for(asyncio.gather(*(open_one(i) for i in range(streams))), 90)
        await asyncio.sleep(0.5)
        held = px.rss_kib()
        for r in responses:
            r.close()
    return {"streams": streams, "rss_base_kib": base, "rss_open_kib": held,
            "kib_per_stream": round((held - base) / streams, 1)}


async def run(quick: bool) -> dict[str, Any]:
    results: dict[str, Any] = {"cpu_count": os.cpu_count()}
    levels = (1, 64) if quick else (1, 64, 256)
    async with stack() as (p, d, px):
        results["ttft"] = []
        for c in levels:
            total = max(40, 2 * c) if quick else max(200, 4 * c)
            results["ttft"].append(await measure_ttft(p, d, px, c, total))
            print(json.dumps(results["ttft"][-1]), flush=True)
        results["throughput"] = await measure_throughput(px, 16 if quick else 64, 500 if quick else 2000)
        print(json.dumps(results["throughput"]), flush=True)
    # Streams held open: the decode worker emits a token every 10 s.
    async with stack(("--itl-ms", "10000", "--prefill-base-ms", "0", "--prefill-per-token-ms", "0",
                      "--transfer-per-block-ms", "0")) as (_, _, px):
        results["memory"] = await measure_memory(px, 64 if quick else 256)
        print(json.dumps(results["memory"]), flush=True)
    return results


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="proxy_overhead", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller, faster runs")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    results = asyncio.run(run(args.quick))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
