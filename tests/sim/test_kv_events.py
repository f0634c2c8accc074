"""pd-sim's KV events (``--kv-events-config``): what its prefix cache publishes, read with real
ZMQ sockets as a subscriber (pd-proxy) reads vLLM's."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import zmq
import zmq.asyncio
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_transfer.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
    KvEventsConfig,
    is_replay_end,
    loopback_bind_endpoint,
    parse_pub_frames,
    replay_request,
)
from tests.fixtures_sim import SimFactory, SimWorker
from tests.sim.helpers import GEN, body, post_json
from workers.sim.engine import KvPool, event_hash
from workers.sim.server import KV_EVENTS

BS = 4


def replay_state(events: list[KVEvent], known: set[bytes]) -> set[bytes]:
    """What a subscriber knows after applying ``events``."""
    for e in events:
        if isinstance(e, BlockStored):
            assert len(e.token_ids) == e.block_size * len(e.block_hashes)
            known.update(h for h in e.block_hashes if isinstance(h, bytes))
        elif isinstance(e, BlockRemoved):
            for h in e.block_hashes:
                assert h in known, "a block removed that was never stored"
                known.discard(h)
        else:
            known.clear()
    return known


ops = st.lists(
    st.one_of(
        st.tuples(st.just("alloc"), st.lists(st.integers(0, 2), min_size=1, max_size=14)),
        st.tuples(st.just("free"), st.integers(0, 10)),
        st.tuples(st.just("reset"), st.just(0)),
    ),
    max_size=40,
)


@settings(max_examples=200, deadline=None)
@given(ops)
def test_the_event_stream_replays_to_exactly_the_cached_hashes(script: list[tuple[str, Any]]) -> None:
    batches: list[list[KVEvent]] = []
    pool = KvPool(9, BS, lambda _: None, batches.append)
    held: list[list[int]] = []
    known: set[bytes] = set()
    for op, arg in script:
        if op == "alloc":
            got = pool.allocate_prompt(arg, None)
            if got is not None:
                held.append(got[0])
        elif op == "free" and held:
            pool.free(held.pop(arg % len(held)))
        elif op == "reset":
            pool.reset()
        for batch in batches:
            assert batch, "an empty batch"
            replay_state(batch, known)
        batches.clear()
        assert known == pool.cached_hashes()


def test_stored_events_chain_to_the_cached_prefix_and_carry_the_salt() -> None:
    batches: list[list[KVEvent]] = []
    pool = KvPool(64, BS, lambda _: None, batches.append)
    first = list(range(10, 22))  # 3 full blocks
    blocks, _ = pool.allocate_prompt(first, None) or ([], 0)
    (stored,) = batches.pop()
    assert isinstance(stored, BlockStored) and stored.parent_block_hash is None
    assert stored.token_ids == first and stored.block_size == BS and stored.medium == "GPU"
    assert len(stored.block_hashes) == 3 and stored.extra_keys is None
    pool.free(blocks)
    # Shares two blocks: only the third and fourth are new, chained to the second.
    second = [*first[:8], 90, 91, 92, 93, 94, 95, 96, 97, 98]
    assert pool.allocate_prompt(second, None) is not None
    (stored2,) = batches.pop()
    assert isinstance(stored2, BlockStored)
    assert stored2.parent_block_hash == stored.block_hashes[1]
    assert stored2.token_ids == second[8:16] and len(stored2.block_hashes) == 2
    assert pool.allocate_prompt([1, 2, 3, 4, 5], "tenant") is not None
    (salted,) = batches.pop()
    assert isinstance(salted, BlockStored) and salted.extra_keys == [("tenant",)]


def test_eviction_removes_the_last_block_of_a_prompt_first() -> None:
    batches: list[list[KVEvent]] = []
    pool = KvPool(4, BS, lambda _: None, batches.append)  # 3 usable blocks
    blocks, _ = pool.allocate_prompt(list(range(12)), None) or ([], 0)
    (stored,) = batches.pop()
    assert isinstance(stored, BlockStored)
    pool.free(blocks)
    assert pool.allocate_prompt([100, 101, 102, 103, 104], None) is not None
    removed = [e for e in batches.pop() if isinstance(e, BlockRemoved)]
    # Two blocks were needed: the prompt's tail went first, its head is still a hit.
    assert [e.block_hashes for e in removed] == [[stored.block_hashes[2]], [stored.block_hashes[1]]]
    assert pool.cached_hashes() >= {stored.block_hashes[0]}


def test_reset_is_refused_while_blocks_are_in_use() -> None:
    batches: list[list[KVEvent]] = []
    pool = KvPool(16, BS, lambda _: None, batches.append)
    blocks, _ = pool.allocate_prompt(list(range(8)), None) or ([], 0)
    batches.clear()
    assert not pool.reset() and batches == []
    pool.free(blocks)
    assert pool.reset() and batches == [[AllBlocksCleared()]] and pool.cached_hashes() == set()


# --- over ZMQ ----------------------------------------------------------------------------------


def kv_config(**extra: Any) -> KvEventsConfig:
    return KvEventsConfig(
        enable_kv_cache_events=True,
        endpoint=loopback_bind_endpoint(0),
        replay_endpoint="tcp://127.0.0.1:0",
        topic="kv",
        **extra,
    )


@pytest.fixture
async def zctx() -> AsyncIterator[zmq.asyncio.Context]:
    ctx = zmq.asyncio.Context()
    try:
        yield ctx
    finally:
        ctx.destroy(linger=0)


async def replay(ctx: zmq.asyncio.Context, endpoint: str, start: int) -> list[tuple[int, KVEventBatch]]:
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(endpoint)
    await dealer.send_multipart(replay_request(start))
    out: list[tuple[int, KVEventBatch]] = []
    for _ in range(1000):
        frames = await asyncio.wait_for(dealer.recv_multipart(), 10.0)
        assert frames[0] == b""
        if is_replay_end(frames[1:]):
            dealer.close(linger=0)
            return out
        topic, seq, batch = parse_pub_frames(frames[1:])
        assert topic == "kv"
        out.append((seq, batch))
    raise AssertionError("no end marker")


async def generate(sim: SimWorker, tokens: list[int]) -> None:
    status, reply = await post_json(sim.session, sim.url + GEN, body(tokens, max_tokens=1))
    assert status == 200, reply


async def test_a_subscriber_sees_the_prompts_blocks_and_replays_what_it_missed(
    sim_factory: SimFactory, zctx: zmq.asyncio.Context
) -> None:
    sim = await sim_factory(role="prefill", block_size=BS, num_kv_blocks=64, zero_latency=True,
                            kv_events=kv_config())
    pub = sim.app[KV_EVENTS]
    assert pub.endpoint.startswith("tcp://127.0.0.1:") and pub.replay_endpoint is not None
    sub = zctx.socket(zmq.SUB)
    sub.subscribe(b"kv")
    sub.connect(pub.endpoint)
    # A PUB drops what it sends before the subscription reaches it: send new prompts until one
    # arrives live (bounded), as a subscriber that starts late would.
    live: tuple[str, int, KVEventBatch] | None = None
    for i in range(100):
        await generate(sim, [200 + i] * (2 * BS + 1))
        if await sub.poll(100):
            live = parse_pub_frames(await sub.recv_multipart())
            break
    assert live is not None
    topic, seq, batch = live
    (stored,) = batch.events
    assert topic == "kv" and isinstance(stored, BlockStored) and batch.data_parallel_rank == 0
    assert stored.token_ids == [200 + seq] * (2 * BS)  # full blocks only: the 9th token is not cached
    # Everything from seq 0 on is in the replay buffer, in order, the live batch among them.
    replayed = await replay(zctx, pub.replay_endpoint, 0)
    assert [s for s, _ in replayed] == list(range(seq + 1))
    assert replayed[seq][1] == batch
    assert [s for s, _ in await replay(zctx, pub.replay_endpoint, seq)] == [seq]
    # A reset is published too.
    async with sim.session.post(sim.url + "/reset_prefix_cache") as r:
        assert r.status == 200
    for _ in range(100):
        if await sub.poll(100):
            break
    _, seq2, cleared = parse_pub_frames(await sub.recv_multipart())
    assert seq2 == seq + 1 and cleared.events == [AllBlocksCleared()]
    sub.close(linger=0)


async def test_replay_keeps_only_buffer_steps_batches_and_survives_bad_requests(
    sim_factory: SimFactory, zctx: zmq.asyncio.Context
) -> None:
    sim = await sim_factory(role="prefill", block_size=BS, num_kv_blocks=64, zero_latency=True,
                            kv_events=kv_config(buffer_steps=3))
    pub = sim.app[KV_EVENTS]
    assert pub.replay_endpoint is not None
    for i in range(5):
        await generate(sim, [300 + i] * BS + [1])
    assert pub.next_seq == 5
    bad = zctx.socket(zmq.DEALER)
    bad.connect(pub.replay_endpoint)
    await bad.send_multipart([b"", b"\x01"])  # not 8 bytes: ignored, the service carries on
    bad.close(linger=0)
    assert [s for s, _ in await replay(zctx, pub.replay_endpoint, 0)] == [2, 3, 4]


async def test_without_the_config_nothing_is_opened(sim_factory: SimFactory) -> None:
    sim = await sim_factory(role="prefill", zero_latency=True)
    assert sim.app.get(KV_EVENTS) is None
    sim2 = await sim_factory(role="prefill", zero_latency=True,
                             kv_events=KvEventsConfig(enable_kv_cache_events=False))
    assert sim2.app.get(KV_EVENTS) is None


async def run_cli(*args: str) -> tuple[asyncio.subprocess.Process, bytes]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "workers.sim.cli", "--host", "127.0.0.1", "--port", "0", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    assert proc.stdout is not None
    line = await asyncio.wait_for(proc.stdout.readline(), 30.0)
    return proc, line


async def test_cli_takes_vllms_json_and_prints_the_bound_endpoints(zctx: zmq.asyncio.Context) -> None:
    cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": loopback_bind_endpoint(0),
           "replay_endpoint": "tcp://127.0.0.1:0", "topic": "kv"}
    proc, line = await run_cli("--role", "prefill", "--kv-events-config", json.dumps(cfg))
    try:
        info = json.loads(line)
        kv = info["kv_events"]
        assert kv["topic"] == "kv" and kv["endpoint"].startswith("tcp://127.0.0.1:")
        async with aiohttp.ClientSession() as session:
            status, _ = await post_json(session, info["url"] + GEN, body([5] * 20, max_tokens=1))
        assert status == 200
        (only,) = await replay(zctx, kv["replay_endpoint"], 0)
        assert isinstance(only[1].events[0], BlockStored)
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        await proc.wait()


@pytest.mark.parametrize(
    ("config", "message"),
    [('{"enable_kv_cache_events": true, "endpont": "x"}', b"unknown key(s) endpont"),
     ('{"enable_kv_cache_events": true, "endpoint": "tcp://*:notaport"}', b"cannot open")],
)
async def test_cli_rejects_a_bad_config_with_a_clear_message(config: str, message: bytes) -> None:
    proc, line = await run_cli("--kv-events-config", config)
    assert proc.stderr is not None
    err = await asyncio.wait_for(proc.stderr.read(), 30.0)
    assert await proc.wait() == 2 and line == b""
    assert message in err and b"Traceback" not in err


def test_event_hash_is_eight_big_endian_bytes() -> None:
    assert event_hash(1) == b"\x00" * 7 + b"\x01"
