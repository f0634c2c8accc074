"""``--prefill-policy kv_events`` against pd-sim prefill workers publishing their KV events over
real ZMQ sockets on loopback: routing by what each worker holds, removals and clears followed, a
restarted or silenced event stream (hash fallback, no request failed, then recovery), a replayed
gap, the index's bound, and the subscriber tasks stopped with the pools."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from contextlib import suppress
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kv_transfer.kv_events import KvEventsConfig, loopback_bind_endpoint
from proxy.fleet.kv_events import KvEventsHub
from proxy.http.app import SERVING
from proxy.pools import PoolSettings
from proxy.pools.policies import PickContext, PrefixAware
from tests.fixtures_sim import SimFactory, SimWorker
from tests.proxy.conftest import PD
from workers.sim.kv_events import SimKvEventPublisher
from workers.sim.server import KV_EVENTS
from workers.sim.state import SIM

BS = 4
LIMIT = 15.0


def kv_config(**extra: Any) -> KvEventsConfig:
    return KvEventsConfig(enable_kv_cache_events=True, endpoint=loopback_bind_endpoint(0),
                          replay_endpoint="tcp://127.0.0.1:0", **extra)


async def until(cond: Callable[[], bool | Awaitable[bool]], what: str, limit: float = LIMIT) -> None:
    """Poll ``cond`` (bounded)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + limit
    while True:
        got = cond()
        if not isinstance(got, bool):
            got = await got
        if got:
            return
        if loop.time() > end:
            raise AssertionError(f"not reached in {limit}s: {what}")
        await asyncio.sleep(0.02)


KvPD = Callable[..., Awaitable[PD]]


@pytest.fixture
def kv_pd(sim_factory: SimFactory, aiohttp_client: Any) -> KvPD:
    from proxy.config.settings import ProxySettings  # noqa: PLC0415
    from proxy.http.app import build_app  # noqa: PLC0415

    async def make(n_prefill: int = 3, num_kv_blocks: int = 256, **pools: Any) -> PD:
        ps = [await sim_factory(role="prefill", block_size=BS, num_kv_blocks=num_kv_blocks, zero_latency=True,
                                kv_events=kv_config()) for _ in range(n_prefill)]
        d = await sim_factory(role="decode", block_size=BS, zero_latency=True)
        specs = tuple(f"{p.app[KV_EVENTS].endpoint},{p.app[KV_EVENTS].replay_endpoint}" for p in ps)
        s = ProxySettings(prefill_urls=tuple(p.url for p in ps), decode_urls=(d.url,),
                          pools=PoolSettings.plain(prefill_policy="kv_events", kv_events=specs, **pools))
        app = build_app(s)
        client = await aiohttp_client(app, server_kwargs={"handler_cancellation": True})
        pd = PD(client, app, ps, [d])
        hub = the_hub(pd)
        await until(lambda: all(f.connected for f in hub.feeds.values()), "every feed connected")
        return pd

    return make


def the_hub(pd: PD) -> KvEventsHub:
    hub = pd.app[SERVING].pools.kv_events
    assert hub is not None
    return hub


async def hits(w: SimWorker) -> float:
    """Prompt tokens the worker found in its prefix cache so far (its own counter)."""
    async with w.session.get(w.url + "/metrics") as r:
        text = await r.text()
    return sum(s.value for f in text_string_to_metric_families(text) if f.name == "vllm:prefix_cache_hits"
               for s in f.samples if s.name.endswith("_total"))


async def generate(pd: PD, tokens: list[int]) -> None:
    body = {"token_ids": tokens, "sampling_params": {"temperature": 0, "max_tokens": 2}}
    status, reply, _ = await pd.gen(body)
    assert status == 200, reply


async def direct(w: SimWorker, tokens: list[int]) -> None:
    """A prompt sent to the worker itself (not through the proxy): only its events tell of it."""
    body = {"token_ids": tokens, "sampling_params": {"temperature": 0, "max_tokens": 1}}
    async with w.session.post(w.url + "/inference/v1/generate", json=body) as r:
        assert r.status == 200, await r.text()


def off_hash(pd: PD, worker: SimWorker, seed: int) -> list[int]:
    """A 40-token prompt that the prefix policy would NOT send to ``worker``."""
    prefix = PrefixAware(block_size=BS)
    pool = pd.app[SERVING].pools.prefill
    for i in range(200):
        prompt = [(seed * 1000 + i * 40 + j) % 500 + 1 for j in range(40)]
        order = prefix.order(pool.workers, PickContext(prompt)) or []
        if order[0].url != worker.url:
            return prompt
    raise AssertionError("no prompt hashes elsewhere")


def known(pd: PD, w: SimWorker, prompt: list[int]) -> int:
    return the_hub(pd).cached_tokens([pd.app[SERVING].pools.prefill.get(w.url)], prompt).get(w.url, -1)  # type: ignore[list-item]


async def test_a_prompt_goes_to_the_worker_holding_it_and_removals_are_followed(kv_pd: KvPD) -> None:
    pd = await kv_pd()
    warm = pd.prefill[1]
    first = off_hash(pd, warm, 1)
    await direct(warm, first)  # turn 1, answered by a worker the hash would not pick
    await until(lambda: known(pd, warm, [*first, 7]) == 40, "turn 1's blocks known")
    before = [await hits(p) for p in pd.prefill]
    await generate(pd, [*first, 7, 8, 9, 10, 11])  # turn 2
    after = [await hits(p) for p in pd.prefill]
    assert [a - b for a, b in zip(after, before, strict=True)] == [0, 40, 0]
    metrics = await (await pd.client.get("/metrics")).text()
    assert "pd_proxy_kv_reported_cached_tokens_sum 40.0" in metrics
    assert "pd_proxy_kv_predicted_cached_tokens_sum 40.0" in metrics
    # A reset of the worker's cache is followed: its prompts are no longer predicted.
    async with warm.session.post(warm.url + "/reset_prefix_cache") as r:
        assert r.status == 200
    await until(lambda: len(the_hub(pd).feeds[warm.url].index) == 0, "the clear followed")
    await pd.quiet()


async def test_evictions_are_followed_and_the_index_stays_within_its_bound(kv_pd: KvPD) -> None:
    pd = await kv_pd(n_prefill=1, num_kv_blocks=12, kv_events_max_blocks=6)
    (w,) = pd.prefill
    feed = the_hub(pd).feeds[w.url]
    for i in range(12):
        await generate(pd, [i * 21 + j + 1 for j in range(21)])  # 5 full blocks each
        await until(lambda: feed.expected > 0 and len(feed.index) <= 6, f"batch of prompt {i} in")
        assert len(feed.index) <= 6
    # The cache (11 usable blocks) evicted the first prompts: their blocks left the index too.
    assert known(pd, w, [j + 1 for j in range(21)]) == 0
    assert feed.index.evicted > 0
    await pd.quiet()


async def replace_publisher(w: SimWorker, *, restart: bool) -> SimKvEventPublisher | None:
    """The worker's event stream killed and (``restart``) a new one started on the same
    endpoints with its seq from 0 and an empty cache, as a restarted worker's (the caller closes it)."""
    st = w.app[SIM]
    old = w.app[KV_EVENTS]
    st.pool.on_events = None
    await old.aclose()
    if not restart:
        return None
    st.pool.reset()  # a restarted worker holds nothing (no event sent for it)
    port = int(old.endpoint.rpartition(":")[2])
    new = SimKvEventPublisher(KvEventsConfig(enable_kv_cache_events=True,
                                             endpoint=loopback_bind_endpoint(port),
                                             replay_endpoint=old.replay_endpoint))
    new.start()
    st.pool.on_events = new.publish
    return new


@pytest.mark.parametrize("restart", [True, False])
async def test_a_lost_or_restarted_stream_falls_back_to_the_hash_and_recovers(kv_pd: KvPD,
                                                                              restart: bool) -> None:
    pd = await kv_pd(n_prefill=2)
    w = pd.prefill[0]
    the_hub(pd)
    prompt = off_hash(pd, w, 2)
    await direct(w, prompt)
    await until(lambda: known(pd, w, [*prompt, 1]) == 40, "blocks known")
    new = await replace_publisher(w, restart=restart)
    try:
        await lost_then_back(pd, w, prompt, restart=restart)
    finally:
        if new is not None:
            w.app[SIM].pool.on_events = None
            await new.aclose()


async def lost_then_back(pd: PD, w: SimWorker, prompt: list[int], *, restart: bool) -> None:
    hub = the_hub(pd)
    await until(lambda: not hub.feeds[w.url].connected or len(hub.feeds[w.url].index) == 0,
                "the old stream's index dropped")
    assert known(pd, w, [*prompt, 1]) in (-1, 0)  # unknown (routed by the hash) or empty
    for i in range(6):  # no request fails meanwhile
        await generate(pd, [*prompt, i, 2, 3, 4, 5])
    if restart:
        await until(lambda: hub.feeds[w.url].connected, "reconnected")
        await direct(w, prompt)
        await until(lambda: known(pd, w, [*prompt, 1]) == 40, "known again from the new stream")
    await pd.quiet()


async def test_a_gap_is_filled_from_the_replay_socket(kv_pd: KvPD) -> None:
    pd = await kv_pd(n_prefill=1)
    (w,) = pd.prefill
    pub = w.app[KV_EVENTS]
    hub = the_hub(pd)
    await direct(w, list(range(1, 13)))
    await until(lambda: hub.feeds[w.url].expected == pub.next_seq, "live")
    sock = pub._pub
    real = sock.send_multipart

    def drop(*_: Any, **__: Any) -> None:
        sock.send_multipart = real  # type: ignore[method-assign]

    sock.send_multipart = drop  # type: ignore[method-assign,assignment]
    lost = list(range(100, 112))
    await direct(w, lost)
    await direct(w, list(range(200, 212)))
    await until(lambda: hub.feeds[w.url].expected == pub.next_seq, "caught up")
    assert known(pd, w, [*lost, 1]) == 12
    metrics = await (await pd.client.get("/metrics")).text()
    assert "pd_proxy_kv_events_gaps_total 1.0" in metrics
    assert 'pd_proxy_kv_events_replays_total{result="ok"}' in metrics


async def test_the_subscribers_stop_with_the_pools(kv_pd: KvPD) -> None:
    pd = await kv_pd(n_prefill=2)
    rt = pd.app[SERVING].pools
    tasks = [t for t in rt._tasks if t.get_name().startswith("pool-kv-events-")]
    assert len(tasks) == 2 and not any(t.done() for t in tasks)
    await rt.stop()
    assert all(t.cancelled() for t in tasks)
    assert the_hub(pd)._ctx is None
    with suppress(Exception):
        await rt.stop()
