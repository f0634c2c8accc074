"""What aiohttp's server side costs per request, against a bare protocol: the most a server of
pd-proxy's own could save on the generate call.

    python benchmarks/internals/server_floor.py [--requests N] [--reps R] [--concurrency C]
                                                [--modes full,lean,bare] [--server-cpus LIST]

Each mode serves ``POST /inference/v1/generate`` in a server subprocess (uvloop, loopback) with
the same fixed answer (a 32-token JSON reply, ``Content-Length``), and nothing else: no hop, no
validation. ``full``: an aiohttp ``web.Application`` with the route (router, ``web.Request``,
``web.Response``); ``lean``: pd-proxy's front (``proxy.http.lean.LeanApplication`` with its
``BodyLimit``, the body read under the limit); ``bare``: an ``asyncio.Protocol`` that finds the
head's end and ``Content-Length`` and writes the answer (one write), the least an HTTP/1.1 server
can do. A client subprocess (uvloop, ``--concurrency`` kept-alive connections, a 256-token
generate body) sends ``--requests`` after a warm-up; the server's CPU per request is read from
``/proc/PID/stat``. Modes alternate in each repetition; medians printed. ``--server-cpus``:
the server under ``taskset``. Numbers in ``benchmarks/README.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, cast

_TREE = str(Path(__file__).resolve().parents[2])
if _TREE not in sys.path:
    sys.path.insert(0, _TREE)

from benchmarks.internals.bare_proxy import content_length  # noqa: E402
from benchmarks.procstat import tree_cpu_seconds  # noqa: E402

PATH = "/inference/v1/generate"
MODES = ("full", "lean", "bare")
BODY = json.dumps({"model": "m", "token_ids": list(range(1000, 1256)),
                   "sampling_params": {"max_tokens": 32, "temperature": 0}}).encode()
REPLY = json.dumps({"request_id": "cmpl-0", "choices": [
    {"index": 0, "token_ids": list(range(32)), "finish_reason": "length"}]}).encode()
_END = b"\r\n\r\n"


def aiohttp_app(mode: str) -> Any:
    """``full`` or ``lean``: the aiohttp application of that mode."""
    from aiohttp import web  # noqa: PLC0415

    async def handler(request: web.Request) -> web.Response:
        await request.read()  # lean: read by the body limit already (cached)
        return web.Response(body=REPLY, content_type="application/json")

    if mode == "full":
        app = web.Application()
        app.router.add_post(PATH, handler)
        return app
    from proxy.http.lean import LeanApplication  # noqa: PLC0415
    from proxy.http.limits import BodyLimit  # noqa: PLC0415

    lean = LeanApplication(limit=BodyLimit(1 << 24, 30.0))
    lean.add_lean_post(PATH, handler)
    return lean


class Bare(asyncio.Protocol):
    """A ``Content-Length`` request in, the fixed answer out; keep-alive, pipelining."""

    def __init__(self) -> None:
        self.buf = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while (end := self.buf.find(_END)) >= 0:
            length = max(content_length(self.buf[:end].lower()), 0)
            if len(self.buf) < end + 4 + length:
                return
            self.buf = self.buf[end + 4 + length:]
            assert self.transport is not None
            self.transport.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                                 + str(len(REPLY)).encode() + _END + REPLY)


async def serve(mode: str) -> None:
    """Serve ``mode`` on a loopback port (printed) until killed."""
    loop = asyncio.get_running_loop()
    if mode == "bare":
        server = await loop.create_server(Bare, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
    else:
        from aiohttp import web  # noqa: PLC0415

        runner = web.AppRunner(aiohttp_app(mode), access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        port = runner.addresses[0][1]
    print(port, flush=True)
    await asyncio.Event().wait()


async def load(port: int, requests: int, concurrency: int) -> int:
    """``requests`` generate calls over ``concurrency`` kept-alive connections; the answers that
    were a 200 with the fixed reply."""
    request = (f"POST {PATH} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(BODY)}\r\n\r\n").encode() + BODY
    left = [requests]
    good = [0]

    async def connection() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            while left[0] > 0:
                left[0] -= 1
                writer.write(request)
                head = await reader.readuntil(_END)
                body = await reader.readexactly(max(content_length(head.lower()), 0))
                good[0] += head.startswith(b"HTTP/1.1 200 ") and body == REPLY
        finally:
            writer.close()

    await asyncio.gather(*(connection() for _ in range(concurrency)))
    return good[0]


def run_loop(coro: Any) -> Any:
    try:
        import uvloop  # noqa: PLC0415
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def measure(mode: str, requests: int, concurrency: int,
            server_cpus: str | None = None) -> tuple[float, float]:
    """One server of ``mode``: (CPU microseconds per request, requests per second)."""
    cmd = [sys.executable, __file__, "--serve", mode]
    if server_cpus:
        cmd = ["taskset", "-c", server_cpus, *cmd]
    server = subprocess.Popen(cmd, stdout=subprocess.PIPE)
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        warm = min(requests, 2000)
        if run_loop(load(port, warm, concurrency)) != warm:
            raise RuntimeError(f"{mode}: a warm-up answer was wrong")
        before, began = tree_cpu_seconds(server.pid), time.monotonic()
        good = run_loop(load(port, requests, concurrency))
        after, took = tree_cpu_seconds(server.pid), time.monotonic() - began
        if good != requests:
            raise RuntimeError(f"{mode}: {requests - good} answers were wrong")
        return (after - before) * 1e6 / requests, requests / took
    finally:
        server.kill()
        server.wait()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--serve", choices=MODES, help=argparse.SUPPRESS)
    p.add_argument("--requests", type=int, default=20000)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--server-cpus", help="taskset list for the server (default: no pinning)")
    a = p.parse_args(argv)
    if a.serve:
        run_loop(serve(a.serve))
        return 0
    modes = a.modes.split(",")
    if unknown := set(modes) - set(MODES):
        p.error(f"unknown modes: {', '.join(sorted(unknown))}")
    if not 1 <= a.requests <= 1_000_000 or not 1 <= a.reps <= 20 or not 1 <= a.concurrency <= 1024:
        p.error("--requests 1..1000000, --reps 1..20, --concurrency 1..1024")
    seen: dict[str, list[tuple[float, float]]] = {m: [] for m in modes}
    for rep in range(a.reps):
        for mode in modes[rep % len(modes):] + modes[:rep % len(modes)]:
            seen[mode].append(measure(mode, a.requests, a.concurrency, a.server_cpus))
            cpu, rate = seen[mode][-1]
            print(f"rep {rep + 1} {mode:5s} {cpu:7.1f} us/request {rate:8.0f} requests/s", flush=True)
    print(f"medians of {a.reps} ({a.requests} requests, {a.concurrency} at a time):")
    for mode in modes:
        cpu = statistics.median(c for c, _ in seen[mode])
        rate = statistics.median(r for _, r in seen[mode])
        print(f"  {mode:5s} {cpu:7.1f} us/request {rate:8.0f} requests/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
