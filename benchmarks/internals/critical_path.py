"""Where one non-stream request's time goes inside pd-proxy, one request at a time: the wall time
between named points of its path, from the first byte of its request to its answer's write, and
what the proxy still does after the answer went out. The added-TTFT target at one request is this
path's length (``compare_routers --concurrency 1``): the proxy's work between the client and P,
between P and D, and between D and the client.

    [PYTHONPATH=TREE] python benchmarks/internals/critical_path.py [--requests N] [--max-tokens M]
                                                                    [--json OUT]

Serves pd-proxy (its default settings) in this process on loopback in front of two
``pd-sim --zero-latency`` workers, and sends ``--requests`` non-stream requests (256 prompt
tokens, ``--max-tokens`` output tokens) one after the other from a client subprocess, 2 ms apart
(the proxy is idle between them, as at one request at a time). The points are taken by wrapping
the proxy's methods on their classes for the run (``time.perf_counter_ns``, a few hundred
nanoseconds each): the request's first read (aiohttp's ``RequestHandler.data_received``), the
handler's start (``RequestHandler._handle_request``), validation (``Validation.validate``), the
walk (``Serving._walk``), each hop's request written (``HopConnection.send``) and its answer's
first read (``HopConnection.data_received``), P's reply accepted (``Prefill.accept_reply``), the decode
(``Serving._decode``), the answer written (``RequestHandler.finish_response``), the request
served (``RequestHandler._handle_request`` returns). A point whose
method a tree lacks is left out. The first 100 requests are a warm-up.

Prints, per segment between consecutive points, the median and 90th percentile in microseconds,
and three sums of medians: the proxy's work before the answer (every segment but the two waits
for a worker), the waits for P and for D, and the work after the answer. Wall time, not CPU: a
segment includes whatever else the machine ran meanwhile (run it on a quiet machine, and compare
trees alternated). Numbers in ``benchmarks/README.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import importlib.util
import itertools
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

_TREE = str(Path(__file__).resolve().parents[2])
if _TREE not in sys.path:
    sys.path.append(_TREE)  # after PYTHONPATH: a tree named there is the one measured

from benchmarks.internals.call_counts import _start_sim  # noqa: E402

_WARM_UP = 100
_MAX_REQUESTS = 20000
_CLIENT = r"""
import asyncio, json, sys, aiohttp
async def main(url, n, max_tokens):
    async with aiohttp.ClientSession() as session:
        for i in range(n):
            body = {"token_ids": [(i * 7 + k) % 400 + 1 for k in range(256)],
                    "sampling_params": {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True},
                    "stream": False, "output_mode": "tokens"}
            async with session.post(url + "/inference/v1/generate", json=body) as r:
                data = await r.read()
                if r.status != 200:
                    raise SystemExit(f"HTTP {r.status}: {data[:300]!r}")
            await asyncio.sleep(0.002)
asyncio.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
"""
_WAITS = ("sent to P -> P answers", "sent to D -> D answers")


class Marks:
    """The points of the run, in order: ``(name, perf_counter_ns)``."""

    def __init__(self) -> None:
        self.points: list[tuple[str, int]] = []
        self._undo: list[Callable[[], None]] = []

    def mark(self, name: str) -> None:
        self.points.append((name, time.perf_counter_ns()))

    def wrap(self, cls: Any, method: str, before: str | None, after: str | None = None,
             when: Callable[[Any], bool] | None = None) -> None:
        """``cls.method`` marking ``before`` on entry (only when ``when(self)``, if given) and
        ``after`` on return (a coroutine function's when its coroutine returns); nothing when the
        class has no such method."""
        original = cls.__dict__.get(method)
        if original is None:
            return
        mark = self.mark
        if asyncio.iscoroutinefunction(original):
            @functools.wraps(original)
            async def wrapped_async(*args: Any, **kwargs: Any) -> Any:
                if before and (when is None or when(args[0])):
                    mark(before)
                try:
                    return await original(*args, **kwargs)
                finally:
                    if after:
                        mark(after)
            setattr(cls, method, wrapped_async)
        else:
            @functools.wraps(original)
            def wrapped(*args: Any, **kwargs: Any) -> Any:
                if before and (when is None or when(args[0])):
                    mark(before)
                try:
                    return original(*args, **kwargs)
                finally:
                    if after:
                        mark(after)
            setattr(cls, method, wrapped)
        self._undo.append(lambda: setattr(cls, method, original))

    def install(self) -> None:
        from aiohttp.web_protocol import RequestHandler  # noqa: PLC0415

        from proxy.http import serving  # noqa: PLC0415
        from proxy.upstream import hop_wire  # noqa: PLC0415
        from proxy.walk import full, prefill  # noqa: PLC0415

        self.wrap(RequestHandler, "data_received", "request in",  # a request's first read
                  when=lambda protocol: protocol._current_request is None)
        self.wrap(RequestHandler, "_handle_request", "handler starts", "served")
        self.wrap(serving.Serving, "validate", "validate", "validated")  # a tree before proxy.walk.validation
        if importlib.util.find_spec("proxy.walk.validation") is not None:
            from proxy.walk import validation  # noqa: PLC0415

            self.wrap(validation.Validation, "validate", "validate", "validated")
        self.wrap(serving.Serving, "_walk", "walk")
        self.wrap(hop_wire.HopConnection, "send", "sent")
        self.wrap(hop_wire.HopConnection, "data_received", "answer in")
        self.wrap(prefill.Prefill, "accept_reply", "P's reply checked", "P's reply accepted")
        self.wrap(serving.Serving, "_decode", "decode")
        self.wrap(full.FullDecode, "_reply", "D's reply handled")
        self.wrap(RequestHandler, "finish_response", None, "answer written")

    def uninstall(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()

    def segments(self) -> dict[str, list[float]]:
        """Per segment (``"a -> b"``), its microseconds in each request that has both hops; the
        hops' points named for the worker (``sent to P``, ``D answers``), a hop's later reads
        left out (its answer's first read is the point)."""
        requests: list[list[tuple[str, int]]] = []
        for name, at in self.points:
            if name == "request in":
                requests.append([])
            if requests:
                requests[-1].append((name, at))
        out: dict[str, list[float]] = {}
        for points in requests[_WARM_UP:]:
            if sum(1 for name, _ in points if name == "sent") != 2:
                continue
            named: list[tuple[str, int]] = []
            hops = 0
            for point, at in points:
                name = point
                if point == "sent":
                    hops += 1
                    name = "sent to " + "PD"[hops - 1]
                elif point == "answer in":
                    if named and named[-1][0].endswith("answers"):
                        continue  # a later read of the same answer
                    name = "PD"[hops - 1] + " answers"
                elif named and named[-1][0] == point:
                    continue
                named.append((name, at))
            for (a, ta), (b, tb) in itertools.pairwise(named):
                out.setdefault(f"{a} -> {b}", []).append((tb - ta) / 1000.0)
        return out


def summary(segments: dict[str, list[float]]) -> dict[str, Any]:
    """Median and 90th percentile per segment, in the path's order, and the three sums."""
    rows = {name: {"median_us": statistics.median(v), "p90_us": sorted(v)[int(len(v) * 0.9)], "n": len(v)}
            for name, v in segments.items()}
    after = False
    before_us = waits_us = after_us = 0.0
    for name, row in rows.items():
        if name in _WAITS:
            waits_us += row["median_us"]
        elif after:
            after_us += row["median_us"]
        else:
            before_us += row["median_us"]
        if name.endswith("-> answer written"):
            after = True
    return {"segments": rows, "before_answer_us": before_us, "worker_waits_us": waits_us,
            "after_answer_us": after_us}


async def run(requests: int, max_tokens: int) -> dict[str, Any]:
    from aiohttp import web  # noqa: PLC0415

    from proxy.cli import parse_args  # noqa: PLC0415
    from proxy.http.app import build_app  # noqa: PLC0415

    marks = Marks()
    sims = [_start_sim(role, _TREE) for role in ("prefill", "decode")]
    runner: web.AppRunner | None = None
    try:
        settings = parse_args(["--host", "127.0.0.1", "--port", "0", "--prefill", sims[0][1],
                               "--decode", sims[1][1], "--log-level", "warning"])
        runner = web.AppRunner(build_app(settings))
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        marks.install()
        client = await asyncio.create_subprocess_exec(
            sys.executable, "-c", _CLIENT, f"http://127.0.0.1:{port}", str(requests), str(max_tokens))
        if await client.wait() != 0:
            raise RuntimeError("the client failed")
        await asyncio.sleep(0.2)  # the last request's accounting
    finally:
        marks.uninstall()
        if runner is not None:
            await runner.cleanup()
        for proc, _ in sims:
            proc.terminate()
            proc.wait()
    return {"requests": requests, "max_tokens": max_tokens, **summary(marks.segments())}


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--requests", type=int, default=600, help="requests, the first 100 a warm-up")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--json", help="write the result here too")
    args = ap.parse_args(argv)
    if not _WARM_UP < args.requests <= _MAX_REQUESTS:
        ap.error(f"--requests must be over {_WARM_UP} and at most {_MAX_REQUESTS}")
    try:
        import uvloop  # noqa: PLC0415
        result = uvloop.run(run(args.requests, args.max_tokens))
    except ImportError:
        result = asyncio.run(run(args.requests, args.max_tokens))
    for name, row in result["segments"].items():
        print(f"{name:40s} median {row['median_us']:8.1f} us   p90 {row['p90_us']:8.1f} us")
    print(f"proxy before the answer {result['before_answer_us']:.1f} us, waits for the workers "
          f"{result['worker_waits_us']:.1f} us, proxy after the answer {result['after_answer_us']:.1f} us "
          f"(sums of medians, {result['requests'] - _WARM_UP} requests)")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
