"""Metrics of the ``kv_events`` policy: the events followed, and its predictions against what the
prefill workers report (``kv_transfer_params.remote_prefill_cached_tokens`` in P's answer:
vLLM 0.32 leaves ``usage.prompt_tokens_details`` null there)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector


class FeedView(Protocol):
    """What the gauges read of ``proxy.fleet.kv_events.KvEventsHub``."""

    @property
    def feeds(self) -> Mapping[str, Any]: ...

    def usable(self, url: str) -> Any: ...

    def stale(self, feed: Any) -> bool: ...

_TOKEN_BUCKETS = (0, 16, 64, 256, 1024, 4096, 16384, 65536, float("inf"))


class _FeedCollector(Collector):
    def __init__(self) -> None:
        self.hub: FeedView | None = None

    def collect(self) -> Iterator[GaugeMetricFamily]:
        size = GaugeMetricFamily("pd_proxy_kv_index_blocks",
                                 "Blocks the proxy knows a prefill worker holds (from its KV events)",
                                 labels=["worker"])
        usable = GaugeMetricFamily("pd_proxy_kv_events_usable",
                                   "1 when a prefill worker's KV events are connected and not stale",
                                   labels=["worker"])
        stale = GaugeMetricFamily("pd_proxy_kv_events_stale_workers",
                                  "Prefill workers whose KV events are stale (routed as unknown)")
        n_stale = 0
        if self.hub is not None:
            for url, feed in self.hub.feeds.items():
                size.add_metric([url], float(len(feed.index)))
                usable.add_metric([url], 1.0 if self.hub.usable(url) is not None else 0.0)
                n_stale += self.hub.stale(feed)
        stale.add_metric([], float(n_stale))
        yield size
        yield usable
        yield stale


class KvEventsMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.batches = Counter("pd_proxy_kv_events_batches", "KV event batches applied", registry=registry)
        self.events = Counter("pd_proxy_kv_events", "KV events applied", registry=registry)
        self.gaps = Counter("pd_proxy_kv_events_gaps", "Sequence gaps in a worker's KV events",
                            registry=registry)
        self.replays = Counter("pd_proxy_kv_events_replays",
                               "Replays asked for (ok: every missing batch came)", ["result"],
                               registry=registry)
        self.resets = Counter("pd_proxy_kv_events_resets", "A worker's index dropped, by reason",
                              ["reason"], registry=registry)
        self.predicted = Histogram("pd_proxy_kv_predicted_cached_tokens",
                                   "Prompt tokens the kv_events policy predicted cached on the chosen "
                                   "prefill worker", buckets=_TOKEN_BUCKETS, registry=registry)
        self.reported = Histogram("pd_proxy_kv_reported_cached_tokens",
                                  "Prompt tokens the prefill worker reported cached for those requests",
                                  buckets=_TOKEN_BUCKETS, registry=registry)
        self.prompt = Counter("pd_proxy_kv_prompt_tokens",
                              "Prompt tokens of the requests routed by kv_events", registry=registry)
        for result in ("ok", "incomplete"):
            self.replays.labels(result=result)
        for reason in ("connect", "restart", "gap", "disconnect", "unhealthy", "error"):
            self.resets.labels(reason=reason)
        self._feeds = _FeedCollector()
        registry.register(self._feeds)

    def watch(self, hub: FeedView) -> None:
        self._feeds.hub = hub

    def outcome(self, predicted: int | None, prompt_tokens: int, reply: dict[str, Any]) -> None:
        """One request routed by ``kv_events``: its prediction (None: unknown, counted as 0) and
        what P's answer reports, when it does."""
        self.prompt.inc(prompt_tokens)
        self.predicted.observe(predicted or 0)
        params = reply.get("kv_transfer_params")
        reported = params.get("remote_prefill_cached_tokens") if isinstance(params, dict) else None
        if type(reported) is int and reported >= 0:
            self.reported.observe(reported)
