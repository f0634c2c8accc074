"""Health: active ``/health`` probes with thresholds, scraped load, and the P x D pair preflight.

``fail_threshold`` failed probes in a row mark a worker unhealthy (never picked);
``recover_threshold`` good ones readmit it and close its circuit. Probes, scrapes and checks are
injected coroutines, so tests drive them directly."""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from proxy.pools.pool import Pool
from proxy.pools.worker import ScrapedLoad, Worker
from proxy.upstream.capped import METRICS_PAGE_LIMIT, PROBE_ANSWER_LIMIT, read_capped

log = logging.getLogger(__name__)

ProbeFn = Callable[[Worker], Awaitable[bool]]
FetchFn = Callable[[Worker], Awaitable[str]]
PreflightFn = Callable[[Worker, Worker], Awaitable[None]]


async def repeat(interval: float, step: Callable[[], Awaitable[object]]) -> None:
    """Run ``step`` every ``interval`` seconds until cancelled; a failing step is logged."""
    if interval <= 0:
        raise ValueError("interval must be positive")
    while True:
        try:
            await step()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("periodic pool task failed")
        await asyncio.sleep(interval)


def http_probe(session: aiohttp.ClientSession, timeout: float, path: str = "/health") -> ProbeFn:
    async def probe(worker: Worker) -> bool:
        try:
            async with session.get(worker.url + path,
                                   timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
                await read_capped(resp, PROBE_ANSWER_LIMIT)
                return resp.status == 200
        except (aiohttp.ClientError, TimeoutError, OSError):
            return False

    return probe


def http_fetch(session: aiohttp.ClientSession, timeout: float, path: str = "/metrics", *,
               headers: Mapping[str, str] | None = None, limit: int | None = None) -> FetchFn:
    """``GET path`` of a worker as text; an error status or a body past ``limit`` raises."""
    async def fetch(worker: Worker) -> str:
        async with session.get(worker.url + path, timeout=aiohttp.ClientTimeout(total=timeout),
                               headers=headers) as resp:
            resp.raise_for_status()
            page = await read_capped(resp, limit if limit is not None else METRICS_PAGE_LIMIT)
            return page.decode(resp.charset or "utf-8", "replace")

    return fetch


@dataclass(slots=True)
class _Streak:
    fails: int = 0
    oks: int = 0


class HealthChecker:
    def __init__(self, pools: Sequence[Pool], probe: ProbeFn, *, fail_threshold: int = 3,
                 recover_threshold: int = 2,
                 on_change: Callable[[Worker], None] | None = None) -> None:
        if fail_threshold < 1 or recover_threshold < 1:
            raise ValueError("health thresholds must be at least 1")
        self.pools = list(pools)
        self.probe = probe
        self.fail_threshold = fail_threshold
        self.recover_threshold = recover_threshold
        self.on_change = on_change
        self._streaks: dict[tuple[str, str], _Streak] = {}

    def record(self, worker: Worker, ok: bool) -> None:
        streak = self._streaks.setdefault((worker.pool, worker.url), _Streak())
        if ok:
            streak.oks += 1
            streak.fails = 0
            if not worker.healthy and streak.oks >= self.recover_threshold:
                worker.healthy = True
                worker.breaker.reset()
                self._changed(worker)
        else:
            streak.fails += 1
            streak.oks = 0
            if worker.healthy and streak.fails >= self.fail_threshold:
                worker.healthy = False
                self._changed(worker)

    def _changed(self, worker: Worker) -> None:
        log.warning("%s worker %s is now %s", worker.pool, worker.url,
                    "healthy" if worker.healthy else "unhealthy")
        if self.on_change is not None:
            self.on_change(worker)

    async def probe_once(self) -> None:
        workers = [w for pool in self.pools for w in pool]
        live = {(w.pool, w.url) for w in workers}
        for key in list(self._streaks):
            if key not in live:
                del self._streaks[key]
        results = await asyncio.gather(*(self.probe(w) for w in workers), return_exceptions=True)
        for worker, result in zip(workers, results, strict=True):
            self.record(worker, result is True)

    async def run(self, interval: float) -> None:
        await repeat(interval, self.probe_once)


WAITING = "vllm:num_requests_waiting"
RUNNING = "vllm:num_requests_running"
KV_USAGE = "vllm:kv_cache_usage_perc"


def parse_load(text: str, at: float) -> ScrapedLoad:
    """Sum waiting/running over a worker's engines; average its KV usage (0..1)."""
    sums = {WAITING: 0.0, RUNNING: 0.0, KV_USAGE: 0.0}
    kv_samples = 0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in sums:
                sums[sample.name] += float(sample.value)
                if sample.name == KV_USAGE:
                    kv_samples += 1
    kv = sums[KV_USAGE] / kv_samples if kv_samples else 0.0
    return ScrapedLoad(waiting=sums[WAITING], running=sums[RUNNING], kv_usage=kv, at=at)


class LoadScraper:
    def __init__(self, pools: Sequence[Pool], fetch: FetchFn,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.pools = list(pools)
        self.fetch = fetch
        self.clock = clock

    async def _one(self, worker: Worker) -> None:
        try:
            text = await self.fetch(worker)
            worker.load = parse_load(text, self.clock())
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError):
            pass  # the last scrape ages out (LoadWeights.max_age)

    async def scrape_once(self) -> None:
        await asyncio.gather(*(self._one(w) for pool in self.pools for w in pool))

    async def run(self, interval: float) -> None:
        await repeat(interval, self.scrape_once)


class PairState(enum.Enum):
    UNKNOWN = "unknown"
    RUNNING = "running"
    OK = "ok"
    FAILED = "failed"


class Preflight:
    """Each prefill x decode pair passes ``check`` once before it takes traffic; a failed pair is
    retried after ``retry_after`` seconds."""

    def __init__(self, check: PreflightFn | None, *, timeout: float = 10.0, retry_after: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.check = check
        self.timeout = timeout
        self.retry_after = retry_after
        self.clock = clock
        self._state: dict[tuple[str, str], tuple[PairState, float]] = {}
        self._tasks: dict[tuple[str, str], asyncio.Task[None]] = {}
        self.failures = 0

    def state(self, p: Worker, d: Worker) -> PairState:
        return self._state.get((p.url, d.url), (PairState.UNKNOWN, 0.0))[0]

    def usable(self, p: Worker, d: Worker) -> bool:
        return self.check is None or self.state(p, d) is PairState.OK

    def all_failed(self, p: Worker, decoders: Sequence[Worker]) -> bool:
        """Every pair of ``p`` with ``decoders`` failed its check: ``p``'s KV could go nowhere."""
        return self.check is not None and bool(decoders) and all(
            self.state(p, d) is PairState.FAILED for d in decoders)

    def start_all(self, prefill: Iterable[Worker], decode: Iterable[Worker]) -> None:
        """Start the checks of every pair not yet known, before traffic needs them."""
        decoders = list(decode)
        for p in prefill:
            for d in decoders:
                self.start(p, d)

    def start(self, p: Worker, d: Worker) -> asyncio.Task[None] | None:
        """Start the pair's check unless it passed, is running, or failed too recently."""
        if self.check is None:
            return None
        key = (p.url, d.url)
        state, since = self._state.get(key, (PairState.UNKNOWN, 0.0))
        if state is PairState.RUNNING:
            return self._tasks.get(key)
        if state is PairState.OK or (state is PairState.FAILED and self.clock() - since < self.retry_after):
            return None
        self._state[key] = (PairState.RUNNING, self.clock())
        task = asyncio.get_running_loop().create_task(self._run(key, p, d), name=f"preflight {key}")
        self._tasks[key] = task
        return task

    async def _run(self, key: tuple[str, str], p: Worker, d: Worker) -> None:
        assert self.check is not None
        try:
            async with asyncio.timeout(self.timeout):
                await self.check(p, d)
        except asyncio.CancelledError:
            self._state.pop(key, None)
            raise
        except Exception as exc:
            self.failures += 1
            log.warning("preflight %s -> %s failed: %s", p.url, d.url, type(exc).__name__)
            self._state[key] = (PairState.FAILED, self.clock())
        else:
            self._state[key] = (PairState.OK, self.clock())
        finally:
            self._tasks.pop(key, None)

    async def usable_decoders(self, p: Worker, candidates: Sequence[Worker],
                              limit: float) -> list[Worker]:
        """The candidates whose pair with ``p`` passed; when none has yet, waits at most ``limit``."""
        if self.check is None:
            return list(candidates)
        pending = [t for d in candidates if (t := self.start(p, d)) is not None]
        ok = [d for d in candidates if self.usable(p, d)]
        loop = asyncio.get_running_loop()
        end = loop.time() + limit
        while not ok and pending:
            left = end - loop.time()
            if left <= 0:
                break
            done, still = await asyncio.wait(pending, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            pending = list(still)
            ok = [d for d in candidates if self.usable(p, d)]
            if not done:
                break
        return ok

    def prune(self, prefill: Iterable[str], decode: Iterable[str]) -> None:
        keep_p, keep_d = set(prefill), set(decode)
        for key in list(self._state):
            if key[0] not in keep_p or key[1] not in keep_d:
                self._state.pop(key)
                task = self._tasks.pop(key, None)
                if task is not None:
                    task.cancel()

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
