"""pd-sim records the W3C ``traceparent`` a generate call carried (for pd-proxy's tracing tests)."""

from __future__ import annotations

import aiohttp

from tests.fixtures_sim import SimFactory
from tests.sim.helpers import GEN, body
from workers.sim.state import TRACEPARENTS_KEPT

TP = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


async def test_traceparent_is_recorded_with_the_request_id(sim_factory: SimFactory) -> None:
    w = await sim_factory(zero_latency=True)
    async with aiohttp.ClientSession() as s:
        for headers in ({"traceparent": TP, "X-Request-Id": "a"}, {"X-Request-Id": "b"}):
            async with s.post(w.url + GEN, json=body(stream=True), headers=headers) as r:
                assert r.status == 200
                await r.read()
    state = await w.state()
    # only the call that carried one; the id is the engine's
    assert state["traceparents"] == [{"request_id": "generate-tokens-a", "traceparent": TP}]


async def test_the_record_is_bounded(sim_factory: SimFactory) -> None:
    w = await sim_factory(zero_latency=True)
    async with aiohttp.ClientSession() as s:
        for i in range(TRACEPARENTS_KEPT + 3):
            async with s.post(w.url + GEN, json=body(max_tokens=1), headers={"traceparent": TP,
                              "X-Request-Id": str(i)}) as r:
                assert r.status == 200
                await r.read()
    records = (await w.state())["traceparents"]
    assert len(records) == TRACEPARENTS_KEPT
    assert records[0]["request_id"] == "generate-tokens-3"
