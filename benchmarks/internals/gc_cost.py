"""What Python's cyclic garbage collector costs pd-proxy per request, under load.

    python benchmarks/internals/gc_cost.py MODE [stream]

MODE: ``default`` (Python's collector as it starts: thresholds 700/10/10), ``off``
(``gc.disable()``), or ``t[_f]_A_B_C`` (``gc.set_threshold(A, B, C)``, ``_f``: ``gc.freeze()``
first). Serves pd-proxy (this tree) in this process on loopback in front of two ``pd-sim --zero-
latency`` workers, loaded from ``call_counts``' client subprocess (``call_counts.loaded_proxy``: 64
at a time, 256 prompt tokens, 32 output tokens): after the warm-up, three rounds of 3,000 requests,
each printing the process's CPU per request, the time spent in collections per request
(``gc.callbacks``), collections per request and full collections in the round. The proxy here is
built with ``build_app`` (pd-proxy leaves Python's collector as it is: MODE is the collector's
setting). Numbers in ``benchmarks/README.md``.
"""

from __future__ import annotations

import asyncio
import gc
import importlib.util
import sys
import time
from pathlib import Path
from typing import Any

_CC = Path(__file__).with_name("call_counts.py")
_TREE = str(Path(__file__).resolve().parents[2])
N = 3000


def _call_counts() -> Any:
    spec = importlib.util.spec_from_file_location("call_counts", _CC)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def settle(mode: str) -> None:
    if mode == "off":
        gc.disable()
    elif mode.startswith("t"):
        parts = [p for p in mode[1:].split("_") if p]
        if parts[0] == "f":
            gc.freeze()
            parts = parts[1:]
        a, b, c = map(int, parts)
        gc.set_threshold(a, b, c)
    elif mode != "default":
        raise SystemExit(f"unknown mode {mode!r}")


async def main(mode: str, stream: bool) -> None:
    async with _call_counts().loaded_proxy(N, stream, _TREE) as one_round:
        settle(mode)
        spent = [0.0, 0, 0]
        began: list[float] = [0.0]

        def timed(phase: str, info: dict[str, int]) -> None:
            if phase == "start":
                began[0] = time.perf_counter()
            else:
                spent[0] += time.perf_counter() - began[0]
                spent[1] += 1
                spent[2] += info["generation"] == 2

        gc.callbacks.append(timed)
        print(f"{mode} {'stream' if stream else 'non-stream'}, {N} requests a round, 64 at a time")
        try:
            for _ in range(3):
                spent[:] = [0.0, 0, 0]
                cpu = time.process_time()
                await one_round()
                cpu = time.process_time() - cpu
                print(f"  CPU {cpu / N * 1e6:.0f} us/request, collections {spent[0] / N * 1e6:.1f} "
                      f"us/request ({spent[1] / N:.3f} a request, {spent[2]} full)")
        finally:
            gc.callbacks.remove(timed)


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
        raise SystemExit(__doc__)
    try:
        import uvloop
    except ImportError:
        asyncio.run(main(sys.argv[1], sys.argv[2:] == ["stream"]))
    else:
        uvloop.run(main(sys.argv[1], sys.argv[2:] == ["stream"]))
