from __future__ import annotations

import asyncio
from typing import Any

import pytest

from proxy.pools.breaker import BreakerConfig, CircuitState
from proxy.pools.errors import NoWorkerAvailable, Overloaded
from proxy.pools.policies import PickContext, RoundRobin
from proxy.pools.pool import Pool
from proxy.pools.worker import Outcome, Worker
from tests.proxy.pools.helpers import FakeClock

A, B, C = "http://127.0.0.1:9001", "http://127.0.0.1:9002", "http://127.0.0.1:9003"


def test_membership_by_source() -> None:
    changes: list[int] = []
    p = Pool("decode", [A + "/"])
    p.on_change.append(lambda pool: changes.append(len(pool)))
    assert [w.url for w in p] == [A]
    p.add(B, "file")
    p.add(B, "admin")
    assert p.get(B) is not None and p.get(B).sources == {"file", "admin"}  # type: ignore[union-attr]
    assert p.discard(B, "file") is False  # still declared by admin
    assert p.discard(B, "admin") is True
    p.replace_source("k8s", [B, C])
    p.replace_source("k8s", [C])
    assert sorted(w.url for w in p) == [A, C]
    assert p.remove(A) and not p.remove(A)
    assert changes == [2, 1, 2, 3, 2, 1]
    with pytest.raises(ValueError):
        p.add("127.0.0.1:9000", "x")


def test_worker_leaving_keeps_its_inflight_count_on_the_object() -> None:
    p = Pool("decode", [A, B])
    w = p.get(A)
    assert w is not None
    w.begin(10)
    p.remove(A)
    p.release(w, Outcome.SUCCESS, 10)
    assert w.inflight == 0 and w.outstanding_tokens == 0


@pytest.mark.parametrize("flap", ["k8s", "admin"])
def test_a_worker_back_while_its_requests_run_keeps_their_count_and_its_breaker(flap: str) -> None:
    """An EndpointSlice flap (or an admin's DELETE then POST) while requests run on the worker: it
    comes back as the same worker, its in-flight count and open circuit kept, not a fresh one."""
    p = Pool("decode", breaker=BreakerConfig(failure_threshold=1), clock=FakeClock())
    p.replace_source("k8s", [A, B])
    w = p.get(A)
    assert w is not None
    w.begin()
    w.begin()
    p.release(w, Outcome.FAILURE)  # the circuit opens
    assert w.circuit is CircuitState.OPEN and w.inflight == 1
    if flap == "k8s":
        p.replace_source("k8s", [B])
        assert not p.has(A)
        p.replace_source("k8s", [A, B])
    else:
        assert p.remove(A) and not p.has(A)
        p.add(A, "admin")
    back = p.get(A)
    assert back is w and back.inflight == 1 and back.circuit is CircuitState.OPEN
    assert [x.url for x in p.candidates()] == [B]  # the open circuit still keeps requests off it
    p.release(w, Outcome.NEUTRAL)
    assert back.inflight == 0


def test_a_departed_worker_is_forgotten_once_its_requests_end() -> None:
    p = Pool("decode", [A, B])
    w = p.get(A)
    assert w is not None
    w.begin()
    w.begin()
    assert p.remove(A)
    p.release(w, Outcome.SUCCESS)
    assert len(p._departed) == 1  # one request still runs on it
    p.release(w, Outcome.SUCCESS)
    assert p._departed == {}  # drained: nothing kept
    fresh = p.add(A, "admin")
    assert fresh is not w and fresh.inflight == 0
    idle = p.get(B)
    assert idle is not None and p.remove(B) and p._departed == {}  # nothing ran on it: not kept
    for i in range(100):  # bounded: workers that come and go leave nothing behind
        url = f"http://127.0.0.1:{10000 + i}"
        x = p.add(url, "k8s")
        x.begin()
        p.discard(url, "k8s")
        p.release(x, Outcome.NEUTRAL)
    assert p._departed == {} and sorted(w.url for w in p) == [A]


def test_unavailable_workers_are_never_picked() -> None:
    clock = FakeClock()
    p = Pool("prefill", [A, B, C], policy=RoundRobin(), clock=clock,
             breaker=BreakerConfig(failure_threshold=1, open_seconds=3))
    a, b, c = p.workers
    a.healthy = False
    b.draining = True
    assert {p.pick().url for _ in range(5)} == {C}
    c.begin()
    p.release(c, Outcome.FAILURE)
    assert c.circuit is CircuitState.OPEN
    with pytest.raises(NoWorkerAvailable) as e:
        p.pick()
    assert e.value.status == 503
    assert e.value.retry_after == pytest.approx(3.0)
    assert e.value.to_response().headers["Retry-After"] == "3"
    clock.advance(3)
    assert p.pick() is c  # half-open trial


def test_pick_excludes_tried_workers() -> None:
    p = Pool("prefill", [A, B])
    a = p.get(A)
    assert a is not None
    assert p.pick(exclude=[a]).url == B


async def test_acquire_waits_for_room_then_gets_the_freed_worker() -> None:
    p = Pool("decode", [A, B], max_inflight_per_worker=1, max_waiters=4)
    w1 = await p.acquire(PickContext(tokens=5))
    w2 = await p.acquire()
    assert {w1.url, w2.url} == {A, B} and w1.outstanding_tokens == 5
    waiter = asyncio.create_task(p.acquire(limit=30))
    await asyncio.sleep(0)
    assert not waiter.done() and len(p.queue) == 1
    p.release(w1, Outcome.SUCCESS, 5)
    got = await waiter
    assert got is w1 and got.inflight == 1 and got.outstanding_tokens == 0


async def test_acquire_overflow_and_timeout_are_429() -> None:
    p = Pool("decode", [A], max_inflight_per_worker=1, max_waiters=1, retry_after=2)
    await p.acquire()
    waiter = asyncio.create_task(p.acquire(limit=30))
    await asyncio.sleep(0)
    with pytest.raises(Overloaded) as full:
        await p.acquire(limit=30)
    assert full.value.reason == "queue_full" and full.value.status == 429
    assert full.value.to_response().headers["Retry-After"] == "2"
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert len(p.queue) == 0  # the cancelled waiter left the queue
    with pytest.raises(Overloaded) as late:
        await p.acquire(limit=0.01)
    assert late.value.reason == "queue_timeout"


async def test_acquire_with_nothing_admissible_fails_fast() -> None:
    p = Pool("decode", [A], max_inflight_per_worker=1)
    p.workers[0].healthy = False
    with pytest.raises(NoWorkerAvailable):
        await p.acquire(limit=30)


async def test_a_recovering_circuit_is_waited_for_only_when_asked() -> None:
    """A decode pick (P's KV already held) waits, bounded, for a worker whose circuit is about
    to let requests in; without ``wait_recovering`` it is refused at once, as before."""
    clock = FakeClock()
    p = Pool("decode", [A], clock=clock, breaker=BreakerConfig(failure_threshold=1, open_seconds=5.0))
    w = p.workers[0]
    w.breaker.record_failure()
    clock.advance(5.0)
    trial = await p.acquire()  # half-open: this is its one trial
    with pytest.raises(NoWorkerAvailable):
        await p.acquire(limit=30)
    waiter = asyncio.create_task(p.acquire(limit=30, wait_recovering=True))
    await asyncio.sleep(0.01)
    assert not waiter.done()
    p.release(trial, Outcome.SUCCESS)  # the trial closes the circuit and wakes the waiter
    assert (await asyncio.wait_for(waiter, 5)) is w
    assert w.breaker.state is CircuitState.CLOSED


async def test_a_recovery_wait_is_bounded_and_ends_in_503() -> None:
    clock = FakeClock()
    p = Pool("decode", [A], clock=clock, breaker=BreakerConfig(failure_threshold=1, open_seconds=5.0))
    p.workers[0].breaker.record_failure()  # open for 5 s of the (frozen) clock
    with pytest.raises(NoWorkerAvailable):
        await asyncio.wait_for(p.acquire(limit=0.05, wait_recovering=True), 5)
    with pytest.raises(NoWorkerAvailable):  # nothing recovering (probes failed): no wait at all
        p.workers[0].healthy = False
        await p.acquire(limit=30, wait_recovering=True)


async def test_a_cancelled_recovery_wait_leaves_the_others_waiting() -> None:
    clock = FakeClock()
    p = Pool("decode", [A], clock=clock, breaker=BreakerConfig(failure_threshold=1, open_seconds=5.0))
    p.workers[0].breaker.record_failure()
    clock.advance(5.0)
    trial = await p.acquire()
    gone = asyncio.create_task(p.acquire(limit=30, wait_recovering=True))
    stays = asyncio.create_task(p.acquire(limit=30, wait_recovering=True))
    await asyncio.sleep(0.01)
    gone.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gone
    p.release(trial, Outcome.SUCCESS)
    assert (await asyncio.wait_for(stays, 5)) is trial and trial.inflight == 1


async def test_an_open_circuit_is_waited_for_until_its_trial_may_begin() -> None:
    p = Pool("decode", [A], breaker=BreakerConfig(failure_threshold=1, open_seconds=0.1))
    p.workers[0].breaker.record_failure()
    got = await asyncio.wait_for(p.acquire(limit=5, wait_recovering=True), 5)
    assert got is p.workers[0] and got.breaker.state is CircuitState.HALF_OPEN


async def test_cancelled_woken_waiter_passes_its_turn_on() -> None:
    p = Pool("decode", [A], max_inflight_per_worker=1, max_waiters=4)
    w = await p.acquire()
    first = asyncio.create_task(p.acquire(limit=30))
    second = asyncio.create_task(p.acquire(limit=30))
    await asyncio.sleep(0)
    p.release(w, Outcome.SUCCESS)  # wakes `first`...
    first.cancel()                  # ...which leaves before it runs
    assert (await second) is w
    with pytest.raises(asyncio.CancelledError):
        await first
    assert w.inflight == 1


def both_busy(**kwargs: Any) -> tuple[Pool, Worker, Worker]:
    """A pool of A and B, one request at most each, both taken."""
    p = Pool("decode", [A, B], max_inflight_per_worker=1, **kwargs)
    a, b = p.get(A), p.get(B)
    assert a is not None and b is not None
    a.begin()
    b.begin()
    return p, a, b


async def turns(n: int = 5) -> None:
    """Let the loop run what is ready (a woken waiter's next step), with no clock involved."""
    for _ in range(n):
        await asyncio.sleep(0)


async def test_a_freed_worker_wakes_the_oldest_waiter_that_can_take_it() -> None:
    """Both workers busy; a retry that rules A out waits, then a request that takes any. A frees:
    the second gets A at once, the first waits on for B. Before, the first was woken, found
    nothing it could take and queued again: the wake-up was lost, and the second got its 429 at
    the end of its wait while A sat idle."""
    p, a, b = both_busy()
    retry = asyncio.ensure_future(p.acquire(exclude=[a], limit=5.0))
    await turns()
    fresh = asyncio.ensure_future(p.acquire(limit=5.0))
    await turns()
    p.release(a, Outcome.SUCCESS)
    await turns()
    assert fresh.done() and fresh.result() is a
    assert not retry.done()
    p.release(b, Outcome.SUCCESS)
    await turns()
    assert retry.done() and retry.result() is b


async def test_a_waiter_left_with_no_worker_it_may_take_fails_at_once() -> None:
    """A retry that rules A out waits for B; B's circuit opens as it frees (its hop failed).
    The waiter is woken and fails at once (no worker: its caller may fall back to any), not at
    the end of its wait with a 429."""
    p, a, b = both_busy(breaker=BreakerConfig(failure_threshold=1))
    retry = asyncio.ensure_future(p.acquire(exclude=[a], limit=30.0))
    await turns()
    p.release(b, Outcome.FAILURE)  # B's circuit opens
    await turns()
    assert retry.done()
    with pytest.raises(NoWorkerAvailable):
        await retry


def test_panic_routes_to_probe_failed_workers_only_when_all_failed() -> None:
    clock = FakeClock()
    p = Pool("decode", [A, B, C], policy=RoundRobin(), clock=clock, panic=True,
             breaker=BreakerConfig(failure_threshold=1, open_seconds=3))
    a, b, c = p.workers
    a.healthy = b.healthy = False
    assert not p.in_panic and {p.pick().url for _ in range(4)} == {C}  # one healthy: no panic
    c.healthy = False
    assert p.in_panic  # every worker failed its probes: they may only be slow to answer /health
    assert {p.pick().url for _ in range(6)} == {A, B, C}
    b.draining = True
    a.begin()
    p.release(a, Outcome.FAILURE)  # the breaker still ejects
    assert {p.pick().url for _ in range(4)} == {C}
    c.begin()
    p.release(c, Outcome.FAILURE)
    with pytest.raises(NoWorkerAvailable):
        p.pick()
    calm = Pool("decode", [A], panic=False)
    calm.workers[0].healthy = False
    with pytest.raises(NoWorkerAvailable):
        calm.pick()
