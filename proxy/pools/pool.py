"""A pool of workers of one role: membership by source, routing policy, per-worker limits."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Final
from urllib.parse import urlsplit, urlunsplit

from proxy.pools.admission import WaitQueue
from proxy.pools.breaker import BreakerConfig, CircuitBreaker
from proxy.pools.errors import NoWorkerAvailable
from proxy.pools.policies import LeastLoaded, PickContext, Policy
from proxy.pools.worker import Outcome, Worker
from proxy.upstream.hop import parse_origin

STATIC_SOURCE = "static"
_NOTHING: Final[frozenset[int]] = frozenset()


@dataclass(frozen=True, slots=True)
class LoadWeights:
    """How scraped worker metrics add to the load a policy sees (``use_scraped`` off: ignored)."""

    use_scraped: bool = False
    waiting: float = 1.0
    kv_usage: float = 4.0
    max_age: float = 10.0


def redact_url(url: str) -> str:
    """``url`` as it may be logged or echoed: user info, query and fragment become ``***``."""
    try:
        parts = urlsplit(url.strip())
    except ValueError:
        return "<a URL that does not parse>"
    netloc = parts.netloc
    if "@" in netloc:
        netloc = "***@" + netloc.rpartition("@")[2]
    return urlunsplit((parts.scheme, netloc, parts.path, "***" if "?" in url else "",
                       "***" if "#" in url else ""))


def normalize_url(url: str) -> str:
    """A worker's base URL, ``http(s)://host[:port][/path]`` without a trailing ``/``, else
    ``ValueError`` whose message never carries user info, a query or a fragment (the URL is logged
    and shown); characters that parsers disagree on are refused."""
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"worker URL must start with http:// or https://, got {redact_url(url)!r}")
    try:
        netloc = urlsplit(url).netloc
    except ValueError:
        raise ValueError(f"worker URL does not parse: {redact_url(url)!r}") from None
    if "@" in netloc:
        raise ValueError("worker URL must not carry user info (user:password@), got "
                         f"{redact_url(url)!r}: give the workers' key with --upstream-api-key")
    if "?" in url or "#" in url:
        raise ValueError(f"worker URL must not carry a query or a fragment, got {redact_url(url)!r}")
    if "\\" in url or not url.isascii() or not url.isprintable() or " " in url:
        raise ValueError("worker URL must be printable ASCII without spaces or backslashes, got "
                         f"{redact_url(url)!r}")
    parse_origin(url)  # a host, a valid port: refused here rather than on the first hop
    return url


class Pool:
    def __init__(self, name: str, urls: Iterable[str] = (), *, policy: Policy | None = None,
                 breaker: BreakerConfig | None = None, clock: Callable[[], float] = time.monotonic,
                 max_inflight_per_worker: int | None = None, max_waiters: int = 64,
                 retry_after: float = 1.0, weights: LoadWeights | None = None,
                 panic: bool = False) -> None:
        self.name = name
        self.panic = panic
        """When every non-draining worker failed its health probes, route as if they had not: a
        probe that times out on a loaded worker must not make the pool refuse everything."""
        self.policy: Policy = policy or LeastLoaded()
        self.breaker_config = breaker or BreakerConfig()
        self.clock = clock
        self.max_inflight_per_worker = max_inflight_per_worker
        self.retry_after = retry_after
        self.weights = weights or LoadWeights()
        self.queue = WaitQueue(max_waiters, retry_after=retry_after, what=f"{name} pool")
        self._workers: dict[str, Worker] = {}
        self._departed: dict[str, Worker] = {}
        """Workers that left while requests ran on them, until those requests end: one that comes
        back meanwhile is the same object."""
        self._recovery: asyncio.Future[None] | None = None
        self.on_change: list[Callable[[Pool], None]] = []
        self.on_leave: list[Callable[[Pool, Worker], None]] = []
        for url in urls:
            self.add(url, STATIC_SOURCE)

    @property
    def workers(self) -> list[Worker]:
        return list(self._workers.values())

    def __iter__(self) -> Iterator[Worker]:
        return iter(list(self._workers.values()))

    def __len__(self) -> int:
        return len(self._workers)

    def has(self, url: str) -> bool:
        return url in self._workers

    def get(self, url: str) -> Worker | None:
        return self._workers.get(normalize_url(url))

    def add(self, url: str, source: str) -> Worker:
        url = normalize_url(url)
        worker = self._workers.get(url)
        if worker is None:
            worker = self._departed.pop(url, None)
            if worker is None:
                breaker = CircuitBreaker(self.breaker_config, self.clock, f"{self.name} worker {url}")
                worker = Worker(url, self.name, breaker, max_inflight=self.max_inflight_per_worker)
            self._workers[url] = worker
            worker.sources.add(source)
            self._changed()
            self.queue.wake()
        else:
            worker.sources.add(source)
        return worker

    def discard(self, url: str, source: str) -> bool:
        """``source`` no longer declares ``url``; True if the worker left (no source does)."""
        url = normalize_url(url)
        worker = self._workers.get(url)
        if worker is None:
            return False
        worker.sources.discard(source)
        if worker.sources:
            return False
        del self._workers[url]
        self._left(worker)
        return True

    def remove(self, url: str) -> bool:
        """Remove ``url`` whatever declared it (an admin's DELETE)."""
        worker = self._workers.pop(normalize_url(url), None)
        if worker is None:
            return False
        worker.sources.clear()
        self._left(worker)
        return True

    def replace_source(self, source: str, urls: Iterable[str]) -> None:
        """Make ``source`` declare exactly ``urls`` (a reloaded file, an EndpointSlice update)."""
        wanted = {normalize_url(u) for u in urls}
        for worker in self.workers:
            if source in worker.sources and worker.url not in wanted:
                self.discard(worker.url, source)
        for url in sorted(wanted):
            self.add(url, source)

    def _changed(self) -> None:
        for callback in list(self.on_change):
            callback(self)

    def _left(self, worker: Worker) -> None:
        if worker.inflight > 0:
            self._departed[worker.url] = worker
        for callback in list(self.on_leave):
            callback(self, worker)
        self._changed()

    def load(self, worker: Worker) -> float:
        value = float(worker.inflight)
        w = self.weights
        scraped = worker.load
        if w.use_scraped and scraped is not None and self.clock() - scraped.at <= w.max_age:
            value += w.waiting * scraped.waiting + w.kv_usage * scraped.kv_usage
        return value

    @property
    def in_panic(self) -> bool:
        return self.panic and not any(w.healthy for w in self._workers.values() if not w.draining)

    def candidates(self, exclude: Iterable[Worker] = ()) -> list[Worker]:
        skip = {id(w) for w in exclude} if exclude else _NOTHING
        if self.in_panic:
            return [w for w in self._workers.values()
                    if w.admissible_in_panic and not w.saturated and id(w) not in skip]
        return [w for w in self._workers.values() if w.available and id(w) not in skip]

    def admissible(self, exclude: Iterable[Worker] = ()) -> list[Worker]:
        """Workers that could take a request if they had room."""
        skip = {id(w) for w in exclude} if exclude else _NOTHING
        if self.in_panic:
            return [w for w in self._workers.values() if w.admissible_in_panic and id(w) not in skip]
        return [w for w in self._workers.values() if w.admissible and id(w) not in skip]

    def retry_in(self) -> float:
        """A hint for ``Retry-After`` when nothing is available: the soonest circuit trial."""
        waits = [w.breaker.retry_in() for w in self._workers.values() if w.healthy and not w.draining]
        positive = [x for x in waits if x > 0]
        return min(positive) if positive else self.retry_after

    def pick(self, ctx: PickContext | None = None, exclude: Iterable[Worker] = ()) -> Worker:
        """Choose a worker now (no waiting, no accounting); ``NoWorkerAvailable`` if none can."""
        candidates = self.candidates(exclude)
        if not candidates:
            raise NoWorkerAvailable(self.name, retry_after=self.retry_in())
        return self.policy.choose(candidates, ctx or PickContext(), self.load)

    def recovery_in(self, exclude: Iterable[Worker] = ()) -> float | None:
        """Seconds until a worker held back only by its circuit may take a request; None: none."""
        skip = {id(w) for w in exclude}
        panic = self.in_panic
        waits = [w.breaker.available_in() for w in self._workers.values()
                 if (w.healthy or panic) and not w.draining and id(w) not in skip]
        return min(waits) if waits else None

    async def acquire(self, ctx: PickContext | None = None, exclude: Iterable[Worker] = (),
                      limit: float | None = None, *, wait_recovering: bool = False) -> Worker:
        """Choose a worker and count the request on it, waiting in the bounded queue while every
        admissible worker is at its cap. None admissible: ``NoWorkerAvailable``, at once unless
        ``wait_recovering`` waits up to ``limit`` for a circuit about to let a request in."""
        ctx = ctx or PickContext()
        excluded = list(exclude)
        candidates = self.candidates(excluded)
        if candidates:  # the usual case: no wait, so no clock
            return self._take(candidates, ctx)
        loop = asyncio.get_running_loop()
        end = None if limit is None else loop.time() + limit
        while True:
            if self.admissible(excluded):
                # also woken when none it may take is left: it then fails at once
                def can_use() -> bool:
                    return bool(self.candidates(excluded)) or not self.admissible(excluded)
                await self.queue.wait(None if end is None else end - loop.time(), can_use)
            else:
                soon = self.recovery_in(excluded) if wait_recovering and end is not None else None
                left = 0.0 if end is None else end - loop.time()
                if soon is None or left <= 0:
                    raise NoWorkerAvailable(self.name, retry_after=self.retry_in())
                await self._wait_recovery(min(left, max(soon, 1e-3)))
            candidates = self.candidates(excluded)
            if candidates:
                return self._take(candidates, ctx)

    def _take(self, candidates: list[Worker], ctx: PickContext) -> Worker:
        worker = self.policy.choose(candidates, ctx, self.load)
        worker.begin(ctx.tokens)
        return worker

    async def _wait_recovery(self, limit: float) -> None:
        """Until the next release or ``limit``."""
        if self._recovery is None:
            self._recovery = asyncio.get_running_loop().create_future()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(limit):
                await asyncio.shield(self._recovery)

    def release(self, worker: Worker, outcome: Outcome, tokens: int = 0) -> None:
        worker.end(tokens, outcome)
        if worker.inflight == 0 and self._departed.get(worker.url) is worker:
            del self._departed[worker.url]  # its last request ended: nothing of it is kept
        self.queue.wake()
        if self._recovery is not None:
            if not self._recovery.done():
                self._recovery.set_result(None)
            self._recovery = None
