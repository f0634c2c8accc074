from __future__ import annotations

import random
from collections import Counter

import pytest

from proxy.pools.policies import (
    LeastLoaded,
    LeastOutstandingTokens,
    PickContext,
    PowerOfTwo,
    PrefixAware,
    RoundRobin,
    SessionAffinity,
    make_policy,
    rendezvous_order,
)
from proxy.pools.pool import LoadWeights, Pool
from proxy.pools.worker import ScrapedLoad
from tests.proxy.pools.helpers import FakeClock

URLS = [f"http://127.0.0.1:{9000 + i}" for i in range(4)]


def pool(policy_name: str, n: int = 4, **kw: object) -> Pool:
    return Pool("p", URLS[:n], policy=make_policy(policy_name, **kw))  # type: ignore[arg-type]


def test_round_robin_takes_turns() -> None:
    p = pool("round_robin", 3)
    assert [p.pick().url for _ in range(6)] == URLS[:3] * 2


def test_least_loaded_prefers_idle_and_rotates_ties() -> None:
    p = pool("least_loaded", 3)
    w0, w1, w2 = p.workers
    w0.inflight, w1.inflight, w2.inflight = 2, 1, 1
    picks = {p.pick().url for _ in range(4)}
    assert picks == {w1.url, w2.url}
    w2.inflight = 0
    assert p.pick() is w2


def test_power_of_two_never_picks_the_busiest_of_its_pair() -> None:
    p = Pool("p", URLS, policy=PowerOfTwo(random.Random(7)))
    busy = p.workers[0]
    busy.inflight = 100
    counts = Counter(p.pick().url for _ in range(400))
    # The busiest can only win when both samples are... never: a pair always has another worker.
    assert counts[busy.url] == 0
    assert len(counts) == 3


def test_prefix_aware_same_prefix_same_worker_and_spread_of_prefixes() -> None:
    p = pool("prefix", block_size=4, prefix_blocks=2)
    shared = [1, 2, 3, 4, 5, 6, 7, 8]
    picks = {p.pick(PickContext(token_ids=[*shared, tail, tail + 1])).url for tail in range(50, 80)}
    assert len(picks) == 1  # only the first 2 blocks count
    spread = {p.pick(PickContext(token_ids=[i, 2, 3, 4, 5, 6, 7, 8, 9])).url for i in range(40)}
    assert len(spread) == 4


def test_prefix_key_uses_only_full_blocks() -> None:
    pa = PrefixAware(block_size=4, prefix_blocks=2)
    assert pa.prefix_key([1, 2, 3]) is None
    assert pa.prefix_key([1, 2, 3, 4, 9]) == b"1,2,3,4"
    assert pa.prefix_key(list(range(20))) == b"0,1,2,3,4,5,6,7"


def test_prefix_aware_short_prompt_falls_back_to_least_loaded() -> None:
    p = pool("prefix", block_size=16)
    for w in p.workers[:3]:
        w.inflight = 5
    assert p.pick(PickContext(token_ids=[1, 2, 3])) is p.workers[3]


def test_prefix_aware_imbalance_guard_moves_to_next_in_hash_order() -> None:
    p = pool("prefix", block_size=2, prefix_blocks=1, imbalance_ratio=1.5, imbalance_slack=2)
    ctx = PickContext(token_ids=[7, 7, 7])
    home = p.pick(ctx)
    order = rendezvous_order(b"7,7", p.workers)
    assert order[0] is home
    home.inflight = 2  # within 0 * 1.5 + 2
    assert p.pick(ctx) is home
    home.inflight = 3  # beyond the bound: the second in hash order (idle) takes it
    assert p.pick(ctx) is order[1]


def test_session_affinity_sticks_and_survives_other_workers_leaving() -> None:
    p = pool("session")
    ctx = PickContext(session_id="user-42")
    home = p.pick(ctx)
    assert all(p.pick(ctx) is home for _ in range(10))
    home.inflight = 50  # affinity ignores load
    assert p.pick(ctx) is home
    other = next(w for w in p.workers if w is not home)
    p.remove(other.url)
    assert p.pick(ctx) is home  # rendezvous: unaffected by another worker leaving
    home.draining = True
    moved = p.pick(ctx)
    assert moved is not home
    home.draining = False
    assert p.pick(ctx) is home


def test_session_affinity_without_session_is_least_loaded() -> None:
    p = Pool("p", URLS[:2], policy=SessionAffinity())
    p.workers[0].inflight = 3
    assert p.pick(PickContext()) is p.workers[1]


def test_least_outstanding_tokens() -> None:
    p = Pool("p", URLS[:3], policy=LeastOutstandingTokens())
    a, b, c = p.workers
    a.outstanding_tokens, b.outstanding_tokens, c.outstanding_tokens = 500, 20, 300
    a.inflight, b.inflight, c.inflight = 1, 4, 1  # requests count less than tokens
    assert p.pick() is b


def test_scraped_load_feeds_the_choice_only_when_enabled_and_fresh() -> None:
    clock = FakeClock()
    for use in (False, True):
        p = Pool("p", URLS[:2], policy=LeastLoaded(), clock=clock,
                 weights=LoadWeights(use_scraped=use, waiting=1.0, kv_usage=4.0, max_age=10))
        a, b = p.workers
        a.inflight, b.inflight = 1, 2
        a.load = ScrapedLoad(waiting=5, running=8, kv_usage=0.9, at=clock())
        assert p.pick() is (b if use else a)
        clock.advance(11)  # stale scrape: ignored
        assert p.pick() is a


def test_rr_policy_and_unknown_name() -> None:
    assert isinstance(make_policy("round_robin"), RoundRobin)
    with pytest.raises(ValueError, match="unknown routing policy"):
        make_policy("random")
