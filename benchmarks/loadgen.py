"""Arrival schedules and the async driver that sends requests on them.

Open loop: Poisson (burstiness 1) or gamma arrivals at ``rate`` requests/s, like vllm bench serve
(without its rescaling of the total span, so the realised rate is a sample). Closed loop: a cap on
requests in flight per target. Both can be combined. The driver stops sending at the time limit
and lets requests already sent finish (each is bounded by its own timeout).
"""

from __future__ import annotations

import asyncio
import math
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TextIO

import numpy as np

from benchmarks.datasets import RequestSpec
from benchmarks.records import RequestRecord


def arrival_offsets(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send times in seconds since the start, the first at 0.

    ``rate`` infinite: everyone at once. Gaps are gamma(shape=burstiness, scale=1/(rate*burstiness)):
    exponential (a Poisson process) at burstiness 1, burstier below 1, more regular above; an
    infinite burstiness gives evenly spaced arrivals.
    """
    if n < 0:
        raise ValueError("n must be >= 0")
    if not rate > 0:
        raise ValueError("request rate must be positive")
    if not burstiness > 0:
        raise ValueError("burstiness must be positive")
    if math.isinf(rate):
        return [0.0] * n
    if math.isinf(burstiness):
        return [i / rate for i in range(n)]
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=max(0, n - 1))
    return [0.0, *np.cumsum(gaps).tolist()][:n]


@dataclass(frozen=True, slots=True)
class Job:
    """One send: which request, to which target, when (seconds since the start)."""

    index: int
    target: int
    spec: RequestSpec
    offset_s: float


SendFn = Callable[[Job, float], Awaitable[RequestRecord]]


class Progress:
    """A plain-text progress bar on stderr: redrawn in place on a terminal, a line per 10% otherwise."""

    def __init__(self, total: int, label: str = "pd-bench", stream: TextIO | None = None) -> None:
        self.total = max(total, 1)
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.done = 0
        self.failed = 0
        self._t0 = time.perf_counter()
        self._last_draw = 0.0
        self._last_decile = -1
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())

    def update(self, rec: RequestRecord) -> None:
        self.done += 1
        if not rec.success:
            self.failed += 1
        now = time.perf_counter()
        decile = self.done * 10 // self.total
        if self._tty and (now - self._last_draw >= 0.1 or self.done == self.total):
            self._last_draw = now
            self.stream.write("\r" + self.line())
            self.stream.flush()
        elif not self._tty and decile != self._last_decile:
            self._last_decile = decile
            self.stream.write(self.line() + "\n")
            self.stream.flush()

    def line(self) -> str:
        width = 30
        filled = min(width, self.done * width // self.total)
        bar = "#" * filled + "." * (width - filled)
        elapsed = time.perf_counter() - self._t0
        return (
            f"{self.label} [{bar}] {self.done}/{self.total} ok {self.done - self.failed} "
            f"failed {self.failed} {elapsed:6.1f}s"
        )

    def close(self) -> None:
        if self._tty:
            self.stream.write("\n")
            self.stream.flush()


async def drive(
    jobs: Sequence[Job],
    send: SendFn,
    max_concurrency: int | None = None,
    time_limit_s: float | None = None,
    progress: Progress | None = None,
) -> tuple[list[RequestRecord], float]:
    """Send ``jobs`` on their schedule; return the records (in job order) and the duration.

    The duration runs from the start to the end of the last request. If this coroutine is
    cancelled, every request in flight is cancelled too (closing its connection).
    """
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError("max_concurrency must be at least 1")
    sems: dict[int, asyncio.Semaphore] = {}
    t0 = time.perf_counter()
    tasks: list[asyncio.Task[RequestRecord]] = []

    async def one(job: Job, sem: asyncio.Semaphore | None) -> RequestRecord:
        try:
            rec = await send(job, t0)
        finally:
            if sem is not None:
                sem.release()
        if progress is not None:
            progress.update(rec)
        return rec

    def over_limit() -> bool:
        return time_limit_s is not None and time.perf_counter() - t0 >= time_limit_s

    try:
        for job in jobs:
            delay = t0 + job.offset_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if over_limit():
                break
            sem: asyncio.Semaphore | None = None
            if max_concurrency is not None:
                sem = sems.setdefault(job.target, asyncio.Semaphore(max_concurrency))
                if time_limit_s is None:
                    await sem.acquire()
                else:
                    remaining = t0 + time_limit_s - time.perf_counter()
                    try:
                        await asyncio.wait_for(sem.acquire(), timeout=max(remaining, 0.0))
                    except TimeoutError:
                        break
            tasks.append(asyncio.create_task(one(job, sem)))
        records = list(await asyncio.gather(*tasks))
    finally:
        pending = [t for t in tasks if not t.done()]
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        if progress is not None:
            progress.close()
    return records, time.perf_counter() - t0
