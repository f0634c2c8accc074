"""Arrival schedules and the async driver that sends requests on them.

Open loop: Poisson (burstiness 1) or gamma arrivals at ``rate`` requests/s, like vllm bench serve
(without its rescaling of the total span, so the realised rate is a sample), or a rate that ramps
up from one value to another over the run (vLLM's ``--ramp-up-strategy``). Closed loop: a cap on
requests in flight per target. Both can be combined, as in vLLM: requests arrive on the schedule
and wait for a free slot. The driver stops sending at the time limit and lets requests already
sent finish (each is bounded by its own timeout).
"""

from __future__ import annotations

import asyncio
import math
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Final, TextIO

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
    import numpy as np  # noqa: PLC0415

    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=max(0, n - 1))
    return [0.0, *np.cumsum(gaps).tolist()][:n]


RAMP_UP_STRATEGIES: Final = ("linear", "exponential")


def ramp_up_rates(n: int, strategy: str, start_rps: float, end_rps: float) -> list[float]:
    """The arrival rate in force for each of ``n`` requests (vLLM's ramp-up): from ``start_rps``
    for the first to ``end_rps`` for the last, linearly or geometrically in the request index."""
    if strategy not in RAMP_UP_STRATEGIES:
        raise ValueError(f"ramp-up strategy must be one of {', '.join(RAMP_UP_STRATEGIES)}")
    if not 0 < start_rps <= end_rps:
        raise ValueError("ramp-up needs 0 < start rps <= end rps")
    out: list[float] = []
    for i in range(n):
        progress = i / max(n - 1, 1)
        if strategy == "linear":
            out.append(start_rps + (end_rps - start_rps) * progress)
        else:
            out.append(start_rps * (end_rps / start_rps) ** progress)
    return out


def ramp_up_offsets(rates: list[float], burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send times for a ramp: the gap before request i is gamma(burstiness) at ``rates[i]``
    (evenly spaced for an infinite burstiness); the first request goes at 0."""
    if not burstiness > 0:
        raise ValueError("burstiness must be positive")
    if math.isinf(burstiness):
        gaps = [1.0 / r for r in rates[1:]]
    else:
        import numpy as np  # noqa: PLC0415

        rng = np.random.default_rng(seed)
        gaps = [float(rng.gamma(shape=burstiness, scale=1.0 / (r * burstiness))) for r in rates[1:]]
    out = [0.0] if rates else []
    for g in gaps:
        out.append(out[-1] + g)
    return out


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
        self.cancelled = 0
        self._t0 = time.perf_counter()
        self._last_draw = 0.0
        self._last_decile = -1
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())

    def update(self, rec: RequestRecord) -> None:
        self.done += 1
        if rec.cancelled:
            self.cancelled += 1
        elif not rec.success:
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
        ok = self.done - self.failed - self.cancelled
        cancelled = f" cancelled {self.cancelled}" if self.cancelled else ""
        return (
            f"{self.label} [{bar}] {self.done}/{self.total} ok {ok} "
            f"failed {self.failed}{cancelled} {elapsed:6.1f}s"
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
    *,
    t0: float | None = None,
) -> tuple[list[RequestRecord], float]:
    """Send ``jobs`` on their schedule; return the records (in job order) and the duration.

    The duration runs from the start (``t0``, a ``perf_counter`` reading; default now) to the end
    of the last request. If this coroutine is cancelled, every request in flight is cancelled too
    (closing its connection).
    """
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError("max_concurrency must be at least 1")
    sems: dict[int, asyncio.Semaphore] = {}
    t0 = time.perf_counter() if t0 is None else t0
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
