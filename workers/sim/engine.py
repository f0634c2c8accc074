"""The simulated engine's state: KV blocks with a prefix cache, KV leases on the prefill side,
the running/waiting scheduler and the registry of in-flight requests (for aborts)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from kv_transfer.kv_events import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

from .metrics import SimMetrics
from .model import fold_all

_TIMER_GRAIN_S = 0.001
"""Loop timers' resolution (uvloop/libuv and epoll count whole milliseconds)."""

ReleaseReason = Literal["pulled", "aborted", "expired"]
RELEASE_REASONS: tuple[ReleaseReason, ...] = ("pulled", "aborted", "expired")


class KvPool:
    """Block allocator with vLLM-style prefix caching.

    Block 0 is reserved (vLLM's null block). Full blocks are keyed by a chained hash of their
    tokens; a freed block keeps its hash (so a later prompt can hit it) until it is reused, the
    least recently freed first, a request's last block before its first (as vLLM frees them).

    With ``on_events``, every change of the set of cached hashes is reported as vLLM 0.32's KV
    events, one batch per call that changed it: ``BlockStored`` for each run of consecutive blocks
    of a prompt that entered the cache, ``BlockRemoved`` for each hash that left it (its block
    reused), ``AllBlocksCleared`` on :meth:`reset`. Replaying the events gives exactly
    :meth:`cached_hashes`. Hashes go out as 8 big-endian bytes.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        on_change: Callable[[float], None],
        on_events: Callable[[list[KVEvent]], None] | None = None,
    ) -> None:
        self.block_size = block_size
        self.capacity = num_blocks - 1
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, num_blocks))
        self._ref: dict[int, int] = {}
        self._by_hash: dict[int, int] = {}
        self._hash_of: dict[int, int] = {}
        self._on_change = on_change
        self.on_events = on_events
        self._events: list[KVEvent] = []

    @property
    def used(self) -> int:
        return len(self._ref)

    @property
    def usage(self) -> float:
        return len(self._ref) / self.capacity

    def _notify(self) -> None:
        self._on_change(self.usage)
        if self._events and self.on_events is not None:
            events, self._events = self._events, []
            self.on_events(events)
        self._events.clear()

    def cached_hashes(self) -> set[bytes]:
        """The hashes a prompt can hit now, as the KV events name them."""
        return {event_hash(h) for h in self._by_hash}

    def reset(self) -> bool:
        """vLLM's ``reset_prefix_cache``: forget every hash, unless a block is in use (then False)."""
        if self._ref:
            return False
        self._by_hash.clear()
        self._hash_of.clear()
        self._events.append(AllBlocksCleared())
        self._notify()
        return True

    def block_hashes(self, tokens: Sequence[int], salt: str | None) -> list[int]:
        bs = self.block_size
        hashes: list[int] = []
        h = fold_all(salt.encode()) if salt else 0
        for start in range(0, len(tokens) - bs + 1, bs):
            h = fold_all(tokens[start : start + bs], h ^ 0x5BD1E995)
            hashes.append(h)
        return hashes

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate_prompt(self, tokens: Sequence[int], salt: str | None) -> tuple[list[int], int] | None:
        """Blocks for a prompt: (block ids, cached tokens), or None when the pool is too full."""
        bs = self.block_size
        hashes = self.block_hashes(tokens, salt)
        hits: list[int] = []
        # vLLM always recomputes the last prompt token, so a fully cached prompt gives back one block.
        max_hit_blocks = (len(tokens) - 1) // bs
        for h in hashes[:max_hit_blocks]:
            b = self._by_hash.get(h)
            if b is None:
                break
            hits.append(b)
        total = self.blocks_needed(len(tokens))
        fresh_needed = total - len(hits)
        reusable_hits_in_free = sum(1 for b in hits if b in self._free)
        if fresh_needed > len(self._free) - reusable_hits_in_free:
            return None
        for b in hits:
            self._free.pop(b, None)
            self._ref[b] = self._ref.get(b, 0) + 1
        blocks = list(hits)
        stored: list[int] = []  # indexes of the blocks whose hash entered the cache
        for i in range(len(hits), total):
            b = self._take_fresh()
            if i < len(hashes):
                old = self._by_hash.get(hashes[i])
                if old is None:
                    self._by_hash[hashes[i]] = b
                    self._hash_of[b] = hashes[i]
                    stored.append(i)
            blocks.append(b)
        self._stored_events(tokens, hashes, stored, salt)
        self._notify()
        return blocks, len(hits) * bs

    def _stored_events(self, tokens: Sequence[int], hashes: list[int], stored: list[int],
                       salt: str | None) -> None:
        if self.on_events is None:
            return
        bs = self.block_size
        runs: list[list[int]] = []
        for i in stored:
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        for run in runs:
            first, last = run[0], run[-1]
            self._events.append(
                BlockStored(
                    block_hashes=[event_hash(hashes[i]) for i in run],
                    parent_block_hash=event_hash(hashes[first - 1]) if first > 0 else None,
                    token_ids=list(tokens[first * bs : (last + 1) * bs]),
                    block_size=bs,
                    lora_id=None,
                    medium=MEDIUM_GPU,
                    lora_name=None,
                    # vLLM publishes the cache salt as the first block's extra key.
                    extra_keys=[(salt,) if salt and i == 0 else None for i in run] if salt else None,
                    group_idx=0,
                )
            )

    def _take_fresh(self) -> int:
        b, _ = self._free.popitem(last=False)
        old = self._hash_of.pop(b, None)
        if old is not None and self._by_hash.get(old) == b:
            del self._by_hash[old]
            if self.on_events is not None:
                self._events.append(BlockRemoved(block_hashes=[event_hash(old)], medium=MEDIUM_GPU,
                                                 group_idx=0))
        self._ref[b] = 1
        return b

    def allocate_one(self) -> int | None:
        if not self._free:
            return None
        b = self._take_fresh()
        self._notify()
        return b

    def free(self, blocks: Sequence[int]) -> None:
        for b in reversed(blocks):
            n = self._ref.get(b, 0) - 1
            if n > 0:
                self._ref[b] = n
            elif n == 0:
                del self._ref[b]
                self._free[b] = None
        self._notify()


def event_hash(h: int) -> bytes:
    """A pool hash as the KV events carry it."""
    return h.to_bytes(8, "big")


@dataclass
class Lease:
    """KV blocks a prefill worker holds for a decode worker to pull."""

    remote_request_id: str
    request_id: str
    blocks: list[int]
    num_tokens: int
    created: float
    expires: float
    timer: asyncio.TimerHandle | None = None
    pulling: bool = False


class LeaseTable:
    def __init__(self, pool: KvPool, metrics: SimMetrics) -> None:
        self.pool = pool
        self.metrics = metrics
        self.leases: dict[str, Lease] = {}
        self.releases: dict[ReleaseReason, int] = dict.fromkeys(RELEASE_REASONS, 0)
        self.on_release: Callable[[], None] | None = None

    def hold(
        self,
        remote_request_id: str,
        request_id: str,
        blocks: list[int],
        num_tokens: int,
        lease_seconds: float,
    ) -> Lease:
        now = time.monotonic()
        lease = Lease(remote_request_id, request_id, blocks, num_tokens, now, now + lease_seconds)
        loop = asyncio.get_running_loop()
        lease.timer = loop.call_later(lease_seconds, self.release, remote_request_id, "expired")
        self.leases[remote_request_id] = lease
        return lease

    def extend(self, remote_request_id: str, lease_seconds: float) -> bool:
        lease = self.leases.get(remote_request_id)
        if lease is None:
            return False
        if lease.timer is not None:
            lease.timer.cancel()
        lease.expires = time.monotonic() + lease_seconds
        lease.timer = asyncio.get_running_loop().call_later(
            lease_seconds, self.release, remote_request_id, "expired"
        )
        return True

    def release(self, remote_request_id: str, reason: ReleaseReason) -> bool:
        lease = self.leases.pop(remote_request_id, None)
        if lease is None:
            return False
        if lease.timer is not None:
            lease.timer.cancel()
        self.pool.free(lease.blocks)
        self.releases[reason] += 1
        if reason == "expired":
            self.metrics.kv_expired.inc()
        if self.on_release is not None:
            self.on_release()  # freed blocks may admit a waiting request
        return True

    def close(self) -> None:
        for lease in self.leases.values():
            if lease.timer is not None:
                lease.timer.cancel()


class Inflight:
    """One request inside the engine; ``abort()`` wakes whatever it is waiting on."""

    __slots__ = (
        "_wake",
        "aborted",
        "blocks",
        "created",
        "external_id",
        "num_output",
        "num_prompt",
        "on_abort",
        "state",
    )

    def __init__(self, external_id: str, num_prompt: int) -> None:
        self.external_id = external_id
        self.num_prompt = num_prompt
        self.num_output = 0
        self.created = time.monotonic()
        self.state = "waiting"
        self.aborted = False
        self.blocks: list[int] = []
        self._wake: asyncio.Future[bool] | None = None
        self.on_abort: list[Callable[[], None]] = []

    def abort(self) -> None:
        if self.aborted:
            return
        self.aborted = True
        wake = self._wake
        if wake is not None and not wake.done():
            wake.set_result(False)
        for cb in self.on_abort:
            cb()

    async def sleep(self, seconds: float) -> bool:
        """Sleep unless aborted; False when aborted (before or during the sleep)."""
        if self.aborted:
            return False
        if seconds <= 0:
            return True
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[bool] = loop.create_future()
        self._wake = fut
        handle = loop.call_later(seconds, _resolve, fut)
        try:
            return await fut
        finally:
            handle.cancel()
            self._wake = None

    async def wait_future(self, fut: asyncio.Future[bool]) -> bool:
        """Wait for ``fut`` (resolved True by its owner) unless aborted."""
        if self.aborted:
            return False
        self._wake = fut
        try:
            return await fut
        finally:
            self._wake = None


class Clock:
    """The latency model's time source (tests inject their own).

    ``now()`` is the monotonic clock (asyncio's loop clock; uvloop's ``loop.time()`` reads the same
    clock but truncated to whole milliseconds, too coarse for a 10 ms cadence). ``sleep_until``
    waits for an absolute deadline on it and never returns before it: a timer that fires early
    (uvloop rounds delays to whole milliseconds and starts them from its cached loop time) sleeps
    the rest.
    """

    def now(self) -> float:
        return time.monotonic()

    async def wait(self, seconds: float) -> None:
        """A plain delay (the side channel's transfer time)."""
        await asyncio.sleep(seconds)

    async def sleep_until(self, req: Inflight, deadline: float) -> bool:
        """Sleep until ``deadline`` unless ``req`` is aborted; False when aborted."""
        while True:
            delay = deadline - self.now()
            if delay <= 0:
                return not req.aborted
            if not await req.sleep(delay):
                return False

    async def sleep_until_exact(self, req: Inflight, deadline: float) -> bool:
        """``sleep_until`` without the timer's lateness, for the first token's deadline.

        Loop timers have millisecond resolution (uvloop rounds delays, epoll waits whole
        milliseconds), so a plain sleep wakes on average ~0.5 ms late, which a 50 ms TTFT shows.
        A timer covers all but the last millisecond; the rest yields to the loop until due (at
        most ~1 ms of a busy loop once per request; token cadences keep the plain sleep).
        """
        if not await self.sleep_until(req, deadline - _TIMER_GRAIN_S):
            return False
        while self.now() < deadline:
            await asyncio.sleep(0)
            if req.aborted:
                return False
        return not req.aborted


class TokenCadence:
    """When each output token is due: token k at first-token time + the sum of the first k
    intervals (ITL, jitter, slowdown, chunk delay), an absolute schedule, so that the time a timer
    fires late or a step takes does not add up from token to token. A token that is already
    late is sent at once, and the schedule is kept (the next ones catch up)."""

    __slots__ = ("due",)

    def __init__(self) -> None:
        self.due: float | None = None

    def start(self, t_first: float) -> None:
        self.due = t_first

    def next(self, interval: float, now: Callable[[], float]) -> float:
        """The deadline of the next token, ``interval`` seconds after the previous deadline (or
        after ``now()`` when no schedule is running)."""
        due = (now() if self.due is None else self.due) + interval
        self.due = due
        return due


def _resolve(fut: asyncio.Future[bool]) -> None:
    if not fut.done():
        fut.set_result(True)


class Scheduler:
    """A limit on running requests (and on KV blocks) with a FIFO waiting queue."""

    def __init__(self, max_running: int, pool: KvPool, metrics: SimMetrics) -> None:
        self.max_running = max_running
        self.pool = pool
        self.metrics = metrics
        self.running = 0
        self._waiting: deque[tuple[asyncio.Future[bool], int]] = deque()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def _update(self) -> None:
        self.metrics.running.set(self.running)
        self.metrics.waiting.set(len(self._waiting))

    def would_wait(self, blocks_needed: int) -> bool:
        return (
            bool(self._waiting)
            or self.running >= self.max_running
            or not self.pool.can_allocate(blocks_needed)
        )

    async def acquire(self, req: Inflight, blocks_needed: int) -> bool:
        """Take a running slot; False if the request was aborted while waiting."""
        if not self._waiting and self.running < self.max_running and self.pool.can_allocate(blocks_needed):
            self.running += 1
            self._update()
            return True
        fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        entry = (fut, blocks_needed)
        self._waiting.append(entry)
        self._update()
        try:
            granted = await req.wait_future(fut)
        except asyncio.CancelledError:
            self._remove(entry)
            if fut.done() and not fut.cancelled() and fut.result():
                self.release()  # the slot was handed over just before the cancellation
            raise
        self._remove(entry)
        return granted

    def _remove(self, entry: tuple[asyncio.Future[bool], int]) -> None:
        with contextlib.suppress(ValueError):
            self._waiting.remove(entry)
        self._update()

    def release(self) -> None:
        self.running -= 1
        self.wake()

    def wake(self) -> None:
        while self._waiting and self.running < self.max_running:
            fut, blocks = self._waiting[0]
            if fut.done():
                self._waiting.popleft()
                continue
            if not self.pool.can_allocate(blocks) and self.running > 0:
                break
            self._waiting.popleft()
            self.running += 1
            fut.set_result(True)
        self._update()


@dataclass
class Registry:
    """In-flight requests by their engine request id (``generate-tokens-...``)."""

    by_id: dict[str, set[Inflight]] = field(default_factory=dict)

    def add(self, req: Inflight) -> None:
        self.by_id.setdefault(req.external_id, set()).add(req)

    def remove(self, req: Inflight) -> None:
        reqs = self.by_id.get(req.external_id)
        if reqs is not None:
            reqs.discard(req)
            if not reqs:
                del self.by_id[req.external_id]

    def abort(self, request_ids: Sequence[Any]) -> int:
        n = 0
        for rid in request_ids:
            if not isinstance(rid, str):
                continue
            for req in list(self.by_id.get(rid, ())):
                req.abort()
                n += 1
        return n

    def all(self) -> list[Inflight]:
        return [r for reqs in self.by_id.values() for r in reqs]
