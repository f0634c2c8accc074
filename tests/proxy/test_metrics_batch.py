"""proxy.metrics.HistogramBatch: a stream's inter-token gaps counted per bucket and added to the
histogram in one step per bucket, exactly as one ``observe`` each would have, also when the
stream ends early."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.parser import text_string_to_metric_families

from proxy.metrics import HistogramBatch
from tests.proxy.conftest import PD, PDFactory, req
from tests.proxy.test_aborts import SLOW_DECODE, _disconnect_when

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
    await _disconnect_when(pd, "decoding", body, after_bytes=1)
    await pd.quiet(limit=3.0)
    itl = await _itl(pd)
    assert itl["count"] >= 1 and itl["count"] == itl["inf"]
