"""What writing a client's event stream costs the proxy, without the socket: aiohttp's
``StreamResponse`` and ``StreamWriter`` (``--front aiohttp``, and the front before ``FrontStream``)
against the front's ``FrontStream``.

    python benchmarks/internals/stream_write.py [--writes N] [--streams N] [--repeat R]

Both write to a transport that only counts the bytes (no syscall: what is measured is the Python
around ``transport.write``), on a ``proxy.front.Front`` connection and its ``FrontRequest``:

- per write: one event (a 100-byte token chunk) written ``--writes`` times on a prepared stream;
- per stream: ``--streams`` whole streams, each prepared, its first event written with the
  head, two more events, and the end (``write_eof`` with the last event): the writes of a
  stream whose events come one at a time, as a real decode worker sends them.

Prints the best of ``--repeat`` runs of each, in microseconds, and checks that both wrote the
same bytes (but the ``Date`` header). Numbers in ``benchmarks/README.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

_TREE = str(Path(__file__).resolve().parents[2])
if _TREE not in sys.path:
    sys.path.append(_TREE)

from proxy.front import Front, FrontRequest, FrontRoute, Head  # noqa: E402
from proxy.relay import EventStream  # noqa: E402

EVENT = (b'data: {"request_id":"generate-tokens-bench","choices":[{"index":0,"token_ids":[1234],'
         b'"finish_reason":null}]}\n\n')
HEADERS = {"X-Request-Id": "bench", "Content-Type": "text/event-stream; charset=utf-8",
           "Cache-Control": "no-cache"}
WRITERS = ("aiohttp", "front")
_DATE = re.compile(rb"\r\nDate: [^\r]*")


class _Counting(asyncio.Transport):
    """A transport that keeps what is written (or only counts it)."""

    def __init__(self, keep: bool) -> None:
        super().__init__()
        self.keep = keep
        self.data = bytearray()
        self.written = 0

    def write(self, data: Any) -> None:
        self.written += len(data)
        if self.keep:
            self.data += data

    def writelines(self, list_of_data: Any) -> None:
        for data in list_of_data:
            self.write(data)

    def is_closing(self) -> bool:
        return False

    def get_write_buffer_size(self) -> int:
        return 0


class _Server:
    """The little of ``FrontServer`` a ``Front`` reads before ``connection_made``."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop


def _connection(loop: asyncio.AbstractEventLoop, keep: bool) -> tuple[Front, FrontRequest, _Counting]:
    front = Front(cast(Any, _Server(loop)))
    transport = _Counting(keep)
    front.transport = transport
    head = Head(FrontRoute(cast(Any, None)), "/inference/v1/generate", CIMultiDictProxy(CIMultiDict()),
                0, 0, True)
    return front, FrontRequest(front, cast(web.Application, None), head, b""), transport


def _response(writer: str, request: FrontRequest) -> web.StreamResponse:
    if writer == "front":
        return request.stream(HEADERS, headers_with_first_write=True)
    return EventStream(status=200, headers=HEADERS)


async def _one_stream(writer: str, request: FrontRequest) -> None:
    resp = _response(writer, request)
    await resp.prepare(cast(web.Request, request))
    await resp.write(EVENT)  # with the head
    await resp.write(EVENT)
    await resp.write(EVENT)
    await resp.write_eof(EVENT + b"data: [DONE]\n\n")


async def same_bytes() -> bool:
    """Both writers' bytes for one stream, but the ``Date`` header, are the same."""
    loop = asyncio.get_running_loop()
    out = []
    for writer in WRITERS:
        _, request, transport = _connection(loop, keep=True)
        await _one_stream(writer, request)
        out.append(_DATE.sub(b"", bytes(transport.data)))
    return out[0] == out[1] and out[0].startswith(b"HTTP/1.1 200 OK\r\n")


async def _best(repeat: int, count: int, run: Callable[[], Any]) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        await run()
        best = min(best, (time.perf_counter() - start) / count)
    return best * 1e6


async def measure(writes: int, streams: int, repeat: int) -> dict[str, dict[str, float]]:
    """Per writer: microseconds per write and per stream (the best of ``repeat`` runs)."""
    loop = asyncio.get_running_loop()
    out: dict[str, dict[str, float]] = {}
    for writer in WRITERS:
        _, request, _ = _connection(loop, keep=False)

        async def per_write(writer: str = writer, request: FrontRequest = request) -> None:
            resp = _response(writer, request)
            await resp.prepare(cast(web.Request, request))
            for _ in range(writes):
                await resp.write(EVENT)

        async def per_stream(writer: str = writer, request: FrontRequest = request) -> None:
            for _ in range(streams):
                await _one_stream(writer, request)

        out[writer] = {"write_us": await _best(repeat, writes, per_write),
                       "stream_us": await _best(repeat, streams, per_stream)}
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--writes", type=int, default=20000, help="writes per run (at most 1,000,000)")
    p.add_argument("--streams", type=int, default=5000, help="streams per run (at most 100,000)")
    p.add_argument("--repeat", type=int, default=5, help="runs of each (at most 50)")
    a = p.parse_args(argv)
    if not (1 <= a.writes <= 1_000_000 and 1 <= a.streams <= 100_000 and 1 <= a.repeat <= 50):
        p.error("--writes 1..1000000, --streams 1..100000, --repeat 1..50")
    if not asyncio.run(same_bytes()):
        raise SystemExit("the two writers wrote different streams")
    result = asyncio.run(measure(a.writes, a.streams, a.repeat))
    for writer, r in result.items():
        print(f"{writer:8s} {r['write_us']:.2f} us per write, {r['stream_us']:.2f} us per stream "
              "(prepare, 3 writes, the end)")


if __name__ == "__main__":
    main()
