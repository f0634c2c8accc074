"""Many concurrent requests with a queue, aborts and disconnects: nothing may stay held."""

from __future__ import annotations

import asyncio

import aiohttp

from tests.fixtures_sim import SimFactory
from tests.sim.helpers import ABORT, GEN, body, eventually, post_json, stream_events, stream_tokens

N = 90  # bounded: a third each completes, is aborted, or drops its connection


async def test_mixed_load_leaves_nothing_held(sim_factory: SimFactory) -> None:
    w = await sim_factory(max_running=16, itl_ms=1.0, prefill_base_ms=0.0, prefill_per_token_ms=0.0)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as s:

        async def complete(i: int) -> list[int]:
            evs = await stream_events(s, w.url + GEN, body([3 + i, 4, 5], max_tokens=20, stream=True))
            assert evs[-1] == "[DONE]"
            return stream_tokens(evs)

        async def aborted(i: int) -> str:
            rid = f"mix-{i}"
            task = asyncio.ensure_future(
                post_json(
                    s,
                    w.url + GEN,
                    body([3 + i, 4, 5], max_tokens=400, request_id=rid, sp={"ignore_eos": True}),
                )
            )
            await asyncio.sleep(0.05)
            await post_json(s, w.url + ABORT, {"request_ids": [f"generate-tokens-{rid}"]})
            st, res = await task
            assert st == 200
            return str(res["choices"][0]["finish_reason"])

        async def dropped(i: int) -> None:
            r = await s.post(
                w.url + GEN, json=body([3 + i, 4, 5], max_tokens=400, stream=True, sp={"ignore_eos": True})
            )
            await r.content.readuntil(b"\n\n")
            r.close()

        jobs = [complete(i) if i % 3 == 0 else aborted(i) if i % 3 == 1 else dropped(i) for i in range(N)]
        results = await asyncio.wait_for(asyncio.gather(*jobs), 60)

        async def idle() -> bool:
            st = await w.state()
            return bool(
                not st["inflight"] and st["running"] == 0 and st["waiting"] == 0 and st["kv_blocks_used"] == 0
            )

        assert await eventually(idle, attempts=500)
    finished = [r for i, r in enumerate(results) if i % 3 == 0]
    assert all(isinstance(t, list) and len(t) == 20 for t in finished)
    # same prompt, same tokens, whatever the load
    assert finished[0] == (await _single(w.url))
    # each is aborted 50 ms in, long before its 400 tokens (at least 0.4 s) could end it
    assert [r for i, r in enumerate(results) if i % 3 == 1] == ["abort"] * (N // 3)


async def _single(url: str) -> list[int]:
    async with aiohttp.ClientSession() as s:
        return stream_tokens(await stream_events(s, url + GEN, body([3, 4, 5], max_tokens=20, stream=True)))
