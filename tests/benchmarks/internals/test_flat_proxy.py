"""``benchmarks/internals/flat_proxy.py`` (pd-proxy's components in bare shells) really does what
pd-proxy's walk does for a non-stream request, with either hop client: both hops made (D pulls
P's KV), D's tokens answered with the request id and ``Server-Timing``, and afterwards nothing held
(the lease closed as pulled, no worker in flight, the request table empty). ``shells.py``
alternates it with pd-proxy and ``bare_proxy`` and reports each one's CPU and calls per request
(the numbers are in benchmarks/README.md)."""

from __future__ import annotations

import gc
from typing import Any

import aiohttp
import pytest

from benchmarks.internals import flat_proxy, shells
from tests.fixtures_sim import SimFactory


def _body(n: int) -> dict[str, Any]:
    return {"request_id": f"flat-{n}", "token_ids": list(range(1, 40)), "stream": False,
            "sampling_params": {"max_tokens": 5, "temperature": 0.0, "ignore_eos": True}}


@pytest.mark.parametrize("hop_client", flat_proxy.HOP_CLIENTS)
async def test_both_hops_are_made_and_nothing_is_held_after(sim_factory: SimFactory, hop_client: str) -> None:
    prefill = await sim_factory(role="prefill", zero_latency=True)
    decode = await sim_factory(role="decode", zero_latency=True)
    aggregated = await sim_factory(role="aggregated", zero_latency=True)
    server, proxy, upstream_session = await flat_proxy.start(0, prefill.url, decode.url, hop_client)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    serving = proxy.serving
    try:
        async with aiohttp.ClientSession() as session:
            for n in range(3):
                before = await decode.pulled_bytes()
                async with session.post(f"{url}/inference/v1/generate", json=_body(n)) as r:
                    assert r.status == 200
                    assert r.headers["X-Request-Id"] == f"flat-{n}"
                    assert "prefill;dur=" in r.headers["Server-Timing"]
                    answer = await r.json()
                async with session.post(f"{aggregated.url}/inference/v1/generate", json=_body(n)) as r:
                    reference = await r.json()
                ids = answer["choices"][0]["token_ids"]
                assert ids == reference["choices"][0]["token_ids"] and len(ids) == 5
                assert await decode.pulled_bytes() > before  # D pulled P's KV
        assert serving.leases.open_count == 0
        assert [lease.reason for lease in serving.leases.ledger.recent_closed()] == ["pulled"] * 3
        assert all(w.inflight == 0 for w in [*serving.prefill_pool, *serving.decode_pool])
        assert len(serving.table) == 0
    finally:
        server.close()
        await server.wait_closed()
        await upstream_session.close()


async def test_shells_alternates_every_variant_and_counts_their_calls() -> None:
    thresholds, frozen = gc.get_threshold(), gc.get_freeze_count()
    result = await shells.measure(64, 2, calls=True)
    assert (gc.get_threshold(), gc.get_freeze_count()) == (thresholds, frozen)  # as it found them
    assert list(result) == list(shells.VARIANTS)
    for r in result.values():
        cpu = r["cpu_us"]
        assert isinstance(cpu, list) and len(cpu) == 2 and all(x >= 0 for x in cpu)
    calls = {v: float(r["calls"]) for v, r in result.items()}  # type: ignore[arg-type]
    # each shell taken away takes its calls with it. Only the steps of 100 calls or more are
    # ordered: on a loaded machine a count moves by up to about 100 (the timers' heap compared in
    # Python on asyncio's loop, a pooled connection opened again), so neighbours 20 to 120 calls
    # apart (aiohttp's application and its low-level server, the two hop clients) swapped places on
    # a loaded CI machine
    assert calls["pd-proxy"] > calls["flat"] > calls["bare"] > 0
    assert min(calls[v] for v in shells.VARIANTS if v != "bare") > calls["bare"]


async def test_shells_relays_paced_streams_through_the_variants_that_relay_them() -> None:
    with pytest.raises(ValueError, match="streams are relayed by"):
        await shells.measure(8, 1, calls=False, variants=("aiohttp+flat+hops",), stream=True)
    result = await shells.measure(32, 1, calls=True, variants=("pd-proxy", "bare"), stream=True, itl_ms=1.0)
    assert list(result) == ["pd-proxy", "bare"]
    calls = {v: float(r["calls"]) for v, r in result.items()}  # type: ignore[arg-type]
    assert calls["pd-proxy"] > calls["bare"] > 0
