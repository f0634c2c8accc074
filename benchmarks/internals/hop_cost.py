"""Client CPU per upstream hop: pd-proxy's ``Upstream`` against aiohttp's client and a bare one.

    python -m benchmarks.internals.hop_cost [--calls 2000] [--rounds 2] [--prompt-len 128] [--max-tokens 32]
                                  [--stream]

What does an upstream hop cost pd-proxy in CPU, and what would a cheaper client save? Starts
``pd-sim --zero-latency`` (decode role, pinned to core 0 with ``taskset`` when there is one),
then, in this process, makes ``--calls`` sequential non-stream generate calls per client and
round, on one kept-alive connection each:

* ``upstream``: ``proxy.upstream.client.Upstream.post_generate_raw`` as ``proxy.http.app`` sets it up (the
  generate hops go through ``proxy.upstream.hop.HopClient``; the reply parsed to a dict and kept as bytes);
* ``aiohttp``: the same call through ``aiohttp.ClientSession`` (pooled ``TCPConnector``, a
  ``ClientTimeout`` per call), as pd-proxy made its hops before ``proxy.upstream.hop``;
* ``minimal``: a bare HTTP/1.1 client over ``asyncio`` streams (request bytes by hand,
  Content-Length or chunked body) that serialises the same body and parses the same reply.

With ``--stream`` the calls are streaming ones (one chunk per token from pd-sim) and each client
reads the body as it arrives without parsing it: ``Upstream.pipe`` (what the proxy's decode
reader reads through: each read handed to a callback), aiohttp's ``content.iter_any``, and the
bare client's chunk-by-chunk reads.

Reports this process's CPU time per call (``time.process_time``: the worker's CPU is not in it)
as one JSON line. uvloop when installed, as ``pd-proxy`` runs. Bounded: ``--calls`` at most 100,000.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shutil
import sys
import time
from collections.abc import Sequence
from typing import Any

import aiohttp

from proxy.upstream.client import Upstream

GENERATE = "/inference/v1/generate"
_MAX_CALLS = 100_000
_WARMUP = 50


def request_body(prompt_len: int, max_tokens: int, stream: bool = False) -> dict[str, Any]:
    return {"token_ids": [3 + (k * 7) % 500 for k in range(prompt_len)],
            "sampling_params": {"temperature": 0, "max_tokens": max_tokens, "ignore_eos": True},
            "stream": stream}


class MinimalClient:
    """One kept-alive HTTP/1.1 connection; POST JSON, read the whole reply."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host: str) -> None:
        self.reader, self.writer, self.host = reader, writer, host.encode()

    @classmethod
    async def connect(cls, host: str, port: int) -> MinimalClient:
        reader, writer = await asyncio.open_connection(host, port)
        return cls(reader, writer, f"{host}:{port}")

    async def post_json(self, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any], bytes]:
        payload = json.dumps(body, separators=(",", ":")).encode()
        self.writer.write(b"POST " + path.encode() + b" HTTP/1.1\r\nHost: " + self.host
                          + b"\r\nContent-Type: application/json\r\nContent-Length: "
                          + str(len(payload)).encode() + b"\r\n\r\n" + payload)
        head = await self.reader.readuntil(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        status = int(lines[0].split(b" ", 2)[1])
        length: int | None = None
        chunked = False
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                length = int(value)
            elif name == b"transfer-encoding":
                chunked = b"chunked" in value.lower()
        if length is not None:
            raw = await self.reader.readexactly(length)
        elif chunked:
            parts = []
            while size := int((await self.reader.readuntil(b"\r\n"))[:-2].split(b";")[0], 16):
                parts.append(await self.reader.readexactly(size))
                await self.reader.readexactly(2)
            await self.reader.readuntil(b"\r\n")
            raw = b"".join(parts)
        else:
            raise ValueError("a reply with neither Content-Length nor chunked encoding")
        return status, ({} if body.get("stream") else json.loads(raw)), raw

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(OSError):
            await self.writer.wait_closed()


def _check_stream_end(tail: bytes) -> None:
    if not tail.endswith(b"data: [DONE]\n\n"):
        raise RuntimeError(f"a stream that did not end with [DONE]: {tail[-80:]!r}")


async def _upstream_cost(worker: str, body: dict[str, Any], calls: int) -> float:
    async with aiohttp.ClientSession() as session:
        up = Upstream(session, api_key=None, connect_timeout=2.0)
        try:
            async def call(request_id: str) -> None:
                if not body["stream"]:
                    await up.post_generate_raw("decode", worker, body, request_id=request_id, total=30.0)
                    return
                resp = await up.open("decode", worker, body, request_id=request_id, total=30.0)
                tail = b""

                def sink(chunk: bytes) -> bool:
                    nonlocal tail
                    tail = (tail + chunk)[-32:]
                    return True

                try:
                    await up.pipe("decode", worker, resp, sink)
                finally:
                    resp.close()
                _check_stream_end(tail)

            for i in range(_WARMUP):
                await call(f"w{i}")
            t0 = time.process_time()
            for i in range(calls):
                await call(f"u{i}")
            return (time.process_time() - t0) / calls
        finally:
            await up.hops.close()


async def _aiohttp_cost(worker: str, body: dict[str, Any], calls: int) -> float:
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=4.0)
    timeout = aiohttp.ClientTimeout(total=30.0, sock_connect=2.0, connect=2.0)

    async def call(request_id: str) -> None:
        data = json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()
        headers = {"Content-Type": "application/json", "X-Request-Id": request_id}
        async with session.post(worker + GENERATE, data=data, headers=headers, timeout=timeout) as r:
            if body["stream"]:
                tail = b""
                async for chunk in r.content.iter_any():
                    tail = (tail + chunk)[-32:]
                _check_stream_end(tail)
                return
            raw = await r.read()
        json.loads(raw)

    async with aiohttp.ClientSession(connector=connector, auto_decompress=False) as session:
        for i in range(_WARMUP):
            await call(f"w{i}")
        t0 = time.process_time()
        for i in range(calls):
            await call(f"a{i}")
        return (time.process_time() - t0) / calls


async def _minimal_cost(host: str, port: int, body: dict[str, Any], calls: int) -> float:
    client = await MinimalClient.connect(host, port)
    try:
        for _ in range(_WARMUP):
            await client.post_json(GENERATE, body)
        t0 = time.process_time()
        for _ in range(calls):
            status, _, raw = await client.post_json(GENERATE, body)
            if status != 200:
                raise RuntimeError(f"the worker answered {status}")
            if body["stream"]:
                _check_stream_end(raw)
        return (time.process_time() - t0) / calls
    finally:
        await client.close()


async def measure(calls: int, rounds: int, prompt_len: int, max_tokens: int,
                  stream: bool = False) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "workers.sim.cli", "--host", "127.0.0.1", "--port", "0",
           "--role", "decode", "--zero-latency"]
    if shutil.which("taskset"):
        cmd = ["taskset", "-c", "0", *cmd]
    proc = await asyncio.create_subprocess_exec(*cmd, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.DEVNULL)
    try:
        assert proc.stdout is not None
        url = str(json.loads(await asyncio.wait_for(proc.stdout.readline(), 30))["url"])
        host, port = url.removeprefix("http://").rsplit(":", 1)
        body = request_body(prompt_len, max_tokens, stream)
        upstream: list[float] = []
        via_aiohttp: list[float] = []
        minimal: list[float] = []
        for _ in range(rounds):  # alternated, so that drift hits all three
            upstream.append(await _upstream_cost(url, body, calls))
            via_aiohttp.append(await _aiohttp_cost(url, body, calls))
            minimal.append(await _minimal_cost(host, int(port), body, calls))
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        await proc.wait()
    best_u, best_a, best_m = min(upstream), min(via_aiohttp), min(minimal)
    return {"calls": calls, "rounds": rounds, "prompt_len": prompt_len, "max_tokens": max_tokens,
            "stream": stream,
            "upstream_us_per_call": [round(x * 1e6, 1) for x in upstream],
            "aiohttp_us_per_call": [round(x * 1e6, 1) for x in via_aiohttp],
            "minimal_us_per_call": [round(x * 1e6, 1) for x in minimal],
            "upstream_over_minimal_us": round((best_u - best_m) * 1e6, 1),
            "aiohttp_over_minimal_us": round((best_a - best_m) * 1e6, 1)}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.internals.hop_cost",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--stream", action="store_true", help="streaming calls, the body read as it arrives")
    a = p.parse_args(argv)
    if not 1 <= a.calls <= _MAX_CALLS or a.rounds < 1:
        p.error(f"--calls must be 1..{_MAX_CALLS} and --rounds at least 1")
    try:
        import uvloop  # noqa: PLC0415
    except ImportError:
        runner = asyncio.run
    else:
        runner = uvloop.run
    print(json.dumps(runner(measure(a.calls, a.rounds, a.prompt_len, a.max_tokens, a.stream))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
