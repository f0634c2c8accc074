"""The local-prefill alarm (proxy/README.md, "Metrics and logs"): from each decode worker's
``/metrics``, local compute beyond what the proxy's decode hops should cause (an ignored hand-off)
and failed KV pulls. With ``--workers N`` one process, the holder of a lock in the metrics
directory, scrapes and reads every process's expectation from the files."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import glob
import logging
import math
import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families

from proxy.fleet.health import FetchFn, repeat
from proxy.observe.metrics import MULTIPROC_DIR_ENV, ProxyMetrics
from proxy.pools.worker import Worker

log = logging.getLogger("pd_proxy")

PROMPT_BY_SOURCE = "vllm:prompt_tokens_by_source_total"
SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
FAILED_TRANSFERS = "vllm:nixl_num_failed_transfers_total"
FAILED = "failed_pulls"
HANDOFF_TAIL = 1
"""Local compute a healthy hand-off may show: vLLM recomputes a pulled prompt's last token."""
WARN_EVERY = 60.0
EXPECTED_METRIC = "pd_proxy_decode_expected_local_tokens"
LOCK_NAME = "decode-local-prefill.lock"


def expected_local(body: Mapping[str, Any]) -> int:
    """Prompt tokens a decode worker should compute itself for this decode hop's body."""
    ids = body.get("token_ids")
    n = len(ids) if ids is not None else 0
    return min(n, HANDOFF_TAIL) if "kv_transfer_params" in body else n


def parse_decode_counters(text: str) -> dict[str, float] | None:
    """The page's counters summed over engines, None when it has neither; ``ValueError`` when it
    is not the exposition format."""
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not math.isfinite(sample.value):
                continue
            if sample.name == PROMPT_BY_SOURCE:
                source = sample.labels.get("source")
                if source in SOURCES:
                    found[source] = found.get(source, 0.0) + sample.value
            elif sample.name == FAILED_TRANSFERS:
                found[FAILED] = found.get(FAILED, 0.0) + sample.value
    return found or None


@dataclass(slots=True)
class _Seen:
    """One decode worker at its last scrape; ``credit`` (<= 0) is the expectation the last
    scrape's local compute left unused."""

    sources: dict[str, float]
    failed: float | None
    expected: float
    credit: float = 0.0
    warned: float = field(default=-math.inf)
    warned_failed: float = field(default=-math.inf)


class LocalPrefillAlarm:
    def __init__(self, metrics: ProxyMetrics, decode: Iterable[Worker],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.metrics = metrics
        self.decode = decode
        self.clock = clock
        self._expected: dict[str, float] = {}
        self._seen: dict[str, _Seen] = {}
        self.expected_totals: Callable[[], Mapping[str, float]] = lambda: self._expected

    def scraped(self, worker: str) -> bool:
        """``worker`` has its baseline: failures from now on are counted."""
        return worker in self._seen

    def sent(self, worker: str, body: Mapping[str, Any]) -> None:
        n = expected_local(body)
        if n:
            self._expected[worker] = self._expected.get(worker, 0.0) + n
            m = self.metrics
            m.child(m.decode_expected_local, "decode", worker).inc(n)

    def observe(self, worker: str, counters: Mapping[str, float], expected: float,
                before: float | None = None) -> float:
        """Count one scrape of ``worker``; returns the local prefill tokens counted. ``before``, the
        expectation read before the fetch, is the baseline's: a hop counted during the fetch may be
        computed after the page."""
        now = {s: float(counters.get(s, 0.0)) for s in SOURCES}
        failed = counters.get(FAILED)
        seen = self._seen.get(worker)
        if seen is None:
            self._seen[worker] = _Seen(now, failed, expected if before is None else before)
            return 0.0
        restarted = any(now[s] < seen.sources[s] for s in SOURCES) or (
            failed is not None and seen.failed is not None and failed < seen.failed)
        deltas = now if restarted else {s: now[s] - seen.sources[s] for s in SOURCES}
        failed_delta = 0.0
        if failed is not None:
            failed_delta = failed if restarted or seen.failed is None else failed - seen.failed
            seen.failed = failed
        expected_delta = expected - seen.expected if expected >= seen.expected else expected
        seen.sources, seen.expected = now, expected
        m = self.metrics
        for s in SOURCES:
            if deltas[s] > 0:
                m.child(m.decode_prompt_tokens, "decode", worker, s).inc(deltas[s])
        t = self.clock()
        if failed_delta > 0:
            m.child(m.decode_failed_pulls, "decode", worker).inc(failed_delta)
            if t - seen.warned_failed >= WARN_EVERY:
                seen.warned_failed = t
                log.warning("decode worker %s failed %d KV pulls (NIXL transfer, handshake or "
                            "notification failures)", worker, round(failed_delta))
        diff = deltas["local_compute"] - expected_delta
        excess = diff + seen.credit
        seen.credit = min(diff, 0.0)
        if excess <= 0:
            return 0.0
        m.child(m.decode_local_prefill, "decode", worker).inc(excess)
        if t - seen.warned >= WARN_EVERY:
            seen.warned = t
            log.warning("decode worker %s computed %d prompt tokens whose KV it should have pulled "
                        "(it ignored the hand-off: no KV connector?)", worker, round(excess))
        return excess

    async def scrape_once(self, fetch: FetchFn) -> None:
        workers = list(self.decode)
        urls = {w.url for w in workers}
        for gone in (self._seen, self._expected):
            for url in [u for u in gone if u not in urls]:
                del gone[url]

        async def one(w: Worker) -> tuple[Worker, dict[str, float] | None]:
            try:
                return w, parse_decode_counters(await fetch(w))
            except (aiohttp.ClientError, TimeoutError, OSError, ValueError):
                return w, None  # unreachable for now: the next scrape covers both intervals

        # Read after the pages came, the expectation of a hop is never later than the compute
        # it explains (the hop is counted before D computes it).
        before = dict(self.expected_totals())
        results = await asyncio.gather(*(one(w) for w in workers))
        totals = self.expected_totals()
        for w, counters in results:
            if counters is not None:
                self.observe(w.url, counters, totals.get(w.url, 0.0), before.get(w.url, 0.0))

    def use_files(self, path: str) -> None:
        self.expected_totals = lambda: expected_from_files(path)

    async def run(self, fetch: FetchFn, interval: float) -> None:
        """Scrape every ``interval`` seconds (0: never); with a multiprocess metrics directory,
        only the process holding its lock scrapes."""
        if interval <= 0:
            return
        path = os.environ.get(MULTIPROC_DIR_ENV)
        lock: int | None = None
        if path:
            lock = os.open(os.path.join(path, LOCK_NAME), os.O_WRONLY | os.O_CREAT, 0o600)
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(lock)
                return  # another process of the run scrapes
            self.use_files(path)
        try:
            await repeat(interval, lambda: self.scrape_once(fetch))
        finally:
            if lock is not None:
                with contextlib.suppress(OSError):
                    os.close(lock)


def expected_from_files(path: str) -> dict[str, float]:
    """The decode workers' cumulative expectation summed over every process's counter files."""
    files = glob.glob(os.path.join(path, "counter_*.db"))
    totals: dict[str, float] = {}
    for metric in MultiProcessCollector.merge(files, accumulate=True):  # type: ignore[no-untyped-call]
        if metric.name != EXPECTED_METRIC:
            continue
        for s in metric.samples:
            worker = s.labels.get("worker")
            if s.name == EXPECTED_METRIC + "_total" and worker is not None:
                totals[worker] = totals.get(worker, 0.0) + s.value
    return totals
