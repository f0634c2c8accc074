"""Admission control: in-flight limits with a bounded FIFO wait queue, and per-request deadlines.

``WaitQueue`` wakes one waiter at a time, the oldest that can use the freed capacity; a full queue
or a wait past its limit raises ``Overloaded`` (429). ``Deadline`` splits what remains of
``X-PD-Deadline-Ms`` across the hops, so no call waits without a bound."""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from proxy.pools.errors import DeadlineExceeded, Overloaded
from proxy.wire.errors import InvalidRequest

DEADLINE_HEADER = "X-PD-Deadline-Ms"


class WaitQueue:
    def __init__(self, max_waiters: int, *, retry_after: float = 1.0, what: str = "proxy") -> None:
        if max_waiters < 0:
            raise ValueError("max_waiters must be >= 0")
        self.max_waiters = max_waiters
        self.retry_after = retry_after
        self.what = what
        self._waiters: deque[tuple[asyncio.Future[None], Callable[[], bool] | None]] = deque()
        self.rejected_full = 0
        self.rejected_timeout = 0

    def __len__(self) -> int:
        return sum(1 for f, _ in self._waiters if not f.done())

    async def wait(self, limit: float | None, can_use: Callable[[], bool] | None = None) -> None:
        """Wait for a :meth:`wake` (FIFO); ``Overloaded`` if full or when ``limit`` passes. A waiter
        whose ``can_use`` says no is passed over."""
        if len(self) >= self.max_waiters:
            self.rejected_full += 1
            raise Overloaded(f"the {self.what} is at capacity and its wait queue is full",
                             retry_after=self.retry_after, reason="queue_full")
        if limit is not None and limit <= 0:
            self.rejected_timeout += 1
            raise Overloaded(f"the {self.what} is at capacity", retry_after=self.retry_after,
                             reason="queue_timeout")
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (fut, can_use)
        self._waiters.append(entry)
        woken = False
        try:
            async with asyncio.timeout(limit):
                await fut
            woken = True
        except TimeoutError:
            self.rejected_timeout += 1
            raise Overloaded(f"the {self.what} stayed at capacity for the whole wait",
                             retry_after=self.retry_after, reason="queue_timeout") from None
        finally:
            if not woken and fut.done() and not fut.cancelled():
                self.wake()  # woken, but leaving anyway (cancelled, timed out): pass the turn on
            if not fut.done():
                fut.cancel()
            with contextlib.suppress(ValueError):
                self._waiters.remove(entry)

    def wake(self) -> None:
        """Capacity freed: wake the oldest live waiter that can use it."""
        for entry in list(self._waiters):
            fut, can_use = entry
            if fut.done():
                self._waiters.remove(entry)
            elif can_use is None or can_use():
                self._waiters.remove(entry)
                fut.set_result(None)
                return


class Admission:
    """At most ``max_inflight`` requests through the proxy at once (None: no limit)."""

    def __init__(self, max_inflight: int | None, *, max_queue: int = 64, queue_timeout: float = 5.0,
                 retry_after: float = 1.0) -> None:
        if max_inflight is not None and max_inflight < 1:
            raise ValueError("max_inflight must be at least 1")
        self.max_inflight = max_inflight
        self.queue_timeout = queue_timeout
        self.inflight = 0
        self.queue = WaitQueue(max_queue, retry_after=retry_after, what="proxy")

    def _has_room(self) -> bool:
        return self.max_inflight is None or self.inflight < self.max_inflight

    async def acquire(self, limit: float | None = None) -> None:
        """Take a slot, waiting at most ``min(limit, queue_timeout)``; raise ``Overloaded``."""
        wait_for = self.queue_timeout if limit is None else min(limit, self.queue_timeout)
        if self._has_room() and len(self.queue) == 0:
            self.inflight += 1
            return
        loop = asyncio.get_running_loop()
        end = loop.time() + wait_for
        while True:
            await self.queue.wait(end - loop.time())
            if self._has_room():
                self.inflight += 1
                return

    def release(self) -> None:
        self.inflight = max(0, self.inflight - 1)
        self.queue.wake()


@dataclass(frozen=True, slots=True)
class Deadline:
    """An absolute deadline on the proxy's monotonic clock."""

    at: float
    clock: Callable[[], float]

    @classmethod
    def from_header(cls, value: str | None, *, default_ms: float | None, clock: Callable[[], float],
                    max_ms: float | None = None) -> Deadline | None:
        """Parse ``X-PD-Deadline-Ms`` (milliseconds from now); bad values are a 400."""
        if value is None:
            ms = default_ms
        else:
            try:
                ms = float(value)
            except ValueError:
                ms = math.nan
            if not math.isfinite(ms) or ms <= 0:
                raise InvalidRequest(f"{DEADLINE_HEADER} must be a positive number of milliseconds",
                                     param=DEADLINE_HEADER)
        if ms is None:
            return None
        if max_ms is not None:
            ms = min(ms, max_ms)
        return cls(clock() + ms / 1000.0, clock)

    def remaining(self) -> float:
        return self.at - self.clock()

    @property
    def expired(self) -> bool:
        return self.remaining() <= 0

    def check(self, stage: str) -> float:
        """Remaining seconds, or ``DeadlineExceeded`` if none are left."""
        left = self.remaining()
        if left <= 0:
            raise DeadlineExceeded(stage)
        return left

    def budget(self, stage: str, cap: float | None, share: float = 1.0) -> float:
        """Time for one hop: ``share`` of what remains, never more than ``cap``."""
        if not 0 < share <= 1:
            raise ValueError("share must be in (0, 1]")
        left = self.check(stage) * share
        return left if cap is None else min(cap, left)


def hop_budget(deadline: Deadline | None, stage: str, cap: float, share: float = 1.0) -> float:
    """The timeout of one hop: its own cap, shortened by the deadline when there is one."""
    if deadline is None:
        return cap
    return deadline.budget(stage, cap, share)
