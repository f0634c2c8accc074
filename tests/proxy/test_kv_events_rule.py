"""The ``kv_events`` policy's parts without sockets: the block index kept from a worker's events,
the sequence handling (restarts, gaps, duplicates of a replay) and the choice rule."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_transfer.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
    encode_batch,
)
from proxy.fleet.kv_events import KvEventsHub, KvSource, kv_sources
from proxy.pools.kv_index import BlockIndex, match_prefix, prompt_keys
from proxy.pools.policies import KvAware, PickContext, PickNote, PrefixAware
from proxy.pools.worker import Worker
from workers.sim.engine import KvPool

BS = 4


def stored(tokens: list[int], hashes: list[bytes], parent: bytes | None = None, **kw: Any) -> BlockStored:
    kw.setdefault("medium", "GPU")
    return BlockStored(block_hashes=list(hashes), parent_block_hash=parent, token_ids=tokens, block_size=BS,
                       lora_id=None, lora_name=None, **kw)


def test_stored_chains_are_found_by_the_prompt_and_removals_followed() -> None:
    index = BlockIndex(100)
    prompt = list(range(12))
    index.apply([stored(prompt[:8], [b"a", b"b"]), stored(prompt[8:], [b"c"], parent=b"b")])
    keys = prompt_keys([*prompt, 99], BS)
    assert len(keys) == 3 and index.cached_blocks(keys) == 3
    index.apply([BlockRemoved(block_hashes=[b"b"], medium="GPU")])
    assert index.cached_blocks(keys) == 1  # the chain breaks at the removed block
    index.apply([BlockRemoved(block_hashes=[b"never"], medium="GPU")])  # unknown: ignored
    index.apply([AllBlocksCleared()])
    assert len(index) == 0 and index.cached_blocks(keys) == 0


def test_a_block_whose_parent_is_unknown_or_salted_does_not_match_a_plain_prompt() -> None:
    index = BlockIndex(100)
    index.apply([stored([1, 2, 3, 4], [b"x"], parent=b"missing")])
    assert len(index) == 0
    index.apply([stored([1, 2, 3, 4], [b"s"], extra_keys=[("salt",)])])
    assert index.cached_blocks(prompt_keys([1, 2, 3, 4], BS)) == 0
    index.apply([stored([1, 2, 3, 4], [b"c"], medium="CPU")])  # another medium: not indexed
    assert index.cached_blocks(prompt_keys([1, 2, 3, 4], BS)) == 0


ops = st.lists(st.one_of(
    st.tuples(st.just("alloc"), st.lists(st.integers(0, 2), min_size=1, max_size=14)),
    st.tuples(st.just("free"), st.integers(0, 10)),
    st.tuples(st.just("reset"), st.just(0))), max_size=40)


@settings(max_examples=150, deadline=None)
@given(ops, st.integers(1, 6))
def test_the_index_is_exactly_pd_sims_cache_and_a_subset_under_its_bound(script: list[tuple[str, Any]],
                                                                         bound: int) -> None:
    """Against pd-sim's own prefix cache (which emits the events): every prompt's predicted blocks
    are what the cache would hit; with a bound the index holds at most ``bound`` and never more."""
    batches: list[list[KVEvent]] = []
    pool = KvPool(9, BS, lambda _: None, batches.append)
    exact, small = BlockIndex(10_000), BlockIndex(bound)
    held: list[list[int]] = []
    for op, arg in script:
        if op == "alloc":
            keys = prompt_keys(arg, BS)
            predicted = min(exact.cached_blocks(keys), (len(arg) - 1) // BS)
            assert small.cached_blocks(keys) <= exact.cached_blocks(keys)
            got = pool.allocate_prompt(arg, None)
            if got is not None:
                assert got[1] == predicted * BS  # what the worker itself reports as cached
                held.append(got[0])
        elif op == "free" and held:
            pool.free(held.pop(arg % len(held)))
        elif op == "reset":
            pool.reset()
        for b in batches:
            exact.apply(b)
            small.apply(b)
        batches.clear()
        assert len(exact) == len(pool.cached_hashes()) and len(small) <= bound


def test_match_prefix_counts_each_index_and_stops_early() -> None:
    a, b = BlockIndex(10), BlockIndex(10)
    a.apply([stored(list(range(8)), [b"1", b"2"])])
    b.apply([stored(list(range(4)), [b"1"])])
    got = match_prefix({"a": a, "b": b, "c": BlockIndex(10)}, list(range(10)), BS)
    assert got == {"a": 2, "b": 1, "c": 0}


# --- the feed's sequence handling ------------------------------------------------------------------


class FakeReplayHub(KvEventsHub):
    """The hub with its replay socket replaced by a list of what the worker still buffers."""

    def __init__(self, buffered: list[tuple[int, KVEventBatch]] | None, **kw: Any) -> None:
        super().__init__({"http://p": KvSource("tcp://127.0.0.1:1", "tcp://127.0.0.1:2")}, **kw)
        self.buffered = buffered
        self.asked: list[int] = []

    async def replay(self, source: KvSource, start: int) -> list[tuple[int, bytes, KVEventBatch]] | None:
        self.asked.append(start)
        if self.buffered is None:
            return None
        return [(s, encode_batch(b), b) for s, b in self.buffered if s >= start]


def batch(*events: KVEvent) -> KVEventBatch:
    return KVEventBatch(ts=1.0, events=list(events))


def blocks(n: int) -> list[KVEventBatch]:
    """n batches, each storing one more block of the prompt 0, 1, 2, ..."""
    return [batch(stored(list(range(4 * i, 4 * i + 4)), [bytes([i])], parent=bytes([i - 1]) if i else None))
            for i in range(n)]


def known(hub: KvEventsHub, tokens: int = 64) -> int:
    return hub.feeds["http://p"].index.cached_blocks(prompt_keys(list(range(tokens)), BS))


async def test_a_gap_is_replayed_and_an_unfillable_gap_drops_the_index() -> None:
    bs = blocks(4)
    hub = FakeReplayHub(list(enumerate(bs)))
    hub.feeds["http://p"].connected = True
    await hub.offer("http://p", 0, encode_batch(bs[0]), bs[0])
    await hub.offer("http://p", 3, encode_batch(bs[3]), bs[3])  # 1 and 2 missed
    assert hub.asked == [1] and known(hub) == 4
    hub.buffered = None  # the replay cannot answer any more
    more = blocks(6)
    await hub.offer("http://p", 5, encode_batch(more[5]), more[5])  # 4 missed, lost
    assert hub.asked == [1, 4] and known(hub) == 0 and hub.feeds["http://p"].expected == 6


async def test_a_lower_seq_is_a_restart_unless_the_last_replay_gave_that_very_batch() -> None:
    bs = blocks(3)
    hub = FakeReplayHub(list(enumerate(bs)))
    hub.feeds["http://p"].connected = True
    await hub.sync("http://p")  # on connect: the whole buffer
    assert known(hub) == 3 and hub.feeds["http://p"].expected == 3
    await hub.offer("http://p", 2, encode_batch(bs[2]), bs[2])  # the same batch, live: no change
    assert known(hub) == 3
    fresh = batch(stored([7, 7, 7, 7], [b"n"]))
    hub.buffered = [(0, fresh)]
    await hub.offer("http://p", 0, encode_batch(fresh), fresh)  # a restarted worker's first batch
    assert known(hub) == 0 and hub.feeds["http://p"].index.cached_blocks(prompt_keys([7] * 4, BS)) == 1


async def test_a_worker_sent_new_blocks_that_announces_none_goes_stale_until_its_next_batch() -> None:
    now = [0.0]
    hub = FakeReplayHub([], stale_after=5.0, clock=lambda: now[0])
    hub.feeds["http://p"].connected = True
    w = Worker("http://p", "prefill", block_size=BS)
    assert hub.cached_tokens([w], list(range(8))) == {"http://p": 0}
    hub.picked(w, 0, list(range(8)))
    now[0] = 4.0
    assert hub.usable("http://p") is not None
    now[0] = 6.0
    assert hub.cached_tokens([w], list(range(8))) == {}
    b = blocks(1)[0]
    await hub.offer("http://p", 0, encode_batch(b), b)
    assert hub.cached_tokens([w], list(range(8))) == {"http://p": 4}
    hub.picked(w, 4, list(range(4)))  # all of it cached: nothing new to announce, never stale
    now[0] = 100.0
    assert hub.usable("http://p") is not None


def test_kv_events_pair_with_prefill_urls_in_order_and_refuse_bad_specs() -> None:
    got = kv_sources(["tcp://127.0.0.1:1,tcp://127.0.0.1:2", "ipc:///tmp/x"], ["http://a", "http://b"])
    assert got == {"http://a": KvSource("tcp://127.0.0.1:1", "tcp://127.0.0.1:2"),
                   "http://b": KvSource("ipc:///tmp/x")}
    with pytest.raises(ValueError, match="one per prefill worker"):
        kv_sources(["tcp://127.0.0.1:1"], ["http://a", "http://b"])
    for bad in ("http://x", "tcp://a,", "tcp://a,tcp://b,tcp://c"):
        with pytest.raises(ValueError, match="--kv-events"):
            KvSource.parse(bad)


# --- the choice rule ---------------------------------------------------------------------------


class Known:
    def __init__(self, cached: dict[str, int]) -> None:
        self.cached = cached
        self.picks: list[str] = []

    def cached_tokens(self, candidates: Sequence[Worker], token_ids: Sequence[int]) -> dict[str, int]:
        return {w.url: self.cached[w.url] for w in candidates if w.url in self.cached}

    def picked(self, worker: Worker, cached: int | None, token_ids: Sequence[int]) -> None:
        self.picks.append(worker.url)


def workers(loads: list[int]) -> list[Worker]:
    out = [Worker(f"http://127.0.0.1:{8100 + i}", "prefill") for i in range(len(loads))]
    for w, n in zip(out, loads, strict=True):
        w.inflight = n
    return out


def load(w: Worker) -> float:
    return float(w.inflight)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 20), min_size=1, max_size=8), st.data())
def test_the_choice_never_exceeds_the_cap_and_without_knowledge_is_prefixs(loads: list[int],
                                                                          data: Any) -> None:
    ws = workers(loads)
    prompt = data.draw(st.lists(st.integers(0, 50), max_size=80))
    cached = data.draw(st.dictionaries(st.sampled_from([w.url for w in ws]), st.integers(0, 80)))
    alpha = data.draw(st.floats(0, 4))
    prefix = PrefixAware(block_size=BS)
    picked = KvAware(Known(cached), prefix, alpha=alpha).choose(ws, PickContext(prompt), load)
    assert load(picked) <= prefix.bound(ws, load)
    nothing = {u: 0 for u in cached}
    for knowledge in (None, Known({}), Known(nothing)):
        ref, kv = PrefixAware(block_size=BS), KvAware(knowledge, PrefixAware(block_size=BS), alpha=alpha)
        for _ in range(3):  # the same sequence of picks (prefix's own fallback takes turns)
            assert kv.choose(ws, PickContext(prompt), load) is ref.choose(ws, PickContext(prompt), load)


def test_the_worker_holding_the_prompt_wins_until_its_load_outweighs_it() -> None:
    ws = workers([0, 0, 0])
    prompt = list(range(64))
    knowledge = Known({ws[2].url: 48})
    note = PickNote()
    policy = KvAware(knowledge, PrefixAware(block_size=BS), alpha=0.5)
    assert policy.choose(ws, PickContext(prompt, note=note), load) is ws[2]
    assert note.describe() == "kv 127.0.0.1:8102:48/64" and knowledge.picks == [ws[2].url]
    ws[2].inflight = 2  # 48 - 0.5*64*2 < 0: an idle worker is better
    assert policy.choose(ws, PickContext(prompt), load) is not ws[2]
    ws[2].inflight = 1  # 48 - 32 > 0 still
    assert policy.choose(ws, PickContext(prompt), load) is ws[2]


def test_ties_follow_the_prefix_order_so_replicas_agree() -> None:
    ws = workers([0, 0, 0, 0])
    random.Random(1).shuffle(ws)
    prompt = list(range(32))
    both = Known({ws[0].url: 16, ws[3].url: 16})
    policy = KvAware(both, PrefixAware(block_size=BS))
    first = policy.choose(ws, PickContext(prompt), load)
    assert first is policy.order(ws, prompt, 16)[0]  # held by two: shared, every score 0
    assert policy.order(ws, prompt, 16) == policy.order(list(reversed(ws)), prompt, 16)
    replica = KvAware(both, PrefixAware(block_size=BS))
    assert replica.choose(list(reversed(ws)), PickContext(prompt), load) is first
    assert policy.order(ws, prompt, 0) == PrefixAware(block_size=BS).order(ws, PickContext(prompt))


def test_a_prefix_several_workers_hold_spreads_new_conversations_and_later_turns_stay() -> None:
    """A system prompt cached on two workers is no reason to send every conversation there: new
    conversations spread by what follows it, each the same for its later turns, and a later turn
    goes to the worker holding its own blocks."""
    ws = workers([0] * 8)
    system = list(range(1000, 1064))  # 16 blocks
    knowledge = Known({ws[0].url: 64, ws[1].url: 64})
    policy = KvAware(knowledge, PrefixAware(block_size=BS), alpha=0.5)
    firsts = [system + list(range(100 * c, 100 * c + 16)) for c in range(24)]
    chosen = [policy.choose(ws, PickContext(p), load) for p in firsts]
    assert len(set(chosen)) >= 5  # about 6.5 of 8 expected; before: only the two holders
    for first, worker in zip(firsts, chosen, strict=True):
        later = first + [7] * 20  # the answer and the next user turn: the same worker, all idle
        assert policy.choose(ws, PickContext(later), load) is worker
    later = firsts[0] + [7] * 20
    own = next(w for w in ws if w is not chosen[0])
    knowledge.cached[own.url] = 80  # its blocks are on another worker: they count
    note = PickNote()
    assert policy.choose(ws, PickContext(later, note=note), load) is own
    assert note.describe().endswith(":80/100 shared 64")


# --- the settings --------------------------------------------------------------------------------


def test_the_flags_and_the_config_file_give_one_endpoint_per_prefill_worker(
        tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    from proxy.cli import parse_args  # noqa: PLC0415

    s = parse_args(["--prefill", "http://127.0.0.1:1", "http://127.0.0.1:2", "--decode", "http://127.0.0.1:3",
                    "--prefill-policy", "kv_events", "--kv-events", "tcp://127.0.0.1:5557,tcp://127.0.0.1:5558",
                    "tcp://127.0.0.1:5559", "--kv-events-alpha", "0.25"])
    assert s.pools.prefill_policy == "kv_events" and s.pools.kv_events_alpha == 0.25
    assert s.pools.kv_events == ("tcp://127.0.0.1:5557,tcp://127.0.0.1:5558", "tcp://127.0.0.1:5559")
    config = tmp_path / "proxy.yaml"
    config.write_text("prefill: [http://127.0.0.1:1]\ndecode: http://127.0.0.1:3\n"
                      "prefill-policy: kv_events\nkv-events: [tcp://127.0.0.1:5557]\n")
    assert parse_args(["--config", str(config)]).pools.kv_events == ("tcp://127.0.0.1:5557",)
    with pytest.raises(SystemExit):
        parse_args(["--prefill", "http://127.0.0.1:1", "http://127.0.0.1:2", "--decode", "http://127.0.0.1:3",
                    "--kv-events", "tcp://127.0.0.1:5557"])
    err = capsys.readouterr().err
    assert "one per prefill worker" in err and "Traceback" not in err
