"""The pair preflight against pd-sim workers: a working pair passes, a broken KV link fails."""

from __future__ import annotations

from typing import Any

import aiohttp

from proxy.fleet.health import PairState, Preflight
from proxy.fleet.preflight import handoff_check
from proxy.pools.pool import Pool
from proxy.upstream.client import Upstream


async def test_handoff_preflight_against_pd_sim(sim_factory: Any) -> None:
    p_ok = await sim_factory(role="prefill", zero_latency=True)
    p_bad = await sim_factory(role="prefill", zero_latency=True, faults={"refuse_kv_pulls": True})
    d = await sim_factory(role="decode", zero_latency=True)
    prefill = Pool("prefill", [p_ok.url, p_bad.url])
    decode = Pool("decode", [d.url])
    async with aiohttp.ClientSession() as session:
        check = handoff_check(Upstream(session, api_key=None, connect_timeout=5), block_size=16, timeout=10)
        pf = Preflight(check, timeout=10)
        good, bad = prefill.workers
        dw = decode.workers[0]
        assert await pf.usable_decoders(good, [dw], limit=10) == [dw]
        assert await pf.usable_decoders(bad, [dw], limit=10) == []
        assert pf.state(bad, dw) is PairState.FAILED
    state = await p_ok.state()
    assert not state["kv_held"]  # the preflight's KV was pulled and freed
