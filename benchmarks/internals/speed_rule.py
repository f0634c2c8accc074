"""What each speed mechanism of pd-proxy saves: CPU per request of pd-proxy's process with it and
with it turned off, in one run, the variants interleaved.

    python benchmarks/internals/speed_rule.py [--requests 600] [--alternations 5]
                                              [--variants base,no-known,...] [--modes stream,nonstream]

Starts two ``pd-sim --zero-latency`` workers and one pd-proxy process per variant in front of them
(``--serve VARIANT PD-PROXY-ARGS``: this file turns the mechanism off, then runs ``proxy.cli.main``;
no flag of pd-proxy's is added for it). ``base`` has every mechanism; each other variant turns one
off (``VARIANTS``). Per mode, ``call_counts``' load client per proxy (64 at a time, 256 prompt
tokens, 32 output tokens, warmed up by 64 requests) runs ``--requests`` requests at each proxy in
turn, the order rotating every alternation; a proxy's CPU per request is its process's user +
system time over its turn (``benchmarks.procstat``). Every process shares the cores, as at the
``compare_routers`` points. The gain of a mechanism is ``1 - base / off`` of the CPU per request
(the share of the plain path's CPU it saves), per alternation; the table gives their median
and range. Numbers and the rule they serve in ``benchmarks/README.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path

_TREE = str(Path(__file__).resolve().parents[2])
if _TREE not in sys.path:
    sys.path.append(_TREE)

Patch = tuple[object, str, object]


def _swap_everywhere(name: str, old: object, new: object) -> list[Patch]:
    """``new`` in place of ``old`` in every loaded module of the proxy that holds it as ``name``."""
    return [(mod, name, new) for mod_name, mod in list(sys.modules.items())
            if mod_name.split(".")[0] in ("proxy", "kv_transfer") and getattr(mod, name, None) is old]


def _no_lean_routes() -> list[Patch]:
    from aiohttp import web  # noqa: PLC0415

    from proxy.http.lean import LeanApplication  # noqa: PLC0415

    return [(LeanApplication, "_handle", web.Application._handle)]  # the router and the middlewares


def _no_nesting_scan() -> list[Patch]:
    import re  # noqa: PLC0415

    from proxy.wire import protocol  # noqa: PLC0415

    return [(protocol, "_SURROGATE_ESCAPE_RE", re.compile(b""))]  # found in every body: always walked


VARIANTS: dict[str, tuple[Callable[[], list[Patch]], tuple[str, ...]]] = {
    "base": (list, ()),
    "no-lean-routes": (_no_lean_routes, ()),
    "no-nesting-scan": (_no_nesting_scan, ()),
}
"""Each variant: the patches that turn its mechanism off, and pd-proxy arguments it adds."""


def patches(variant: str) -> list[Patch]:
    import proxy.cli  # noqa: F401, PLC0415  (every module the patches sweep is loaded)

    return VARIANTS[variant][0]()


def serve(variant: str, argv: Sequence[str]) -> None:
    from proxy.cli import main  # noqa: PLC0415

    for owner, name, value in patches(variant):
        setattr(owner, name, value)
    main([*argv, *VARIANTS[variant][1]])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _ready(port: int, proc: subprocess.Popen[bytes]) -> None:
    import aiohttp  # noqa: PLC0415

    async with aiohttp.ClientSession() as session:
        for _ in range(300):  # 30 s at most
            if proc.poll() is not None:
                raise RuntimeError(f"a proxy exited ({proc.returncode})")
            with contextlib.suppress(aiohttp.ClientError):
                async with session.get(f"http://127.0.0.1:{port}/readyz") as r:
                    if r.status == 200:
                        return
            await asyncio.sleep(0.1)
    raise RuntimeError("a proxy did not get ready")


def _start_proxy(variant: str, port: int, prefill: str, decode: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, __file__, "--serve", variant, "--host", "127.0.0.1",
                             "--port", str(port), "--prefill", prefill, "--decode", decode,
                             "--log-level", "warning"], cwd=_TREE)


@contextlib.asynccontextmanager
async def _proxies(variants: Sequence[str]) -> AsyncIterator[dict[str, tuple[int, int]]]:
    """Each variant's proxy, started in front of two zero-latency pd-sim workers: its port, pid."""
    from benchmarks.internals.call_counts import _start_sim  # noqa: PLC0415

    sims = [_start_sim(role, _TREE) for role in ("prefill", "decode")]
    procs: dict[str, tuple[int, subprocess.Popen[bytes]]] = {}
    try:
        for v in variants:
            port = _free_port()
            procs[v] = port, _start_proxy(v, port, sims[0][1], sims[1][1])
        for port, proc in procs.values():
            await _ready(port, proc)
        yield {v: (port, proc.pid) for v, (port, proc) in procs.items()}
    finally:
        for proc in [p for _, p in procs.values()] + [p for p, _ in sims]:
            proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
            if proc.returncode is None:
                proc.kill()
                proc.wait()


def gains(cpu: dict[str, list[float]]) -> dict[str, list[float]]:
    """Per mechanism, ``1 - base / off`` of each alternation's CPU per request."""
    return {v: [1 - b / o for b, o in zip(cpu["base"], per, strict=True)]
            for v, per in cpu.items() if v != "base"}


async def measure(variants: Sequence[str], modes: Sequence[str], requests: int,
                  alternations: int) -> dict[str, dict[str, list[float]]]:
    """Per mode, per variant: the proxy's CPU seconds per request in each alternation."""
    from benchmarks.internals.call_counts import load_client  # noqa: PLC0415
    from benchmarks.procstat import tree_cpu_seconds  # noqa: PLC0415

    out: dict[str, dict[str, list[float]]] = {}
    async with _proxies(variants) as proxies:
        for mode in modes:
            cpu: dict[str, list[float]] = {v: [] for v in variants}
            async with contextlib.AsyncExitStack() as stack:
                rounds = {v: await stack.enter_async_context(load_client(
                    port, requests, mode == "stream", alternations)) for v, (port, _) in proxies.items()}
                for a in range(alternations):
                    order = list(variants[a % len(variants):]) + list(variants[:a % len(variants)])
                    for v in order:
                        before = tree_cpu_seconds(proxies[v][1])
                        await rounds[v]()
                        cpu[v].append((tree_cpu_seconds(proxies[v][1]) - before) / requests)
                    print(f"{mode} alternation {a + 1}: " + ", ".join(
                        f"{v} {cpu[v][-1] * 1e6:.0f}" for v in variants) + " us/request", flush=True)
            out[mode] = cpu
    return out


def table(result: dict[str, dict[str, list[float]]]) -> str:
    lines = ["| mechanism turned off | " + " | ".join(f"{m}: gain, median [range]" for m in result) + " |",
             "| --- |" + " --- |" * len(result)]
    per_mode = {m: gains(cpu) for m, cpu in result.items()}
    for v in next(iter(per_mode.values())):
        cells = [f"{statistics.median(g[v]):+.1%} [{min(g[v]):+.1%}, {max(g[v]):+.1%}]"
                 for g in per_mode.values()]
        lines.append(f"| {v} | " + " | ".join(cells) + " |")
    base = {m: statistics.median(cpu["base"]) * 1e6 for m, cpu in result.items()}
    lines.append("| (base, us/request) | " + " | ".join(f"{b:.0f}" for b in base.values()) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--serve"]:
        serve(argv[1], argv[2:])
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=600, help="requests a turn (default 600)")
    ap.add_argument("--alternations", type=int, default=5, help="turns of every variant (default 5)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="base first, then the ones turned off")
    ap.add_argument("--modes", default="stream,nonstream")
    args = ap.parse_args(argv)
    variants = args.variants.split(",")
    if variants[0] != "base" or any(v not in VARIANTS for v in variants):
        ap.error(f"--variants: base first, then some of {', '.join(VARIANTS)}")
    began = time.monotonic()
    result = asyncio.run(measure(variants, args.modes.split(","), args.requests, args.alternations))
    print(table(result))
    print(f"({time.monotonic() - began:.0f} s)")


if __name__ == "__main__":
    main()
