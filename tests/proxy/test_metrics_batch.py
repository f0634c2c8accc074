"""The metrics' hot path: ``ProxyMetrics.child`` series updated straight on their values, and
``HistogramBatch``, a stream's inter-token gaps counted per bucket and added to the histogram in
one step per bucket; both exactly as prometheus_client's own ``inc``/``observe`` would have, also
when a stream ends early."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.parser import text_string_to_metric_families

from proxy.metrics import HistogramBatch, ProxyMetrics
from tests.proxy.conftest import PD, PDFactory, req
from tests.proxy.test_aborts import SLOW_DECODE

BOUNDS = (0.001, 0.01, 0.1, 1.0)


def _samples(registry: CollectorRegistry) -> dict[tuple[str, str], float]:
    return {(s.name, s.labels.get("le", "")): s.value
            for family in registry.collect() for s in family.samples if not s.name.endswith("_created")}


def test_a_batch_counts_as_one_observe_each_would() -> None:
    values = [0.0, 0.0005, 0.001, 0.0010001, 0.01, 0.05, 0.1, 1.0, 1.5, 1e9, 0.02, 0.02]
    direct_registry, batched_registry = CollectorRegistry(), CollectorRegistry()
    direct = Histogram("h", "h", buckets=BOUNDS, registry=direct_registry)
    batched = Histogram("h", "h", buckets=BOUNDS, registry=batched_registry)
    empty = _samples(batched_registry)
    batch = HistogramBatch(batched)
    batch.flush()  # nothing observed: nothing changes
    for v in values:
        direct.observe(v)
        batch.observe(v)
    assert _samples(batched_registry) == empty  # shown only once flushed
    batch.flush()
    assert _samples(batched_registry) == _samples(direct_registry)
    batch.flush()  # flushed twice: counted once
    assert _samples(batched_registry) == _samples(direct_registry)
    batch.observe(0.5)
    direct.observe(0.5)
    batch.flush()  # the batch goes on after a flush
    assert _samples(batched_registry) == _samples(direct_registry)


def _text(metrics: ProxyMetrics) -> list[str]:
    return [line for line in metrics.render().decode().splitlines() if "_created" not in line]


def test_child_series_count_as_prometheus_client_would(monkeypatch: pytest.MonkeyPatch) -> None:
    fast, plain = ProxyMetrics(), ProxyMetrics()
    checks: list[object] = []

    def check(self: object) -> None:
        checks.append(self)

    monkeypatch.setattr(MetricWrapperBase, "_raise_if_not_observable", check)
    for v in (0.0, 0.001, 0.0011, 0.5, 1.0, 3.0, 1e9):
        fast.child(fast.stage, "prefill").observe(v)
        fast.child(fast.requests, "ok").inc()
        fast.child(fast.aborts, "client_call", "unknown").inc(3)
        fast.child(fast.inflight, "decode").inc()
        for histogram in (fast.ttft, fast.e2e, fast.tpot):  # no labels: observed as they are
            histogram.observe(v)
    fast.child(fast.inflight, "decode").dec(2)
    assert checks == []  # checked once, when the series was made: not on every update
    with pytest.raises(ValueError, match="non-negative"):
        fast.child(fast.requests, "ok").inc(-1)
    monkeypatch.undo()
    for v in (0.0, 0.001, 0.0011, 0.5, 1.0, 3.0, 1e9):
        plain.stage.labels("prefill").observe(v)
        plain.requests.labels("ok").inc()
        plain.aborts.labels("client_call", "unknown").inc(3)
        plain.inflight.labels("decode").inc()
        for name in ("ttft", "e2e", "tpot"):
            histogram = plain.registry._names_to_collectors[f"pd_proxy_{name}_seconds"]
            assert isinstance(histogram, Histogram)
            histogram.observe(v)  # the library's own observe
    plain.inflight.labels("decode").dec(2)
    assert _text(fast) == _text(plain)


async def _itl(pd: PD) -> dict[str, float]:
    text = await (await pd.client.get("/metrics")).text()
    family = next(f for f in text_string_to_metric_families(text) if f.name == "pd_proxy_itl_seconds")
    out: dict[str, float] = {}
    for s in family.samples:
        if s.name.endswith("_count"):
            out["count"] = s.value
        elif s.labels.get("le") == "+Inf":
            out["inf"] = s.value
    return out


async def test_every_gap_of_a_stream_is_counted_when_it_ends(pd_factory: PDFactory) -> None:
    pd = await pd_factory(decode=SLOW_DECODE)
    status, events, _ = await pd.stream(req(sp={"max_tokens": 4}))
    assert status == 200 and events[-1] == "[DONE]"
    itl = await _itl(pd)
    assert itl == {"count": 3.0, "inf": 3.0}  # four token writes, 20 ms apart: three gaps
    await pd.quiet()


async def test_a_stream_cut_short_still_counts_its_gaps(pd_factory: PDFactory) -> None:
    pd = await pd_factory(decode=SLOW_DECODE)
    body: dict[str, Any] = {**req(request_id="cut", sp={"max_tokens": 200}), "stream": True}
    r = await pd.client.post("/inference/v1/generate", json=body)
    seen = b""
    while seen.count(b"data: ") < 3:  # three token writes (20 ms apart): at least two gaps
        chunk = await r.content.readany()
        assert chunk, "the stream ended early"
        seen += chunk
    r.close()  # the client leaves mid-stream
    await pd.quiet(limit=5.0)
    itl = await _itl(pd)
    assert itl["count"] >= 2 and itl["count"] == itl["inf"]
