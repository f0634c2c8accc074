"""What pd-proxy's shells cost against its per-request components: pd-proxy, ``flat_proxy`` (its
components in ``bare_proxy``'s shells, with either hop client, or behind aiohttp's server) and
``bare_proxy``, served in one process and alternated round by round.

    python benchmarks/internals/shells.py [--requests N] [--rounds R] [--calls] [--pin] [--stream]
                                          [--itl-ms MS]
                                          [--variants pd-proxy,aiohttp+flat+hops,...]

Starts two pd-sim workers (prefill and decode; no simulated delay but ``--itl-ms``) and serves,
in this process on uvloop and on loopback, in front of both:

- ``pd-proxy``: the app (``proxy.http.app.build_app``, pd-proxy's default settings, ``--log-level
  warning``), as ``call_counts.py`` and ``cpu_split.py`` serve it (every request on aiohttp's
  server, the generate calls without its router: ``proxy.http.lean``);
- ``aiohttp+flat+hops``: ``flat_proxy``'s walk with pd-proxy's hop client, behind aiohttp's server
  (``flat_proxy.aiohttp_app``: a ``web.Application``, the generate route alone, no middleware);
- ``server+flat+hops``: the same behind aiohttp's low-level server (``web.Server``: no application,
  no router, the handler called for every request);
- ``flat+hops``: ``flat_proxy`` with pd-proxy's hop client (``proxy.upstream.client.Upstream``);
- ``flat``: ``flat_proxy`` with ``bare_proxy``'s hop client;
- ``bare``: ``bare_proxy``, the two hops and nothing else.

Each has its own load client subprocess (``call_counts``' client: 64 at a time, 256 prompt
tokens, 32 output tokens, non-stream, or streams with ``--stream`` (the variants that relay them:
``STREAM_VARIANTS``); 64 warm-up requests). ``--itl-ms``: the workers wait that long between
tokens (each token then comes in a read of its own, as from a real decode worker). Each round
gives every variant ``--requests`` requests in turn, the order rotated every round, and prints
this process's user plus system CPU per request for each (``os.times``: the workers and the
clients are other processes), so that the machine's drift falls on all of them alike; the
medians come last. With
``--calls``, two more rounds each, the second under cProfile: Python calls per request (builtins
included), a count that the machine's load moves by up to about a hundred (the round before it
keeps the pooled connections to the workers open; on asyncio's loop the timers' heap is compared
in Python, more so when the machine is slow). ``--pin``: this process alone on the last CPU, the workers and
the clients on the others (``cpu_split.py --pin``'s split). Numbers in ``benchmarks/README.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import os
import pstats
import statistics
import sys
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from pathlib import Path

from aiohttp import web

_TREE = str(Path(__file__).resolve().parents[2])
if _TREE not in sys.path:
    sys.path.append(_TREE)

from benchmarks.internals import bare_proxy, call_counts, cpu_split, flat_proxy  # noqa: E402

VARIANTS = ("pd-proxy", "aiohttp+flat+hops", "server+flat+hops", "flat+hops", "flat", "bare")
STREAM_VARIANTS = ("pd-proxy", "flat+hops", "flat", "bare")
"""Those that relay a stream (the aiohttp shells serve non-stream requests only)."""
Round = Callable[[], Awaitable[None]]


async def _serve(stack: AsyncExitStack, variant: str, prefill: str, decode: str) -> int:
    """Start ``variant`` on a free loopback port (stopped with ``stack``); its port."""
    if variant == "pd-proxy":
        from proxy.cli import parse_args  # noqa: PLC0415
        from proxy.http.app import build_app  # noqa: PLC0415

        settings = parse_args(["--host", "127.0.0.1", "--port", "0", "--prefill", prefill,
                               "--decode", decode, "--log-level", "warning"])
        runner = web.AppRunner(build_app(settings))
        await runner.setup()
        stack.push_async_callback(runner.cleanup)
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        return int(runner.addresses[0][1])
    if variant in ("aiohttp+flat+hops", "server+flat+hops"):
        proxy, session = flat_proxy.build(prefill, decode, "pd-proxy")
        stack.push_async_callback(session.close)
        flat_runner: web.BaseRunner = (web.AppRunner(flat_proxy.aiohttp_app(proxy))
                                       if variant == "aiohttp+flat+hops"
                                       else web.ServerRunner(web.Server(proxy.handle)))
        await flat_runner.setup()
        stack.push_async_callback(flat_runner.cleanup)
        await web.TCPSite(flat_runner, "127.0.0.1", 0).start()
        return int(flat_runner.addresses[0][1])
    if variant == "bare":
        server = await bare_proxy.start(0, prefill, decode)
    else:
        server, _, session = await flat_proxy.start(0, prefill, decode,
                                                    "pd-proxy" if variant == "flat+hops" else "bare")
        stack.push_async_callback(session.close)
    stack.push_async_callback(server.wait_closed)
    stack.callback(server.close)
    return int(server.sockets[0].getsockname()[1])


async def measure(count: int, rounds: int, calls: bool, variants: tuple[str, ...] = VARIANTS, *,
                  pin: bool = False, stream: bool = False,
                  itl_ms: float = 0.0) -> dict[str, dict[str, object]]:
    """Per variant: CPU per request of each round (us) and, with ``calls``, Python calls per request.
    ``stream``: stream requests (``STREAM_VARIANTS`` only). ``itl_ms``: the decode worker's time
    between tokens (0: none; each token then comes in a read of its own)."""
    if stream and any(v not in STREAM_VARIANTS for v in variants):
        raise ValueError(f"streams are relayed by {', '.join(STREAM_VARIANTS)} only")
    affinity = os.sched_getaffinity(0)
    pinned = cpu_split.pin_cpus() if pin else None
    if pinned is not None:
        os.sched_setaffinity(0, pinned[0])  # the workers and the clients inherit it
    sims = [call_counts._start_sim(role, _TREE, itl_ms) for role in ("prefill", "decode")]
    try:
        async with AsyncExitStack() as stack:
            loads: dict[str, Round] = {}
            for variant in variants:
                port = await _serve(stack, variant, sims[0][1], sims[1][1])
                loads[variant] = await stack.enter_async_context(
                    call_counts.load_client(port, count, stream, rounds=rounds + 2 * int(calls)))
            if pinned is not None:
                os.sched_setaffinity(0, pinned[1])
            cpu: dict[str, list[float]] = {v: [] for v in variants}
            for r in range(rounds):
                order = [*variants[r % len(variants):], *variants[:r % len(variants)]]
                for variant in order:
                    before = os.times()
                    await loads[variant]()
                    after = os.times()
                    used = after.user - before.user + after.system - before.system
                    cpu[variant].append(used / count * 1e6)
                line = ", ".join(f"{v} {cpu[v][-1]:.0f} us" for v in variants)
                print(f"  round {r + 1}: {line}", flush=True)
            counted: dict[str, float] = {}
            if calls:
                for variant in variants:
                    # a round first, so that the variant's pooled connections to the workers are
                    # fresh: on a loaded machine the other variants' rounds outlast the pools'
                    # keep-alive (4 s), and 64 requests re-opening them count 40% more calls
                    await loads[variant]()
                    profile = cProfile.Profile()
                    profile.enable()
                    await loads[variant]()
                    profile.disable()
                    stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
                    counted[variant] = sum(v[1] for v in stats.values()) / count
            return {v: {"cpu_us": cpu[v], "median_us": statistics.median(cpu[v]),
                        "calls": counted.get(v)} for v in variants}
    finally:
        for proc, _ in sims:
            proc.terminate()
            proc.wait()
        os.sched_setaffinity(0, affinity)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--requests", type=int, default=2000, help="per variant and round (at most 5,000)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", action="store_true", help="two more rounds each, calls counted in the second")
    p.add_argument("--pin", action="store_true", help="this process alone on the last CPU")
    p.add_argument("--variants", default=None, help="a comma list out of those (default: all; with "
                   "--stream, those that relay streams)")
    p.add_argument("--stream", action="store_true", help=f"stream requests ({', '.join(STREAM_VARIANTS)})")
    p.add_argument("--itl-ms", type=float, default=0.0,
                   help="the workers' time between tokens (default 0: no simulated delay at all)")
    a = p.parse_args(argv)
    if not 1 <= a.requests <= 5000 or not 1 <= a.rounds <= 20 or not 0 <= a.itl_ms <= 100:
        p.error("--requests 1..5000, --rounds 1..20, --itl-ms 0..100")
    allowed = STREAM_VARIANTS if a.stream else VARIANTS
    variants = allowed if a.variants is None else tuple(v.strip() for v in a.variants.split(",") if v.strip())
    if not variants or any(v not in allowed for v in variants) or len(set(variants)) < len(variants):
        p.error(f"--variants: a comma list out of {', '.join(allowed)}, each once")
    print(f"{a.requests} {'stream' if a.stream else 'non-stream'} requests a round, 64 at a time, "
          f"{a.rounds} rounds, variants alternated{', pinned' if a.pin else ''}"
          f"{f', {a.itl_ms:g} ms between tokens' if a.itl_ms else ''}", flush=True)
    try:
        import uvloop  # noqa: PLC0415
    except ImportError:
        result = asyncio.run(measure(a.requests, a.rounds, a.calls, variants, pin=a.pin, stream=a.stream,
                                     itl_ms=a.itl_ms))
    else:
        result = uvloop.run(measure(a.requests, a.rounds, a.calls, variants, pin=a.pin, stream=a.stream,
                                    itl_ms=a.itl_ms))
    first = variants[0]
    base = float(result[first]["median_us"])  # type: ignore[arg-type]
    for variant, r in result.items():
        median = float(r["median_us"])  # type: ignore[arg-type]
        calls = f", {r['calls']:.0f} Python calls per request" if r["calls"] is not None else ""
        print(f"{variant:10s} median {median:.0f} us CPU per request ({median / base:.2f}x {first}'s){calls}")


if __name__ == "__main__":
    main()
