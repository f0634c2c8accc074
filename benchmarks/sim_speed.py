"""How many tokens per second one pd-sim process streams in zero-latency mode.

    python -m benchmarks.sim_speed [--concurrency 32] [--max-tokens 512] [--seconds 5]

Starts ``pd-sim --zero-latency`` as a subprocess (pinned to one core with ``taskset`` when
available), then this process is the client: ``concurrency`` streams that each ask for
``max-tokens`` tokens, restarted until ``seconds`` have passed (bounded in time and count). Tokens
are counted from the SSE events received; the sim's own CPU time is read from /proc to report
tokens per sim CPU-second as well (the robust figure on a shared machine: wall-clock tokens/s is
capped by whatever else runs on the cores). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import resource
import shutil
import sys
import time
from typing import Any

from benchmarks.procstat import tree_cpu_seconds

_MAX_REQUESTS = 100_000


async def _start_sim(core: int | None, extra: list[str]) -> tuple[asyncio.subprocess.Process, str]:
    cmd = [
        sys.executable,
        "-m",
        "workers.sim.cli",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--zero-latency",
        "--tokens-only",
        *extra,
    ]
    if core is not None and shutil.which("taskset"):
        cmd = ["taskset", "-c", str(core), *cmd]
    proc = await asyncio.create_subprocess_exec(
        *cmd, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL
    )
    assert proc.stdout is not None
    line = await asyncio.wait_for(proc.stdout.readline(), 20)
    return proc, str(json.loads(line)["url"])


async def _stream(host: str, port: int, max_tokens: int, i: int) -> int:
    """One streaming request over a raw connection (cheaper than a full HTTP client: the client
    must not be what limits the measurement); returns the number of token events."""
    body = json.dumps(
        {
            "token_ids": [3 + (i * 7 + k) % 500 for k in range(32)],
            "sampling_params": {"temperature": 0, "max_tokens": max_tokens, "ignore_eos": True},
            "stream": True,
        }
    ).encode()
    head = (
        f"POST /inference/v1/generate HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(head + body)
        n = 0
        carry = b""
        while True:
            data = await reader.read(262144)
            if not data:
                break
            buf = carry + data
            n += buf.count(b"data: {")
            carry = buf[-6:]
        return n
    finally:
        writer.close()


async def run(
    concurrency: int, max_tokens: int, seconds: float, core: int | None, sim_args: list[str]
) -> dict[str, Any]:
    proc, url = await _start_sim(core, sim_args)
    try:
        host, port_s = url.removeprefix("http://").rsplit(":", 1)
        port = int(port_s)
        await _stream(host, port, 16, 0)  # warm-up
        cpu0 = tree_cpu_seconds(proc.pid)
        client0 = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.perf_counter()
        deadline = t0 + seconds
        tokens = 0
        requests = 0

        async def worker(w: int) -> None:
            nonlocal tokens, requests
            i = w
            while time.perf_counter() < deadline and requests < _MAX_REQUESTS:
                requests += 1
                n = await _stream(host, port, max_tokens, i)
                tokens += n  # not `tokens += await ...`: that reads `tokens` before awaiting
                i += concurrency

        await asyncio.wait_for(asyncio.gather(*(worker(w) for w in range(concurrency))), seconds + 60)
        elapsed = time.perf_counter() - t0
        cpu = tree_cpu_seconds(proc.pid) - cpu0
        client1 = resource.getrusage(resource.RUSAGE_SELF)
        client_cpu = (client1.ru_utime - client0.ru_utime) + (client1.ru_stime - client0.ru_stime)
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), 5)
        except TimeoutError:
            proc.kill()
            await proc.wait()
    return {
        "tokens": tokens,
        "requests": requests,
        "seconds": round(elapsed, 3),
        "tokens_per_s": round(tokens / elapsed, 1),
        "sim_cpu_s": round(cpu, 3),
        "tokens_per_sim_cpu_s": round(tokens / cpu, 1) if cpu > 0 else None,
        "client_cpu_s": round(client_cpu, 3),
        "concurrency": concurrency,
        "max_tokens": max_tokens,
        "sim_core": core,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=480)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--core", type=int, default=0, help="CPU core for the sim (-1: no pinning)")
    p.add_argument("sim_args", nargs="*", help="extra pd-sim flags (after --)")
    a = p.parse_args(argv)
    core = None if a.core < 0 else a.core
    result = asyncio.run(run(a.concurrency, a.max_tokens, a.seconds, core, a.sim_args))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
