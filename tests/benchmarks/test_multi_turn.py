"""Multi-turn conversations: the dataset's shape, and the runner against pd-sim (turn k+1 carries
turn k's actual answer and is sent only after it)."""

from __future__ import annotations

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.conversations import run_conversations
from benchmarks.datasets import DatasetError, interleaved_turns, multi_turn_dataset, next_turn_prompt
from tests.fixtures_sim import SimFactory

GEN = "/inference/v1/generate"


def test_dataset_shares_the_system_prompt_and_is_deterministic() -> None:
    convs = multi_turn_dataset(3, 4, user_len=5, output_len=2, system_len=40, seed=7)
    assert convs == multi_turn_dataset(3, 4, user_len=5, output_len=2, system_len=40, seed=7)
    assert len({tuple(c.system) for c in convs}) == 1 and len(convs[0].system) == 40
    assert all(len(c.users) == 4 and all(len(u) == 5 for u in c.users) for c in convs)
    assert len({tuple(c.users[0]) for c in convs}) == 3
    assert interleaved_turns(convs)[:4] == [(0, 0), (1, 0), (2, 0), (0, 1)]
    first = next_turn_prompt(None, [], convs[0], 0)
    assert first == convs[0].system + convs[0].users[0]
    assert next_turn_prompt(first, [9, 9], convs[0], 1) == first + [9, 9] + convs[0].users[1]
    with pytest.raises(DatasetError):
        next_turn_prompt(None, [1], convs[0], 1)
    with pytest.raises(DatasetError):
        multi_turn_dataset(0, 1, user_len=1, output_len=1)


async def prefix_hits(session: aiohttp.ClientSession, url: str) -> float:
    async with session.get(url + "/metrics") as r:
        text = await r.text()
    return sum(s.value for f in text_string_to_metric_families(text) if f.name == "vllm:prefix_cache_hits"
               for s in f.samples if s.name.endswith("_total"))


async def test_each_turn_carries_the_previous_answer_and_waits_for_it(sim_factory: SimFactory) -> None:
    sim = await sim_factory(role="aggregated", block_size=16, zero_latency=True, itl_ms=1.0)
    convs = multi_turn_dataset(3, 3, user_len=8, output_len=5, system_len=48, seed=1)
    async with aiohttp.ClientSession() as session:
        records = await run_conversations(session, sim.url + GEN, convs, max_concurrency=2)
        hits = await prefix_hits(session, sim.url)
    assert all(r.success for r in records) and len(records) == 9
    by = {(r.conversation, r.turn): r for r in records}
    for c in convs:
        for t in range(1, 3):
            prev, cur = by[(c.index, t - 1)], by[(c.index, t)]
            assert len(prev.answer) == 5
            assert cur.prompt == prev.prompt + prev.answer + c.users[t]
            assert cur.order > prev.order  # sent after the previous turn finished
            assert cur.start_s >= prev.start_s + (prev.e2e_s or 0.0)
    # Later turns and other conversations reuse the cached system prompt and history.
    assert hits >= 3 * 48


async def test_a_failed_turn_ends_its_conversation_only(sim_factory: SimFactory) -> None:
    sim = await sim_factory(role="aggregated", zero_latency=True, faults={"fail_next": 1})
    convs = multi_turn_dataset(2, 3, user_len=4, output_len=2, seed=2)
    async with aiohttp.ClientSession() as session:
        records = await run_conversations(session, sim.url + GEN, convs, max_concurrency=1)
    failed = [r for r in records if r.error]
    assert len(failed) == 1 and "HTTP 500" in (failed[0].error or "")
    later = [r for r in records if r.conversation == failed[0].conversation and r.turn > failed[0].turn]
    assert all(not r.sent for r in later)
    other = [r for r in records if r.conversation != failed[0].conversation]
    assert all(r.success for r in other)
