"""A recording reverse proxy in front of one worker: what a router sends it, and when.

    python -m benchmarks.hop_recorder --listen PORT --upstream URL --out FILE.jsonl

Every request (any method, any path) is forwarded to ``--upstream`` with its body bytes unchanged
and its headers unchanged but for the hop-by-hop ones (``Host``, ``Connection``, ``Keep-Alive``,
``Transfer-Encoding``, ...); the answer comes back the same way, its body relayed chunk by chunk as
it arrives (a stream stays a stream). Put one in front of a prefill worker and one in front of a
decode worker to see both hops of a P/D router.

One JSON line per request is appended to ``--out`` when the request ends (answered, failed, or its
client gone): ``method``, ``path`` (with the query), ``headers`` (``Authorization`` and
``Proxy-Authorization`` redacted), ``body`` (parsed JSON; ``body_text`` when it is not JSON),
``status``, ``response_headers``, ``outcome`` (``ok``, ``client_gone``, ``upstream_error``) and the
times: ``arrived`` (the request's headers were read; seconds since the epoch, the one clock every
recorder on the host shares), then, in ms after ``arrived``: ``body_read_ms`` (the body was read),
``headers_ms`` (the upstream's response headers came), ``chunks`` (one ``[ms, bytes]`` per body
chunk read from the upstream, in order), ``done_ms``; ``chunk_text`` (the answer's body as text,
up to ``--max-text`` characters) keeps the stream's events for the reader.

``--summarize P.jsonl D.jsonl`` prints, from the files of a recorder in front of a prefill worker
and one in front of a decode worker, when each decode hop went after its prefill hop's answer and
the side calls (anything but generate) per second to each worker (``hop_pairs``, ``side_calls``).

On start it prints one JSON line, ``{"event": "listening", "url": ..., "upstream": ...}``.
Each request is bounded by ``--timeout`` (s). Records are kept in memory only until written.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any, Final

import aiohttp
from aiohttp import web

HOP_BY_HOP: Final = frozenset({
    "connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade",
    "host", "content-length",
})
"""Headers that belong to one connection, not to the request: not forwarded either way
(``Content-Length`` is set from the bytes sent)."""
REDACTED: Final = frozenset({"authorization", "proxy-authorization"})
AUTO_HEADERS: Final = ("Accept", "Accept-Encoding", "User-Agent", "Content-Type")
"""aiohttp's client adds these when absent: skipped, so that only the router's own go upstream."""
DEFAULT_MAX_TEXT: Final = 1 << 20
GENERATE_PATH: Final = "/inference/v1/generate"


def redact(headers: Mapping[str, str]) -> list[list[str]]:
    """The headers in their order (repeats kept), credentials replaced by ``<redacted>``."""
    return [[k, "<redacted>" if k.lower() in REDACTED else v] for k, v in headers.items()]


def forwarded(headers: Mapping[str, str]) -> list[tuple[str, str]]:
    return [(k, v) for k, v in headers.items() if k.lower() not in HOP_BY_HOP]


def body_fields(raw: bytes) -> dict[str, Any]:
    """``body`` as parsed JSON, or ``body_text`` when it is not JSON (``body_bytes``: its size)."""
    out: dict[str, Any] = {"body_bytes": len(raw)}
    if not raw:
        return out
    try:
        out["body"] = json.loads(raw)
    except ValueError:
        out["body_text"] = raw.decode("utf-8", "replace")
    return out


class Recorder:
    """The forwarding and the record file. One per listening port; ``close`` flushes it."""

    def __init__(self, upstream: str, out: IO[str], *, timeout_s: float = 600.0,
                 max_text: int = DEFAULT_MAX_TEXT,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.upstream = upstream.rstrip("/")
        self.out = out
        self.timeout_s = timeout_s
        self.max_text = max_text
        self.clock = clock
        self.session: aiohttp.ClientSession | None = None
        self.count = 0

    async def start(self) -> None:
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), auto_decompress=False,
            timeout=aiohttp.ClientTimeout(total=self.timeout_s))

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()
        self.out.flush()

    def write(self, record: dict[str, Any]) -> None:
        self.out.write(json.dumps(record, separators=(",", ":")) + "\n")
        self.out.flush()
        self.count += 1

    async def handle(self, request: web.Request) -> web.StreamResponse:
        assert self.session is not None
        arrived, t0 = time.time(), self.clock()

        def ms() -> float:
            return round((self.clock() - t0) * 1000.0, 3)

        record: dict[str, Any] = {
            "arrived": arrived, "method": request.method, "path": request.path_qs,
            "headers": redact(request.headers), "outcome": "client_gone", "status": None,
        }
        chunks: list[list[float]] = []
        texts: list[str] = []
        text_left = self.max_text
        try:
            raw = await request.read()
            record["body_read_ms"] = ms()
            record.update(body_fields(raw))
            try:
                async with self.session.request(
                        request.method, self.upstream + request.path_qs, data=raw if raw else None,
                        headers=forwarded(request.headers), skip_auto_headers=AUTO_HEADERS,
                        allow_redirects=False) as up:
                    record["headers_ms"] = ms()
                    record["status"] = up.status
                    record["response_headers"] = redact(up.headers)
                    resp = web.StreamResponse(status=up.status, reason=up.reason)
                    for k, v in forwarded(up.headers):
                        resp.headers.add(k, v)
                    if up.content_length is not None:
                        resp.content_length = up.content_length
                    await resp.prepare(request)
                    async for chunk in up.content.iter_any():
                        chunks.append([ms(), len(chunk)])
                        if text_left > 0:
                            piece = chunk.decode("utf-8", "replace")[:text_left]
                            texts.append(piece)
                            text_left -= len(piece)
                        await resp.write(chunk)
                    await resp.write_eof()
            except (aiohttp.ClientError, TimeoutError) as e:
                record["outcome"] = "upstream_error"
                record["error"] = f"{type(e).__name__}: {e}"
                if "headers_ms" in record:
                    raise ConnectionResetError("the upstream broke mid-answer") from e
                return web.json_response(
                    {"error": {"message": f"hop_recorder: upstream {self.upstream}: {e}",
                               "type": "BadGateway", "param": None, "code": 502}}, status=502)
            record["outcome"] = "ok"
            return resp
        finally:
            record["done_ms"] = ms()
            record["chunks"] = chunks
            record["chunk_text"] = "".join(texts)
            self.write(record)


RECORDER_KEY: Final = web.AppKey("recorder", Recorder)


def build_app(upstream: str, out: IO[str], **kwargs: Any) -> web.Application:
    """The recording proxy as an aiohttp app (serve it with ``handler_cancellation=True``: a client
    that goes away then closes the upstream hop too, as it would have without the recorder)."""
    recorder = Recorder(upstream, out, **kwargs)
    app = web.Application(client_max_size=1 << 30)
    app[RECORDER_KEY] = recorder
    app.router.add_route("*", "/{tail:.*}", recorder.handle)

    async def on_startup(_: web.Application) -> None:
        await recorder.start()

    async def on_cleanup(_: web.Application) -> None:
        await recorder.close()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    return app


def read_records(path: Path) -> list[dict[str, Any]]:
    """The records of a ``--out`` file, in the order they ended."""
    with path.open() as fh:
        return [json.loads(line) for line in fh if line.strip()]


def _prompt(record: Mapping[str, Any]) -> tuple[int, ...] | None:
    body = record.get("body")
    if record.get("path") != GENERATE_PATH or not isinstance(body, dict):
        return None
    ids = body.get("token_ids")
    return tuple(ids) if isinstance(ids, list) else None


def hop_pairs(prefill: Sequence[Mapping[str, Any]],
              decode: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Each decode hop with the prefill hop of the same prompt (the last one before it), and when
    it went (ms): ``d_after_p_last_ms`` (D's request arrived after P's last answer byte),
    ``p_answer_ms`` (P's last byte after P's request), ``d_first_chunk_ms`` / ``d_last_chunk_ms``
    (after D's request). Decode hops without a prefill hop (decode-only) are left out."""
    by_prompt: dict[tuple[int, ...], list[Mapping[str, Any]]] = {}
    for p in prefill:
        key = _prompt(p)
        if key is not None and p.get("chunks"):
            by_prompt.setdefault(key, []).append(p)
    out: list[dict[str, Any]] = []
    for d in decode:
        key = _prompt(d)
        before = [p for p in by_prompt.get(key, []) if p["arrived"] <= d["arrived"]] if key else []
        if not before or not d.get("chunks"):
            continue
        p = max(before, key=lambda r: r["arrived"])
        p_last = p["arrived"] + p["chunks"][-1][0] / 1000.0
        out.append({
            "arrived": d["arrived"],
            "p_answer_ms": p["chunks"][-1][0],
            "d_after_p_last_ms": round((d["arrived"] - p_last) * 1000.0, 3),
            "d_first_chunk_ms": d["chunks"][0][0],
            "d_last_chunk_ms": d["chunks"][-1][0],
        })
    return out


def side_calls(records: Sequence[Mapping[str, Any]], start: float, end: float) -> dict[str, float]:
    """Calls other than generate per second, by ``METHOD path``, that arrived in [start, end)."""
    counts: dict[str, int] = {}
    for r in records:
        if start <= r["arrived"] < end and r.get("path") != GENERATE_PATH:
            name = f"{r['method']} {str(r['path']).split('?')[0]}"
            counts[name] = counts.get(name, 0) + 1
    span = max(end - start, 1e-9)
    return {k: counts[k] / span for k in sorted(counts)}


def summary(prefill: Sequence[Mapping[str, Any]], decode: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Median and largest of each ``hop_pairs`` figure, and each worker's side calls per second
    over the span of both files."""
    pairs = hop_pairs(prefill, decode)
    out: dict[str, Any] = {"pairs": len(pairs)}
    for name in ("p_answer_ms", "d_after_p_last_ms", "d_first_chunk_ms", "d_last_chunk_ms"):
        xs = [p[name] for p in pairs]
        out[name] = {"p50": statistics.median(xs), "max": max(xs)} if xs else None
    times = [r["arrived"] for r in (*prefill, *decode)]
    if times:
        start, end = min(times), max(times)
        out["side_calls_per_s"] = {"prefill": side_calls(prefill, start, end),
                                   "decode": side_calls(decode, start, end)}
    return out


async def serve(host: str, port: int, upstream: str, out: Path, *, timeout_s: float, max_text: int,
                stop: asyncio.Event) -> None:
    with out.open("a") as fh:
        app = build_app(upstream, fh, timeout_s=timeout_s, max_text=max_text)
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=2.0)
        await runner.setup()
        try:
            site = web.TCPSite(runner, host, port)
            await site.start()
            bound = next(a for a in runner.addresses if isinstance(a, tuple))
            print(json.dumps({"event": "listening", "url": f"http://{host}:{bound[1]}", "port": bound[1],
                              "upstream": upstream}), flush=True)
            await stop.wait()
        finally:
            await runner.cleanup()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.hop_recorder",
                                description=(__doc__ or "").split("\n")[0])
    p.add_argument("--listen", type=int, help="port (0: the OS picks; printed)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--upstream", help="the worker's base URL")
    p.add_argument("--out", type=Path, help="JSON lines file (appended to)")
    p.add_argument("--summarize", nargs=2, type=Path, metavar=("PREFILL.jsonl", "DECODE.jsonl"),
                   help="instead of serving: print the hop timings and side calls of two record files")
    p.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    p.add_argument("--max-text", type=int, default=DEFAULT_MAX_TEXT,
                   help="characters of each answer's body kept in chunk_text")
    a = p.parse_args(argv)
    if a.summarize:
        print(json.dumps(summary(read_records(a.summarize[0]), read_records(a.summarize[1])), indent=1))
        return 0
    if a.listen is None or a.upstream is None or a.out is None:
        p.error("--listen, --upstream and --out are required (or --summarize)")

    async def run() -> None:
        import signal  # noqa: PLC0415

        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, stop.set)
        await serve(a.host, a.listen, a.upstream, a.out, timeout_s=a.timeout, max_text=a.max_text, stop=stop)

    asyncio.run(run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
