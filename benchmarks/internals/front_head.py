"""How the front's head parse grows with a run of blanks inside a header value.

    python benchmarks/internals/front_head.py [--lengths 1000,4000,8000] [--reps 5]

``proxy.front.parse_head`` is run in process on a plain generate head (``Content-Length: 2``)
with one extra header ``X-Pad: a<N blanks>b``, the longest head the front parses itself being
8 KiB. Prints the median time per parse for each N. A parse must stay linear in the head's length:
it runs in the event loop before any key check, so a slow one stalls every connection.
"""

from __future__ import annotations

import argparse
import statistics
import time

from aiohttp import web

from proxy.front import FrontRoute, parse_head

PATH = "/inference/v1/generate"


async def never(request: web.Request) -> web.StreamResponse:
    raise AssertionError("parse_head never calls a route's handler")


ROUTES = {PATH: FrontRoute(never)}


def head(blanks: int) -> bytearray:
    return bytearray(b"POST " + PATH.encode() + b" HTTP/1.1\r\nContent-Length: 2\r\nX-Pad: a"
                     + b" " * blanks + b"b\r\n\r\n{}")


def time_parse(blanks: int, reps: int) -> float:
    """Median seconds per ``parse_head`` of ``head(blanks)``."""
    buf = head(blanks)
    assert parse_head(buf, ROUTES, 1 << 20) is not None
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        parse_head(buf, ROUTES, 1 << 20)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="1000,4000,8000", help="blank runs to try (comma-separated)")
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args(argv)
    print(f"{'blanks':>8}  {'parse (ms)':>10}")
    for n in (int(x) for x in args.lengths.split(",")):
        print(f"{n:>8}  {time_parse(n, args.reps) * 1e3:>10.3f}")


if __name__ == "__main__":
    main()
