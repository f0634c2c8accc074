"""Where pd-proxy's CPU goes per request: user and system time, and with ``--perf`` the process's
samples by the code that ran them (the CPython runtime, the kernel, pydantic-core, uvloop, ...).

    [PYTHONPATH=TREE] python benchmarks/internals/cpu_split.py [--stream] [--requests N]
                                                               [--rounds R] [--pin] [--perf]

Serves pd-proxy in this process on loopback in front of two ``pd-sim --zero-latency`` workers,
loaded from a client subprocess (``call_counts.loaded_proxy``: 64 at a time, 256 prompt tokens,
32 output tokens), the cyclic collector as Python sets it. ``PYTHONPATH=TREE`` measures another tree's proxy
(a build of it, say); the workers are this tree's. After the warm-up, each round
of ``--requests`` prints this process's user and system CPU per request (``os.times``: the
workers and the client are other processes) and the requests per second.

``--pin``: this process alone on the last CPU, the workers and the client on the others (they are
started first): nothing else runs on the proxy's CPU, so a sampling profiler's samples are its
CPU time (unpinned, a process that is ready but waiting for a CPU is sampled as running, in
whatever it last did: a socket write that woke the reader, typically).

``--perf``: ``perf record -e cpu-clock`` attached to this process for the measured rounds, then
its samples by shared object, grouped: ``cpython`` (the interpreter, the object allocator, the
dicts and the collector: Python code run, ours and the libraries'), ``kernel``,
``pydantic-core`` (JSON parsing and validation), ``uvloop``, ``asyncio`` (C tasks and futures),
``aiohttp-c`` (aiohttp's HTTP parser and writer, multidict, yarl, ...), ``json`` (the standard
library's C encoder and decoder), ``libc`` (memory and copies), ``mypyc`` (a tree's modules
compiled with mypyc, when one is measured) and ``other``. Needs ``perf``
and the right to profile one's own processes (``kernel.perf_event_paranoid`` <= 2); without
them it says why and prints the CPU lines alone. Numbers in ``benchmarks/README.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

_TREE = str(Path(__file__).resolve().parents[2])
if _TREE not in sys.path:
    sys.path.append(_TREE)  # after PYTHONPATH: a tree named there is the one measured

from benchmarks.internals.call_counts import loaded_proxy  # noqa: E402

GROUPS = (
    ("cpython", ("libpython", "python3.")),
    ("kernel", ("[kernel",)),
    ("pydantic-core", ("_pydantic_core",)),
    ("uvloop", ("loop.cpython",)),
    ("asyncio", ("_asyncio.cpython",)),
    ("aiohttp-c", ("_http_parser", "_http_writer", "_helpers", "_websocket", "_multidict",
                   "_quoting", "_frozenlist", "_propcache", "_c_ext")),
    ("json", ("_json.cpython",)),
    ("libc", ("libc.so", "libc-")),
    ("mypyc", ("__mypyc.",)),
)


def group_of(dso: str) -> str:
    for name, parts in GROUPS:
        if any(p in dso for p in parts):
            return name
    return "other"


def split(report: str) -> dict[str, float]:
    """``perf report --sort dso`` text: the share of each group (percent, summed), largest first."""
    shares: dict[str, float] = {}
    for line in report.splitlines():
        parts = line.split(None, 1)
        if len(parts) != 2 or not parts[0].endswith("%"):
            continue
        try:
            share = float(parts[0][:-1])
        except ValueError:
            continue
        name = group_of(parts[1].strip())
        shares[name] = shares.get(name, 0.0) + share
    return dict(sorted(shares.items(), key=lambda kv: -kv[1]))


def pin_cpus() -> tuple[set[int], set[int]]:
    """(the CPUs of the workers and the client, the proxy's CPU): the last CPU apart."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit("--pin needs at least two CPUs")
    return set(cpus[:-1]), {cpus[-1]}


@contextlib.contextmanager
def perf_attached(out: str) -> Iterator[str | None]:
    """``perf record`` on this process while the block runs; yields why not when it cannot."""
    if shutil.which("perf") is None:
        yield "perf is not installed"
        return
    proc = subprocess.Popen(["perf", "record", "-e", "cpu-clock", "-F", "999", "-p", str(os.getpid()),
                             "-o", out], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    time.sleep(1.0)  # attached (it prints nothing when it is)
    if proc.poll() is not None:
        err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
        yield f"perf record failed: {err.strip().splitlines()[-1] if err.strip() else proc.returncode}"
        return
    try:
        yield None
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def measured_tree() -> str:
    """The tree of the proxy this process imports (``PYTHONPATH``'s, or this one)."""
    import proxy  # noqa: PLC0415

    return str(Path(proxy.__file__).resolve().parents[1])


def perf_split(data: str) -> dict[str, float]:
    report = subprocess.run(["perf", "report", "-i", data, "--stdio", "--sort", "dso", "--no-children",
                             "-g", "none"], capture_output=True, text=True, timeout=300, check=True)
    return split(report.stdout)


async def main(args: argparse.Namespace) -> None:
    pinned = pin_cpus() if args.pin else None
    if pinned is not None:
        os.sched_setaffinity(0, pinned[0])  # the workers and the client inherit it
    async with loaded_proxy(args.requests, args.stream, _TREE, rounds=args.rounds) as one_round:
        if pinned is not None:
            os.sched_setaffinity(0, pinned[1])
        print(f"pd-proxy of {measured_tree()}, "
              f"{'stream' if args.stream else 'non-stream'}, {args.requests} requests a round, "
              f"64 at a time{', pinned' if pinned else ''}", flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            data = os.path.join(tmp, "perf.data")
            with perf_attached(data) if args.perf else contextlib.nullcontext() as why_not:
                for _ in range(args.rounds):
                    before, began = os.times(), time.perf_counter()
                    await one_round()
                    after, took = os.times(), time.perf_counter() - began - 0.3  # the round's settle
                    n = args.requests
                    print(f"  user {(after.user - before.user) / n * 1e6:.0f} us/request, "
                          f"system {(after.system - before.system) / n * 1e6:.0f} us/request, "
                          f"{n / took:.0f} requests/s", flush=True)
            if args.perf:
                if why_not is not None:
                    print(f"  no split: {why_not}")
                else:
                    print("  samples by what ran them: " + ", ".join(
                        f"{name} {share:.1f}%" for name, share in perf_split(data).items()))


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stream", action="store_true")
    p.add_argument("--requests", type=int, default=3000, help="per round (at most 5,000)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--pin", action="store_true", help="the proxy alone on the last CPU")
    p.add_argument("--perf", action="store_true", help="the split by shared object (perf)")
    args = p.parse_args(argv)
    if not 1 <= args.requests <= 5000 or not 1 <= args.rounds <= 20:
        p.error("--requests 1..5000, --rounds 1..20")
    return args


if __name__ == "__main__":
    arguments = parse(sys.argv[1:])
    try:
        import uvloop
    except ImportError:
        asyncio.run(main(arguments))
    else:
        uvloop.run(main(arguments))
