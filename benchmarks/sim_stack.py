"""A pd-bench walk-through on the simulated stack: pd-sim prefill + decode behind pd-proxy.

    python -m benchmarks.sim_stack --result-dir results/pd-bench-sim

Starts three processes on 127.0.0.1 (``pd-sim`` twice and ``pd-proxy``, through their command
lines, so pd-bench still imports nothing of theirs), runs a concurrency sweep through the proxy
and a comparison of the proxy against the decode worker alone, prints the summaries and the
plot paths, and stops every process it started.

Its helpers are how every benchmark here starts and stops processes: ``free_port``, ``start_sim``
(a pd-sim on a port of its choosing), ``start_logged`` (any command, its output to a log file,
optionally pinned to CPUs, in a process group of its own), ``wait_ready`` (``/health`` answers
200), ``stop_all`` and ``processes`` (a list whose processes are stopped on exit).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path

import aiohttp

from benchmarks.datasets import DatasetConfig
from benchmarks.runner import BenchConfig, arun_compare, arun_sweep, summary_text

_READY_TIMEOUT_S = 30.0
REPO_ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def start_sim(role: str, timing: Sequence[str]) -> tuple[subprocess.Popen[bytes], str]:
    """A pd-sim process with ``timing`` (its flags); its URL once it printed it."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "workers.sim.cli",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--role",
            role,
            *timing,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        proc.kill()
        proc.wait()
        raise RuntimeError(f"pd-sim {role} did not start")
    return proc, str(json.loads(line)["url"])


def _start_proxy(prefill: str, decode: str) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "proxy.cli",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--prefill",
            prefill,
            "--decode",
            decode,
            "--log-level",
            "WARNING",
            "--kv-block-size",  # pd-sim's KV block (the bypass and the prefix policy count in it)
            "16",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return proc, f"http://127.0.0.1:{port}"


def start_logged(argv: Sequence[str], log: Path, cpus: str | None = None) -> subprocess.Popen[bytes]:
    """``argv`` (under ``taskset -c cpus`` when given) in a session, so a process group, of its
    own, stdout and stderr to ``log`` after a ``$ command`` line; run from the repository root."""
    full = ["taskset", "-c", cpus, *argv] if cpus else list(argv)
    with log.open("w") as fh:
        fh.write("$ " + shlex.join(full) + "\n")
        fh.flush()
        return subprocess.Popen(
            full,
            stdin=subprocess.DEVNULL,
            stdout=fh,
            stderr=subprocess.STDOUT,
            cwd=REPO_ROOT,
            env=dict(os.environ, PYTHONUNBUFFERED="1", NO_COLOR="1"),
            start_new_session=True,
        )


def _signal(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    """``sig`` to a running process, to its whole group when it leads one (``start_logged``)."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if os.getpgid(proc.pid) == proc.pid:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)


def stop_all(procs: Sequence[subprocess.Popen[bytes]]) -> None:
    """Stop processes started in order, the last first; one that does not stop in 5 s is killed.
    A process that leads its own group (``start_logged``) is stopped with its whole group."""
    for proc in reversed(procs):
        _signal(proc, signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            _signal(proc, signal.SIGKILL)
            proc.wait()


@contextlib.contextmanager
def processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    """A list to append started processes to; every one of them is stopped on exit."""
    procs: list[subprocess.Popen[bytes]] = []
    try:
        yield procs
    finally:
        stop_all(procs)


async def wait_ready(
    url: str, proc: subprocess.Popen[bytes] | None = None, timeout_s: float = _READY_TIMEOUT_S
) -> None:
    """Poll ``url``/health until it answers 200 (at most ``timeout_s``); fail at once when
    ``proc`` (the process behind ``url``) exits."""
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"{url}: exited with code {proc.returncode} before it was ready")
            with contextlib.suppress(aiohttp.ClientError, OSError):
                async with s.get(f"{url}/health", timeout=aiohttp.ClientTimeout(total=1)) as r:
                    if r.status == 200:
                        return
            await asyncio.sleep(0.2)
    raise RuntimeError(f"{url} not ready after {timeout_s:g} s")


@contextlib.contextmanager
def _stack(timing: Sequence[str]) -> Iterator[tuple[str, str]]:
    """(proxy URL, decode worker URL); all three processes are stopped on exit."""
    with processes() as procs:
        p, p_url = start_sim("prefill", timing)
        procs.append(p)
        d, d_url = start_sim("decode", timing)
        procs.append(d)
        x, x_url = _start_proxy(p_url, d_url)
        procs.append(x)
        yield x_url, d_url


async def _main(args: argparse.Namespace) -> None:
    timing = [
        "--prefill-base-ms",
        str(args.prefill_ms),
        "--prefill-per-token-ms",
        "0",
        "--itl-ms",
        str(args.itl_ms),
    ]
    with _stack(timing) as (proxy_url, decode_url):
        await wait_ready(proxy_url)
        base = BenchConfig(
            url=proxy_url,
            dataset=DatasetConfig(
                num_requests=args.num_requests, input_len=args.input_len, output_len=args.output_len
            ),
            result_dir=args.result_dir,
            label="sim-proxy",
            warmup=2,
            goodput_ms={"ttft": 4.0 * args.prefill_ms, "tpot": 2.0 * args.itl_ms},
        )
        sweep = await arun_sweep(base, concurrencies=args.concurrencies)
        print(summary_text(sweep))
        comp = await arun_compare(
            replace(base, label="sim-compare", max_concurrency=2, request_rate=math.inf),
            [decode_url, proxy_url],
        )
        print(summary_text(comp))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.sim_stack", description=__doc__.split("\n")[0])
    p.add_argument("--result-dir", default="results/pd-bench-sim")
    p.add_argument("--concurrencies", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4, 8, 16])
    p.add_argument("--num-requests", type=int, default=40)
    p.add_argument("--input-len", type=int, default=200)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--prefill-ms", type=float, default=50.0)
    p.add_argument("--itl-ms", type=float, default=10.0)
    asyncio.run(_main(p.parse_args(argv)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
