"""``pd_proxy_itl_seconds``: every gap between a stream's writes to its client is observed, also
when the stream ends early."""

from __future__ import annotations

from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from tests.proxy.conftest import PD, PDFactory, req
from tests.proxy.test_aborts import SLOW_DECODE


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
