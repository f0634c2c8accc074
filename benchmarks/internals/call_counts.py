"""Python function calls per request in pd-proxy, counted (cProfile), not timed: a yardstick that
CPU noise on a shared machine does not move, for comparing two trees of the proxy.

    PYTHONPATH=TREE python benchmarks/internals/call_counts.py --out A.json [--stream] [--requests 200]
                                                               [--uvloop]
    python benchmarks/internals/call_counts.py --diff A.json B.json [--top 40]

Run as a script path, so ``PYTHONPATH`` picks the tree measured (this file imports nothing of
``benchmarks``). Starts two ``pd-sim --zero-latency`` workers (prefill and decode, from TREE),
serves the proxy of TREE in this process on loopback, and loads it from a client subprocess:
64 warm-up requests, then ``--requests`` (at most 5,000) generate requests, 64 at a time, of 256
prompt tokens and 32 output tokens, profiled. Writes per-request call counts per function
(``module:name``, paths relative to the tree) and the tasks created per request; ``--diff``
prints the largest differences. Stream counts move a little from run to run (how the events of
a stream fall into reads); non-stream ones barely.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import os
import pstats
import subprocess
import sys
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import Any

import aiohttp

_SIM = ("--zero-latency", "--max-running", "100000", "--max-num-seqs", "100000",
        "--num-kv-blocks", "400000", "--max-model-len", "512")
_CONCURRENCY = 64
_MAX_REQUESTS = 5000


async def _client_batch(session: aiohttp.ClientSession, url: str, count: int, tag: str, stream: bool) -> None:
    sem = asyncio.Semaphore(_CONCURRENCY)

    async def one(i: int) -> None:
        body = {"request_id": f"{tag}-{i}", "token_ids": [(i * 7 + k) % 400 + 1 for k in range(256)],
                "sampling_params": {"max_tokens": 32, "temperature": 0.0, "ignore_eos": True},
                "stream": stream, "output_mode": "tokens"}
        async with sem, session.post(url + "/inference/v1/generate", json=body,
                                       headers={"X-Request-Id": f"{tag}-{i}"}) as r:
            data = await r.read()
            if r.status != 200:
                raise RuntimeError(f"HTTP {r.status}: {data[:300]!r}")

    await asyncio.gather(*(one(i) for i in range(count)))


async def _client(url: str, count: int, stream: bool) -> None:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        await _client_batch(session, url, 64, "warm", stream)
        print("ready", flush=True)
        sys.stdin.readline()
        await _client_batch(session, url, count, "meas", stream)
        print("done", flush=True)


def _start_sim(role: str, tree: str) -> tuple[subprocess.Popen[bytes], str]:
    argv = [sys.executable, "-m", "workers.sim.cli", "--host", "127.0.0.1", "--port", "0", "--role", role,
            *_SIM]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd=tree)
    assert proc.stdout is not None
    return proc, str(json.loads(proc.stdout.readline())["url"])


def _key(path: str, name: str, tree: str) -> str:
    if "site-packages/" in path:  # before the tree: a venv may live inside it
        path = path.split("site-packages/", 1)[1]
    elif "/lib/python3" in path:
        path = "stdlib/" + path.split("/lib/python3", 1)[1].split("/", 1)[-1]
    elif path.startswith(tree + "/"):
        path = path[len(tree) + 1:]
    return f"{path}:{name}"


async def measure(count: int, stream: bool, tree: str) -> dict[str, Any]:
    from aiohttp import web  # noqa: PLC0415

    from proxy.app import build_app  # noqa: PLC0415
    from proxy.cli import parse_args  # noqa: PLC0415

    sims = [_start_sim(role, tree) for role in ("prefill", "decode")]
    runner: web.AppRunner | None = None
    try:
        settings = parse_args(["--host", "127.0.0.1", "--port", "0", "--prefill", sims[0][1],
                               "--decode", sims[1][1], "--log-level", "warning"])
        runner = web.AppRunner(build_app(settings))
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        client = await asyncio.create_subprocess_exec(
            sys.executable, __file__, "--client", f"http://127.0.0.1:{port}", "--requests", str(count),
            *(["--stream"] if stream else []), stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert client.stdin is not None and client.stdout is not None
        if (await client.stdout.readline()).strip() != b"ready":
            raise RuntimeError("the load client failed its warm-up")
        loop = asyncio.get_running_loop()
        tasks = 0

        def factory(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, Any],
                    **kwargs: Any) -> asyncio.Task[Any]:
            nonlocal tasks
            tasks += 1
            return asyncio.Task(coro, loop=loop, **kwargs)

        loop.set_task_factory(factory)  # type: ignore[arg-type]
        profile = cProfile.Profile()
        profile.enable()
        client.stdin.write(b"go\n")
        await client.stdin.drain()
        done = (await client.stdout.readline()).strip() == b"done"
        await asyncio.sleep(0.3)  # the last requests' cleanup
        profile.disable()
        loop.set_task_factory(None)
        await client.wait()
        if not done:
            raise RuntimeError("the load client failed")
    finally:
        if runner is not None:
            await runner.cleanup()
        for proc, _ in sims:
            proc.terminate()
            proc.wait()
    calls: dict[str, float] = {}
    stats: dict[tuple[str, int, str], tuple[int, int, float, float, object]] = \
        pstats.Stats(profile).stats  # type: ignore[attr-defined]
    for (path, _line, name), (_cc, nc, _tt, _ct, _callers) in stats.items():
        key = _key(path, name, tree)
        calls[key] = calls.get(key, 0.0) + nc / count
    return {"tree": tree, "stream": stream, "requests": count, "tasks_per_request": tasks / count,
            "calls_per_request": dict(sorted(calls.items(), key=lambda kv: -kv[1]))}


def print_diff(a_path: str, b_path: str, top: int) -> None:
    a, b = (json.loads(Path(p).read_text()) for p in (a_path, b_path))
    ca, cb = a["calls_per_request"], b["calls_per_request"]
    print(f"calls per request: {sum(ca.values()):.1f} -> {sum(cb.values()):.1f}; "
          f"tasks per request: {a['tasks_per_request']:.2f} -> {b['tasks_per_request']:.2f}")
    rows = sorted(((cb.get(k, 0.0) - ca.get(k, 0.0), k) for k in set(ca) | set(cb)), key=lambda r: -abs(r[0]))
    for delta, key in rows[:top]:
        if abs(delta) >= 0.5:
            print(f"{delta:+8.2f}  {ca.get(key, 0.0):8.2f} -> {cb.get(key, 0.0):8.2f}  {key}")


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--out", type=Path, default=None, help="where to write the counts (JSON)")
    p.add_argument("--stream", action="store_true")
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--uvloop", action="store_true", help="serve on uvloop, as pd-proxy does when installed")
    p.add_argument("--diff", nargs=2, metavar=("A", "B"), default=None)
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--client", metavar="URL", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if not 1 <= a.requests <= _MAX_REQUESTS:
        p.error(f"--requests: 1 to {_MAX_REQUESTS}")
    if a.client:
        asyncio.run(_client(a.client, a.requests, a.stream))
        return
    if a.diff:
        print_diff(a.diff[0], a.diff[1], a.top)
        return
    if a.out is None:
        p.error("--out (or --diff) is required")
    import proxy  # noqa: PLC0415

    tree = os.path.dirname(os.path.dirname(os.path.realpath(proxy.__file__)))
    if a.uvloop:
        import uvloop  # noqa: PLC0415

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            result = runner.run(measure(a.requests, a.stream, tree))
    else:
        result = asyncio.run(measure(a.requests, a.stream, tree))
    a.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{result['tree']}: {sum(result['calls_per_request'].values()):.1f} calls per request, "
          f"{result['tasks_per_request']:.2f} tasks per request (stream: {a.stream})")


if __name__ == "__main__":
    main()
