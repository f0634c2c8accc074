"""What every part of the request walk shares (``Core``: the app's serving state) and the
request's transitions several parts make, each a ``Flight`` method with what ``Core`` counts."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from kv_transfer.handoff import (
    RemoteHostRewrite,
)
from kv_transfer.leases import RequestLeases
from kv_transfer.ledger import CloseReason
from proxy.config.settings import ProxySettings
from proxy.fleet import BYPASS_HEADER, PoolRuntime
from proxy.observe.local_prefill import LocalPrefillAlarm
from proxy.observe.metrics import ProxyMetrics
from proxy.observe.state import RequestTable, TaskTracker
from proxy.observe.tracing import DISABLED as TRACING_DISABLED
from proxy.observe.tracing import NOOP_HOP, Hop, Tracing
from proxy.pools import Worker
from proxy.sse.relay import ByteBudget
from proxy.upstream.client import Upstream
from proxy.walk.flight import Flight
from proxy.wire.errors import (
    UpstreamError,
    UpstreamStatusError,
    UpstreamTimeout,
    UpstreamUnavailable,
)

log = logging.getLogger("pd_proxy")


def error_class(e: UpstreamError) -> str:
    """The ``error`` label of ``pd_proxy_upstream_errors_total``."""
    if isinstance(e, UpstreamTimeout):
        return "timeout"
    if isinstance(e, UpstreamUnavailable):
        return "connect"
    if isinstance(e, UpstreamStatusError):
        return "http_4xx" if e.passthrough else "http_5xx"
    return "protocol"


class Core:
    def __init__(self, settings: ProxySettings, metrics: ProxyMetrics,
                 clock: Callable[[], float] = time.monotonic, *,
                 tracing: Tracing = TRACING_DISABLED) -> None:
        self.tracing = tracing
        self.settings = settings
        self.metrics = metrics
        self.clock = clock
        self.leases = RequestLeases(lease_duration=settings.lease_duration,
                                    keep_closed=settings.ledger_recent, clock=clock, observer=metrics)
        self.pools = PoolRuntime(settings.pools, settings.prefill_urls, settings.decode_urls,
                                 block_size=settings.kv_block_size, max_model_len=settings.max_model_len,
                                 registry=metrics.registry, clock=clock)
        self.prefill_pool = self.pools.prefill
        self.decode_pool = self.pools.decode
        self.pools.pools.forget_workers_in(metrics)  # a removed worker's series go with it
        self.table: RequestTable[Flight] = RequestTable()
        self.stream_budget = ByteBudget(settings.slow_reader_total_bytes)
        metrics.watch_stream_budget(self.stream_budget)
        self.tracker = TaskTracker()
        self.draining = False
        """Set at shutdown: requests ended from then on count as ``source="shutdown"``."""
        self._upstream: Upstream | None = None
        self.rewrite_remote_host = RemoteHostRewrite(enabled=settings.rewrite_remote_host)
        self.local_prefill = LocalPrefillAlarm(metrics, self.decode_pool, clock)

    def attach(self, upstream: Upstream) -> None:
        self._upstream = upstream
        if self.settings.local_prefill_interval > 0:
            upstream.on_decode = self.local_prefill.sent

    @property
    def upstream(self) -> Upstream:
        if self._upstream is None:
            raise RuntimeError("the app has not started (no upstream session)")
        return self._upstream

    async def call(self, worker: Worker, coro: Any, hop: Hop = NOOP_HOP) -> Any:
        """Count one call to ``worker``; ``hop`` is its span, current while the call runs."""
        series = self.metrics.calls(worker.pool, worker.url)
        series.inflight.inc()
        series.requests.inc()
        try:
            with hop:
                return await coro
        except UpstreamError as e:
            self.metrics.child(self.metrics.upstream_errors, worker.pool, worker.url, error_class(e)).inc()
            raise
        finally:
            series.inflight.dec()

    def queue_limit(self, f: Flight) -> float:
        """How long a pick may wait for a worker: the queue timeout, or less before the deadline."""
        limit = self.pools.settings.queue_timeout
        return limit if f.deadline is None else min(limit, max(0.0, f.deadline.remaining()))

    def lease_valid(self, f: Flight) -> bool:
        return f.lease_valid(self.leases)

    def decoding(self, f: Flight) -> None:
        """A decode hop with the request's KV goes out: its lease ends with what the hop tells."""
        f.decoding(self.leases, self.settings.longest_decode_hop())

    def close_lease(self, f: Flight, reason: CloseReason) -> None:
        f.close_lease(self.leases, reason)

    def decode_only(self, f: Flight, reason: str) -> None:
        """From here on the request runs on a decode worker alone (counted once, named in
        ``X-PD-Decode-Only``); an open KV lease ends as ``unknown``, never ``pulled``."""
        if BYPASS_HEADER not in f.headers:
            self.metrics.child(self.metrics.decode_only, reason).inc()
            f.headers[BYPASS_HEADER] = reason
        f.drop_kv(self.leases)

    def set_done(self, f: Flight) -> None:
        f.done()

    def note_abort(self, f: Flight, source: str) -> bool:
        """The request is aborted, counted by source and phase; False when it was already."""
        if not f.abort(source):
            return False
        self.metrics.child(self.metrics.aborts, source, f.record.phase.value).inc()
        return True

    def note_gone(self, f: Flight) -> None:
        """The client went away (or the shutdown ended its request): its abort, counted once."""
        if self.note_abort(f, "shutdown" if self.draining else "disconnect"):
            self.metrics.outcomes["aborted"].inc()

    def expire_leases(self) -> int:
        return self.leases.expire()

    def note_usage(self, f: Flight, usage: object) -> None:
        """Keep D's completion tokens; count a long prompt whose decode shows no KV transfer."""
        if not isinstance(usage, dict):
            return
        completion = usage.get("completion_tokens")
        if isinstance(completion, int):
            f.completion_tokens = completion
        prompt = usage.get("prompt_tokens")
        if not isinstance(prompt, int) or f.kv_blocks is None or "X-PD-Decode-Only" in f.headers \
                or f.record.is_aborted:
            return
        if prompt < self.pools.blocks.pair(f.record.prefill_worker, f.record.decode_worker):
            return  # shorter than one KV block of the pair that served it
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        if f.kv_blocks == 0 or cached == 0:
            self.metrics.suspect_no_transfer.inc()


class Part:
    """One part of the walk, over the shared ``Core`` (its state under short names)."""

    def __init__(self, core: Core) -> None:
        self.core = core
        self.settings = core.settings
        self.metrics = core.metrics
        self.clock = core.clock
        self.pools = core.pools
        self.prefill_pool = core.prefill_pool
        self.decode_pool = core.decode_pool
        self.leases = core.leases
        self.table = core.table
        self.tracker = core.tracker

    @property
    def upstream(self) -> Upstream:
        upstream = self.core._upstream  # read directly: one property call per hop, not two
        return upstream if upstream is not None else self.core.upstream

    @property
    def draining(self) -> bool:
        return self.core.draining

    async def send_abort(self, worker: Worker, engine_id: str) -> bool:
        ok = await self.upstream.abort(worker.url, [engine_id], limit=self.settings.control_timeout)
        self.metrics.child(self.metrics.abort_fanout, worker.pool, "ok" if ok else "error").inc()
        return ok

    async def abort_until(self, worker: Worker | None, engine_id: str, task: asyncio.Future[Any],
                          limit: float) -> None:
        """Send abort to ``worker`` and repeat it, at doubling intervals from ``abort_repeat_first`` up to
        ``abort_grace``, until ``task`` is done: vLLM loses an abort that comes before the request."""
        deadline = self.clock() + limit
        interval = min(self.settings.abort_repeat_first, self.settings.abort_grace)
        while not task.done():
            if worker is not None:
                await self.send_abort(worker, engine_id)
            remaining = deadline - self.clock()
            if remaining <= 0:
                break
            await asyncio.wait({task}, timeout=min(interval, remaining))
            interval = min(2 * interval, self.settings.abort_grace)

