"""How much a large request body stalls the other streams of the same pd-proxy process.

    python -m benchmarks.body_stall [--streams 16] [--itl-ms 5] [--bodies 5] [--mode refused|forward]
                                    [--layout pretty|compact] [--proxy-arg=--flag ...]

Starts pd-sim workers and one ``pd-proxy`` process on 127.0.0.1 (through their command lines),
runs ``--streams`` long streaming requests through the proxy (short prompts, so they go to the
decode worker alone) and records, at the client, the gap between consecutive chunks of every
stream. It first measures a quiet window (no big body), then sends ``--bodies`` large generate
bodies one after the other (``--body-mib`` MiB each) while the streams run, and reports the
largest inter-chunk gap of any stream during each big body (from its first byte sent until its
answer, plus ``--tail`` seconds). The big bodies are sent by ``curl`` when there is one (another
process: writing 16 MiB from this one would delay its own reads of the streams), else by this
client (``--sender``).

``--layout``: ``pretty`` is a body written with ``json.dumps(indent=...)``-style whitespace,
1,000,000 prompt tokens (under pd-proxy's default ``--max-prompt-tokens``) padded to the size, so
every id must be parsed; ``compact`` is the same size written compactly (about 4.2 million ids,
over the default cap).

``--mode``: ``refused`` runs the proxy with ``--max-inflight`` equal to the streams and
``--max-queue 0``, so the big request is parsed and validated, then refused with a 429 before any
hop: what is measured is the proxy's own work on the body, with no worker's parse of it on the
shared cores. ``forward`` lets the big request run: two decode workers behind
``--decode-policy session``, the streams on one, the big request on the other (and on the
prefill worker, which the streams skip), so that no worker that serves the streams parses it.

Prints one JSON line: the quiet window's largest gap and each big body's largest gap in
milliseconds, its status and the proxy's answer time; ``*_proxy_itl_bucket_ms``: the upper bound
of the ``pd_proxy_itl_seconds`` bucket that holds the proxy's own largest gap between two writes
of a stream in the same window (scraped from ``/metrics``; client-side delays are not in it).
Every process started is stopped on exit.
Bounded: at most 64 streams and 20 bodies.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import itertools
import json
import math
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import aiohttp

from benchmarks.sim_stack import free_port, processes, start_sim, wait_ready

GENERATE = "/inference/v1/generate"
SESSION_HEADER = "X-Session-ID"
_MAX_STREAMS = 64
_MAX_BODIES = 20
MiB = 1024 * 1024


def _start_sim(role: str, itl_ms: float) -> tuple[subprocess.Popen[bytes], str]:
    return start_sim(role, ["--prefill-base-ms", "0", "--prefill-per-token-ms", "0",
                            "--transfer-per-block-ms", "0", "--itl-ms", str(itl_ms),
                            "--max-model-len", "4000000", "--num-kv-blocks", "400000",
                            "--max-num-seqs", "1024", "--log-level", "WARNING"])


def _start_proxy(prefill: Sequence[str], decode: Sequence[str], extra: Sequence[str]) -> tuple[
        subprocess.Popen[bytes], str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "proxy.cli", "--host", "127.0.0.1", "--port", str(port),
         "--prefill", *prefill, "--decode", *decode, "--log-level", "WARNING", "--kv-block-size", "16",
         *extra],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return proc, f"http://127.0.0.1:{port}"


def _rendezvous_first(key: str, urls: Sequence[str]) -> str:
    """The worker ``--decode-policy session`` picks for ``key`` (proxy.pools.policies)."""
    salt = hashlib.blake2b(key.encode(), digest_size=16).digest()
    return max(urls, key=lambda u: int.from_bytes(
        hashlib.blake2b(u.encode(), digest_size=8, key=salt).digest(), "big"))


def _session_for(url: str, urls: Sequence[str], prefix: str) -> str:
    for i in range(10_000):
        if _rendezvous_first(f"{prefix}-{i}", urls) == url:
            return f"{prefix}-{i}"
    raise RuntimeError("no session id maps to the worker")


def big_body(size: int, layout: str, tokens: int, seed: int = 0) -> bytes:
    """A generate body of about ``size`` bytes (never more)."""
    rng = random.Random(seed)
    head = b'{"sampling_params":{"temperature":0,"max_tokens":1,"ignore_eos":true},"stream":false,' \
           b'"token_ids":['
    tail = b"]}"
    room = size - len(head) - len(tail)
    if layout == "compact":
        parts: list[bytes] = []
        used = 0
        while True:
            s = str(rng.randrange(257, 515)).encode()
            if used + len(s) + 1 > room:
                break
            parts.append(s)
            used += len(s) + 1
        return head + b",".join(parts) + tail
    ids = [str(rng.randrange(257, 515)).encode() for _ in range(tokens)]
    pad = max(0, (room - sum(len(s) for s in ids)) // tokens - 2)  # ",\n" + pad spaces per id
    sep = b",\n" + b" " * pad
    out = head + b"\n" + b" " * pad + sep.join(ids) + b"\n"
    return out + b" " * (size - len(out) - len(tail)) + tail


class Gaps:
    """Arrival times of every stream's chunks."""

    def __init__(self) -> None:
        self.arrivals: list[list[float]] = []

    def stream(self) -> list[float]:
        self.arrivals.append([])
        return self.arrivals[-1]

    def max_gap(self, t0: float, t1: float) -> float:
        """Largest gap between consecutive chunks of one stream that ends within [t0, t1]."""
        worst = 0.0
        for times in self.arrivals:
            for a, b in itertools.pairwise(times):
                if t0 <= b <= t1 and b - a > worst:
                    worst = b - a
        return worst


async def _itl_buckets(session: aiohttp.ClientSession, url: str) -> dict[float, float]:
    """``pd_proxy_itl_seconds`` (the proxy's own gap between two writes of a stream): cumulative
    count per bucket bound."""
    async with session.get(url + "/metrics") as r:
        text = await r.text()
    out: dict[float, float] = {}
    for line in text.splitlines():
        if line.startswith('pd_proxy_itl_seconds_bucket{le="'):
            le = line.split('"')[1]
            out[math.inf if le == "+Inf" else float(le)] = float(line.rsplit(" ", 1)[1])
    return out


def _max_bucket(before: dict[float, float], after: dict[float, float]) -> float:
    """The upper bound of the bucket holding the largest gap observed between two scrapes."""
    total = after[math.inf] - before.get(math.inf, 0.0)
    for le in sorted(after):
        if after[le] - before.get(le, 0.0) >= total:
            return le
    return math.inf


async def _stream(session: aiohttp.ClientSession, url: str, sess: str, out: list[float],
                  stop: asyncio.Event) -> None:
    body = {"token_ids": [3 + k for k in range(8)], "stream": True,
            "sampling_params": {"temperature": 0, "max_tokens": 1_000_000, "ignore_eos": True}}
    async with session.post(url + GENERATE, json=body, headers={SESSION_HEADER: sess}) as r:
        if r.status != 200:
            raise RuntimeError(f"stream answered {r.status}: {(await r.read())[:200]!r}")
        async for _ in r.content.iter_any():
            out.append(time.perf_counter())
            if stop.is_set():
                return


async def _post_with_curl(url: str, path: str, session_id: str) -> tuple[int, bytes]:
    proc = await asyncio.create_subprocess_exec(
        "curl", "-s", "-S", "-o", "-", "-w", "\n%{http_code}", "-H", "Content-Type: application/json",
        "-H", f"{SESSION_HEADER}: {session_id}", "--data-binary", f"@{path}", url,
        stdout=subprocess.PIPE)
    out, _ = await proc.communicate()
    answer, _, code = out.rpartition(b"\n")
    return int(code or 0), answer


async def _run(a: argparse.Namespace) -> dict[str, Any]:
    body = big_body(int(a.body_mib * MiB), a.layout, a.tokens)
    body_file: str | None = None
    with contextlib.ExitStack() as stack:
        if a.sender == "curl":
            tmp = stack.enter_context(tempfile.NamedTemporaryFile(suffix=".json"))
            tmp.write(body)
            tmp.flush()
            body_file = tmp.name
        return await _run_with(a, body, body_file)


async def _run_with(a: argparse.Namespace, body: bytes, body_file: str | None) -> dict[str, Any]:
    with processes() as procs:
        p, p_url = _start_sim("prefill", a.itl_ms)
        procs.append(p)
        n_decode = 2 if a.mode == "forward" else 1
        d_urls = []
        for _ in range(n_decode):
            d, d_url = _start_sim("decode", a.itl_ms)
            procs.append(d)
            d_urls.append(d_url)
        extra = ["--max-body-bytes", str(max(len(body), 16 * MiB))]
        if a.mode == "refused":
            extra += ["--max-inflight", str(a.streams), "--max-queue", "0"]
        else:
            extra += ["--decode-policy", "session"]
        x, x_url = _start_proxy([p_url], d_urls, [*extra, *a.proxy_arg])
        procs.append(x)
        await wait_ready(x_url)
        stream_sess = _session_for(d_urls[0], d_urls, "streams")
        big_sess = _session_for(d_urls[-1], d_urls, "big") if a.mode == "forward" else "big"
        gaps = Gaps()
        stop = asyncio.Event()
        conn = aiohttp.TCPConnector(limit=0)
        timeout = aiohttp.ClientTimeout(total=None, sock_read=60)
        async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
            tasks = [asyncio.ensure_future(_stream(session, x_url, stream_sess, gaps.stream(), stop))
                     for _ in range(a.streams)]
            await asyncio.sleep(a.warmup)
            t0 = time.perf_counter()
            quiet_before = await _itl_buckets(session, x_url)
            await asyncio.sleep(a.quiet)
            quiet_gap = gaps.max_gap(t0, time.perf_counter())
            quiet_itl = _max_bucket(quiet_before, await _itl_buckets(session, x_url))
            results = []
            for _ in range(a.bodies):
                before = await _itl_buckets(session, x_url)
                s0 = time.perf_counter()
                if body_file is not None:
                    status, answer = await _post_with_curl(x_url + GENERATE, body_file, big_sess)
                else:
                    async with session.post(x_url + GENERATE, data=body, headers={
                            "Content-Type": "application/json", SESSION_HEADER: big_sess}) as r:
                        answer = await r.read()
                        status = r.status
                answered = time.perf_counter()
                await asyncio.sleep(a.tail)
                proxy_itl = _max_bucket(before, await _itl_buckets(session, x_url))
                result: dict[str, Any] = {
                    "status": status, "answer_ms": round((answered - s0) * 1e3, 1),
                    "max_gap_ms": round(gaps.max_gap(s0, time.perf_counter()) * 1e3, 1),
                    "proxy_itl_bucket_ms": round(proxy_itl * 1e3, 1)}
                if status not in (200, 429):
                    result["answer"] = answer[:300].decode(errors="replace")
                results.append(result)
                await asyncio.sleep(a.tail)
            stop.set()
            for t in tasks:
                t.cancel()
            done = await asyncio.gather(*tasks, return_exceptions=True)
            errors = [repr(e) for e in done if isinstance(e, BaseException)
                      and not isinstance(e, asyncio.CancelledError)]
        return {"mode": a.mode, "layout": a.layout, "sender": a.sender, "body_bytes": len(body),
                "streams": a.streams,
                "itl_ms": a.itl_ms, "quiet_max_gap_ms": round(quiet_gap * 1e3, 1),
                "quiet_proxy_itl_bucket_ms": round(quiet_itl * 1e3, 1), "bodies": results,
                "max_gap_ms": max(r["max_gap_ms"] for r in results), "stream_errors": errors}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.body_stall", description=__doc__.split("\n")[0])
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--itl-ms", type=float, default=5.0)
    p.add_argument("--bodies", type=int, default=5)
    p.add_argument("--body-mib", type=float, default=16.0)
    p.add_argument("--tokens", type=int, default=1_000_000, help="prompt tokens of the pretty layout")
    p.add_argument("--layout", choices=["pretty", "compact"], default="pretty")
    p.add_argument("--mode", choices=["refused", "forward"], default="refused")
    p.add_argument("--warmup", type=float, default=1.0)
    p.add_argument("--quiet", type=float, default=3.0, help="seconds of the window without a big body")
    p.add_argument("--tail", type=float, default=0.5)
    p.add_argument("--proxy-arg", action="append", default=[], help="one more pd-proxy argument")
    p.add_argument("--sender", choices=["curl", "client"],
                   default="curl" if shutil.which("curl") else "client",
                   help="who sends the big bodies: curl (another process, so that writing 16 MiB does "
                        "not delay this process's reads of the streams) or this client")
    a = p.parse_args(argv)
    if not 1 <= a.streams <= _MAX_STREAMS or not 1 <= a.bodies <= _MAX_BODIES:
        p.error(f"--streams at most {_MAX_STREAMS}, --bodies at most {_MAX_BODIES}")
    print(json.dumps(asyncio.run(_run(a))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
