"""The proxy's Prometheus metrics (described in proxy/README.md, "Metrics and logs"), on a registry
owned by one app: no module-level collectors, so several apps can live in one process. Series of a
worker that left its pool are removed and not made again (``forget_worker``, ``members``)."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from kv_transfer.ledger import Lease
from proxy import __version__ as _version

if TYPE_CHECKING:
    from proxy.sse.relay import ByteBudget

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15,
                    0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 30.0, 60.0,
                    # vLLM's request-latency buckets above a minute (vllm:e2e_request_latency_seconds)
                    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_ITL_BUCKETS = (0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04,
                0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0)
_LEASE_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST

Members = Callable[[str, str], bool]
"""``members(pool, worker_url)``: is that worker a member of that pool now."""


class _Uncounted:
    """Stands in for the child of a worker that left its pool: counts nothing."""

    def inc(self, amount: float = 1) -> None:
        pass

    def dec(self, amount: float = 1) -> None:
        pass

    def set(self, value: float) -> None:
        pass

    def observe(self, amount: float) -> None:
        pass


_UNCOUNTED = _Uncounted()


class WorkerCalls:
    """One worker's call series: its pool's in-flight gauge and its own call counter."""

    __slots__ = ("inflight", "requests")

    def __init__(self, inflight: Any, requests: Any) -> None:
        self.inflight = inflight
        self.requests = requests


STAGES = ("queue", "prefill", "handoff", "decode_first_token", "first_to_second", "decode_stream")
"""The stages of ``pd_proxy_stage_seconds``."""
OUTCOMES = ("ok", "client_error", "upstream_error", "aborted", "timeout", "rejected", "internal_error")
"""The outcomes of ``pd_proxy_requests_total`` (``internal_error``: a bug of the proxy's)."""


def latency_buckets(longest: float = 0.0) -> tuple[float, ...]:
    """Latency buckets that double until one covers ``longest``: no request the proxy lets run
    lands in ``+Inf`` alone."""
    buckets = list(_LATENCY_BUCKETS)
    while buckets[-1] < longest:
        buckets.append(buckets[-1] * 2)
    return tuple(buckets)


def lease_buckets(lease_duration: float = 0.0) -> tuple[float, ...]:
    """KV-lease buckets that double until one covers twice ``lease_duration``, the longest a lease
    may stay open."""
    buckets = list(_LEASE_BUCKETS)
    while buckets[-1] < 2 * lease_duration:
        buckets.append(buckets[-1] * 2)
    return tuple(buckets)


class ProxyMetrics:
    def __init__(self, *, longest: float = 0.0, lease_duration: float = 0.0) -> None:
        """The histograms' buckets cover ``longest`` (seconds) and the KV ``lease_duration``."""
        r = self.registry = CollectorRegistry(auto_describe=True)
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        self._calls: dict[tuple[str, str], WorkerCalls] = {}
        # Registered in this order, which is /metrics' order.
        self._client_metrics(r, latency_buckets(longest))
        self._upstream_metrics(r)
        self._abort_metrics(r)
        self._kv_metrics(r, lease_buckets(lease_duration))
        self._slow_reader_and_build_metrics(r)
        self.members: Members | None = None
        """Set by the app to its pools' membership: no series is made for a worker outside them."""
        self._per_worker: dict[int, tuple[MetricWrapperBase, int, int]] = {
            id(m): (m, 0, 1) for m in (self.upstream_requests, self.upstream_errors,
                                       self.decode_prompt_tokens, self.decode_expected_local,
                                       self.decode_local_prefill, self.decode_failed_pulls)}

    def _client_metrics(self, r: CollectorRegistry, latency: tuple[float, ...]) -> None:
        self.requests = Counter("pd_proxy_requests", "Generate requests by outcome", ["outcome"],
                                registry=r)
        self.ttft = Histogram("pd_proxy_ttft_seconds", "Client-side time to first token",
                              buckets=latency, registry=r)
        self.itl = Histogram("pd_proxy_itl_seconds", "Client-side gap between streamed writes",
                             buckets=_ITL_BUCKETS, registry=r)
        self.tpot = Histogram("pd_proxy_tpot_seconds",
                              "Time per output token after the first (when usage gives the count)",
                              buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("pd_proxy_e2e_seconds", "Client-side request latency",
                             buckets=latency, registry=r)
        self.stage = Histogram("pd_proxy_stage_seconds", "Time per stage of the P/D walk", ["stage"],
                               buckets=latency, registry=r)
        self.stages: dict[str, Histogram] = {name: self.stage.labels(stage=name) for name in STAGES}
        self.outcomes: dict[str, Counter] = {outcome: self.requests.labels(outcome=outcome)
                                             for outcome in OUTCOMES}

    def _upstream_metrics(self, r: CollectorRegistry) -> None:
        self.upstream_requests = Counter("pd_proxy_upstream_requests", "Calls to workers",
                                         ["pool", "worker"], registry=r)
        self.upstream_errors = Counter("pd_proxy_upstream_errors", "Failed calls to workers",
                                       ["pool", "worker", "error"], registry=r)
        self.upstream_resends = Counter(
            "pd_proxy_upstream_resends",
            "Generate hops whose kept-alive connection closed with no answer after the request went "
            "out: resent (the worker aborted its id first) or abort_failed (not resent, the hop failed)",
            ["hop", "result"], registry=r)
        self.inflight = Gauge("pd_proxy_inflight_requests", "Requests in flight per pool", ["pool"],
                              registry=r, multiprocess_mode="livesum")

    def _abort_metrics(self, r: CollectorRegistry) -> None:
        self.aborts = Counter("pd_proxy_aborts", "Aborts by source and state", ["source", "state"],
                              registry=r)
        self.abort_fanout = Counter("pd_proxy_abort_fanout", "Abort calls sent to workers",
                                    ["pool", "result"], registry=r)

    def _kv_metrics(self, r: CollectorRegistry, lease_durations: tuple[float, ...]) -> None:
        self.kv_leases_open = Gauge("pd_proxy_kv_leases_open", "KV leases open on prefill workers",
                                    registry=r, multiprocess_mode="livesum")
        self.kv_lease_duration = Histogram("pd_proxy_kv_lease_duration_seconds",
                                           "How long prefill workers held KV",
                                           buckets=lease_durations, registry=r)
        self.kv_leases_closed = Counter("pd_proxy_kv_leases_closed", "KV leases closed by reason",
                                        ["reason"], registry=r)
        self.prefill_missing_kv = Counter("pd_proxy_prefill_missing_kv_params",
                                          "Prefill replies without usable kv_transfer_params",
                                          registry=r)
        self.decode_only = Counter("pd_proxy_decode_only", "Requests run on a decode worker alone",
                                   ["reason"], registry=r)
        self.first_token_mismatch = Counter(
            "pd_proxy_first_token_mismatch",
            "Streams whose decode worker's first token was not the prefill worker's the client had",
            registry=r)
        self.suspect_no_transfer = Counter(
            "pd_proxy_suspect_no_transfer",
            "Prompts of at least one KV block whose decode shows no transferred KV", registry=r)
        self.decode_prompt_tokens = Counter(
            "pd_proxy_decode_prompt_tokens",
            "Decode workers' prompt tokens by source, as their vllm:prompt_tokens_by_source_total grew",
            ["pool", "worker", "source"], registry=r)
        self.decode_expected_local = Counter(
            "pd_proxy_decode_expected_local_tokens",
            "Prompt tokens the proxy's decode hops should make a decode worker compute itself "
            "(decode-only prompts, the last token of hand-offs)", ["pool", "worker"], registry=r)
        self.decode_local_prefill = Counter(
            "pd_proxy_decode_local_prefill_tokens",
            "Prompt tokens decode workers computed beyond what the proxy expected (a hand-off ignored)",
            ["pool", "worker"], registry=r)
        self.decode_failed_pulls = Counter(
            "pd_proxy_decode_failed_pulls",
            "Decode workers' failed KV pulls, as their vllm:nixl_num_failed_transfers_total grew",
            ["pool", "worker"], registry=r)

    def _slow_reader_and_build_metrics(self, r: CollectorRegistry) -> None:
        self.slow_reader_ended = Counter(
            "pd_proxy_slow_reader_ended", "Streams ended because their client read too slowly, by the "
            "limit passed (stream: its own cap; total: the process's budget)", ["limit"], registry=r)
        for limit in ("stream", "total"):
            self.slow_reader_ended.labels(limit=limit)
        self.build_info = Gauge("pd_proxy_build_info", "Build information", ["version"], registry=r,
                                multiprocess_mode="livemax")
        self.build_info.labels(version=_version).set(1)

    def lease_opened(self, lease: Lease, open_count: int) -> None:
        self.kv_leases_open.set(open_count)

    def lease_closed(self, lease: Lease, open_count: int) -> None:
        if lease.duration is not None:
            self.kv_lease_duration.observe(lease.duration)
        self.child(self.kv_leases_closed, lease.reason or "unknown").inc()
        self.kv_leases_open.set(open_count)

    def watch_stream_budget(self, budget: ByteBudget) -> None:
        """Report what ``budget`` holds at scrape time, off the stream's path."""
        self.registry.register(_BudgetCollector(budget))

    def child(self, metric: Any, *values: str) -> Any:
        """``metric.labels(*values)``, cached: the hot path should not pay for the label lookup."""
        key = (id(metric), values)
        found = self._children.get(key)
        if found is None:
            where = self._per_worker.get(id(metric))
            if where is not None and self.members is not None and \
                    not self.members(values[where[1]], values[where[2]]):
                return _UNCOUNTED  # the worker left: its series stay gone (not cached)
            found = self._children[key] = metric.labels(*values)
        return found

    def calls(self, pool: str, worker: str) -> WorkerCalls:
        """The series a call to ``worker`` updates, cached unless the worker left its pool."""
        key = (pool, worker)
        found = self._calls.get(key)
        if found is None:
            found = WorkerCalls(self.child(self.inflight, pool),
                                self.child(self.upstream_requests, pool, worker))
            if found.requests is not _UNCOUNTED:
                self._calls[key] = found
        return found

    def forget_worker(self, pool: str, worker: str) -> None:
        """Remove every series labelled with this worker (the pools' on-leave hook)."""
        self._calls.pop((pool, worker), None)
        for key in [k for k in self._children if k[0] in self._per_worker]:
            _, at_pool, at_worker = self._per_worker[key[0]]
            if key[1][at_pool] == pool and key[1][at_worker] == worker:
                del self._children[key]
        with warnings.catch_warnings():  # multiprocess mode: the files keep it (render filters)
            warnings.simplefilter("ignore", UserWarning)
            for metric, _, _ in self._per_worker.values():
                metric.remove_by_labels({"pool": pool, "worker": worker})

    def render(self) -> bytes:
        path = os.environ.get(MULTIPROC_DIR_ENV)
        if not path:
            return generate_latest(self.registry)
        # --workers N: the shared files' values plus this process's scrape-time collectors,
        # which write no files.
        merged = CollectorRegistry(auto_describe=False)
        files = CollectorRegistry(auto_describe=False)
        MultiProcessCollector(files, path=path)  # type: ignore[no-untyped-call]
        merged.register(_MembersOnly(files, self.members))
        for collector in _scrape_time_collectors(self.registry):
            merged.register(collector)
        return generate_latest(merged)


class _BudgetCollector(Collector):
    def __init__(self, budget: ByteBudget) -> None:
        self.budget = budget

    def collect(self) -> Iterable[Metric]:
        g = GaugeMetricFamily("pd_proxy_slow_reader_buffered_bytes",
                              "Bytes held for streaming clients in this process (queued or being written)")
        g.add_metric([], float(self.budget.used))
        yield g
        b = GaugeMetricFamily("pd_proxy_slow_reader_budget_bytes",
                              "The process's budget of bytes held for streaming clients (0: none)")
        b.add_metric([], float(self.budget.total))
        yield b


MULTIPROC_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"


class _MembersOnly(Collector):
    """The multiprocess files' metrics without the series of workers that left their pool."""

    def __init__(self, source: CollectorRegistry, members: Members | None) -> None:
        self.source = source
        self.members = members

    def collect(self) -> Iterable[Metric]:
        members = self.members
        for family in self.source.collect():
            if members is not None:
                family.samples = [
                    s for s in family.samples
                    if "worker" not in s.labels or members(s.labels.get("pool", ""), s.labels["worker"])]
            yield family


def _scrape_time_collectors(registry: CollectorRegistry) -> list[Collector]:
    """Collectors of ``registry`` that are not value-holding metrics (no multiprocess files)."""
    known: dict[Collector, Any] = getattr(registry, "_collector_to_names", {})
    return [c for c in list(known) if not isinstance(c, MetricWrapperBase)]
