"""proxy.walk.cleanup: whatever a worker still holds for a request the walk did not finish is freed;
P's KV is released through a one-token decode (retried while P still holds it), and each lease
ends with what the proxy knows of it."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from proxy.observe.state import Phase
from proxy.walk.flight import Flight
from proxy.wire.errors import UpstreamError, UpstreamStatusError, UpstreamTimeout, UpstreamUnavailable
from tests.proxy.parts import (
    D_URLS,
    P_URLS,
    BoundRng,
    Call,
    FakeUpstream,
    Walk,
    decode_reply,
    finished,
    hold,
    make_core,
    make_flight,
    worker,
)
from tests.proxy.scripted import KV_PARAMS, prefill_reply


def status(code: int) -> UpstreamStatusError:
    return UpstreamStatusError("decode", "d", code, b'{"error":{"message":"no"}}', "application/json")


def held(n_decode: int = 1, **settings: Any) -> tuple[Walk, FakeUpstream, Flight, Any]:
    """A request whose KV P holds (KV_HELD, lease open), D chosen: ``D_URLS[0]``."""
    core, up, clock = make_core(1, n_decode, **settings)
    f = make_flight(core)
    hold(core, f, worker(core, P_URLS[0]))
    f.record.decode_worker = worker(core, D_URLS[0])
    return Walk.over(core), up, f, clock


def reason(f: Flight) -> str | None:
    assert f.record.lease is not None
    return f.record.lease.reason


# ------------------------------------------------------------------ release


async def test_a_release_is_a_one_token_decode_with_ps_params_and_ends_the_lease_aborted() -> None:
    walk, up, f, _ = held(decode_timeout=9.0)
    await walk.cleanup.release(f)
    (call,) = up.calls
    assert call.worker == D_URLS[0] and call.is_release and call.total == 9.0
    assert call.body["kv_transfer_params"] == KV_PARAMS and call.body["stream"] is False
    assert reason(f) == "aborted" and f.record.kv_params is None


async def test_a_release_after_a_5xx_goes_to_another_decode_worker_while_the_lease_holds() -> None:
    walk, up, f, _ = held(2, pools={"decode_attempts": 3, "retry_base_delay": 0.02})
    up.script("decode", status(500))
    await walk.cleanup.release(f)
    assert [c.worker for c in up.releases] == [D_URLS[0], D_URLS[1]]
    assert up.releases[0].body == up.releases[1].body  # the same KV, pulled from the same P
    assert f.record.decode_worker is worker(walk.core, D_URLS[1])
    assert isinstance(walk.core.pools.rng, BoundRng) and walk.core.pools.rng.bounds == [0.02]
    assert reason(f) == "aborted"


@pytest.mark.parametrize("error", [status(503), UpstreamTimeout("decode", "d", "timed out"),
                                   UpstreamUnavailable("decode", "d", "down")])
async def test_a_release_failing_every_attempt_ends_the_lease_unknown(error: UpstreamError) -> None:
    walk, up, f, _ = held(1, pools={"decode_attempts": 1})
    up.script("decode", error, error, error)
    await walk.cleanup.release(f)
    assert len(up.releases) == 2  # two attempts at least, even with decode retries off
    assert reason(f) == "unknown"


async def test_a_release_is_not_tried_again_once_ps_lease_ran_out() -> None:
    walk, up, f, clock = held(2, lease_duration=30.0, pools={"decode_attempts": 3})

    def lease_ends_then_500(call: Call) -> Exception:
        clock.advance(31.0)
        return status(500)

    up.script("decode", lease_ends_then_500)
    await walk.cleanup.release(f)
    assert len(up.releases) == 1 and reason(f) == "unknown"


@pytest.mark.parametrize("swept", [False, True], ids=["open", "closed-by-the-sweep"])
async def test_no_release_once_ps_lease_ran_out(swept: bool) -> None:
    """P's lease ran out before the release (P's timer freed the KV): no release hop is sent, and
    the lease ends ``expired`` when it ran out (whether the sweep had closed it or not)."""
    walk, up, f, clock = held(lease_duration=30.0)
    assert f.record.lease is not None
    ends = f.record.lease.expires
    clock.advance(31.0)
    if swept:
        assert walk.core.expire_leases() == 1
    await walk.cleanup.release(f)
    assert up.calls == [] and f.record.kv_params is None
    assert reason(f) == "expired" and f.record.lease.end == ends


async def test_a_release_d_refuses_leaves_the_lease_to_expire() -> None:
    walk, up, f, clock = held(2, lease_duration=30.0, pools={"decode_attempts": 3})
    up.script("decode", status(400))
    await walk.cleanup.release(f)
    assert len(up.releases) == 1 and f.record.kv_params is None
    assert f.record.lease is not None and f.record.lease.end is None  # P frees at its lease's end
    clock.advance(30.0)
    assert walk.core.expire_leases() == 1 and reason(f) == "expired"


async def test_nothing_to_release_without_params() -> None:
    walk, up, f, _ = held()
    walk.core.close_lease(f, "pulled")
    await walk.cleanup.release(f)
    await walk.cleanup.release_shielded(f)
    assert up.calls == [] and f.release_task is None


async def test_a_release_without_a_decode_worker_takes_one() -> None:
    walk, up, f, _ = held(2)
    f.record.decode_worker = None
    await walk.cleanup.release(f)
    assert len(up.releases) == 1 and f.record.decode_worker is not None
    assert up.releases[0].worker == f.record.decode_worker.url and reason(f) == "aborted"


async def test_a_shielded_release_runs_once_and_outlives_its_caller() -> None:
    walk, up, f, _ = held()
    answer: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    up.script("decode", answer)
    caller = asyncio.create_task(walk.cleanup.release_shielded(f))
    await asyncio.wait_for(up.sent(), 5)
    second = asyncio.create_task(walk.cleanup.release_shielded(f))
    await asyncio.sleep(0)
    caller.cancel()  # the client went away
    answer.set_result(decode_reply(up.calls[0].body))
    await asyncio.wait_for(second, 5)
    assert len(up.releases) == 1 and reason(f) == "aborted"


# ------------------------------------------------------------------ after a decode error


async def test_after_ds_4xx_ps_kv_is_released_through_the_same_decode_worker() -> None:
    walk, up, f, _ = held(2)
    walk.cleanup.after_decode_error(f, status(400))
    assert f.release_task is not None
    await f.release_task
    assert [c.worker for c in up.releases] == [D_URLS[0]] and reason(f) == "aborted"


@pytest.mark.parametrize("error", [status(502), UpstreamTimeout("decode", "d", "timed out")])
async def test_after_a_5xx_or_timeout_ps_kv_is_released_through_another_decode_worker(
        error: UpstreamError) -> None:
    walk, up, f, _ = held(2)
    walk.cleanup.after_decode_error(f, error)
    assert f.release_task is not None
    await f.release_task
    assert [c.worker for c in up.releases] == [D_URLS[1]] and reason(f) == "aborted"


async def test_after_a_5xx_with_no_other_decode_worker_the_lease_is_unknown() -> None:
    walk, up, f, _ = held(1)
    walk.cleanup.after_decode_error(f, status(503))
    assert f.release_task is None and reason(f) == "unknown"
    await asyncio.sleep(0)
    assert up.calls == []


async def test_after_a_decode_error_a_running_release_is_not_started_twice() -> None:
    walk, up, f, _ = held(2)
    running = await finished(None)
    f.release_task = running
    walk.cleanup.after_decode_error(f, status(400))
    walk.cleanup.after_decode_error(f, status(503))
    assert f.release_task is running and f.record.decode_worker is worker(walk.core, D_URLS[0])
    await asyncio.sleep(0)
    assert up.calls == []


# ------------------------------------------------------------------ run(): by state


def prefilling(walk: Walk) -> Flight:
    """A request whose prefill hop is out on P."""
    core = walk.core
    f = make_flight(core)
    p = worker(core, P_URLS[0])
    p.begin()
    f.record.prefill_worker = p
    f.prefill_task = walk.prefill._send(f, p)
    return f


@pytest.mark.parametrize("p_answers", ["kv", "no_kv", "error"])
async def test_run_while_prefilling_aborts_p_and_releases_kv_that_still_came(p_answers: str) -> None:
    core, up, _ = make_core(abort_grace=0.01)
    walk = Walk.over(core)
    answer: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    up.script("prefill", answer)

    def p_ends(url: str, ids: list[str]) -> None:
        if url == P_URLS[0] and not answer.done():  # P saw the abort after it finished the prompt
            body = up.calls[0].body
            answer.set_result(prefill_reply(body) if p_answers == "kv" else
                              {**prefill_reply(body), "kv_transfer_params": None} if p_answers == "no_kv"
                              else UpstreamUnavailable("prefill", url, "closed"))

    up.on_abort = p_ends
    f = prefilling(walk)
    await asyncio.wait_for(walk.cleanup.run(f), 5)
    assert up.aborts[0] == (P_URLS[0], [f.record.engine_id])
    if p_answers == "kv":
        assert [c.worker for c in up.releases] == [D_URLS[0]]
        assert [lease.reason for lease in core.leases.ledger.recent_closed()] == ["aborted"]
    else:
        assert up.releases == [] and f.record.lease is None
    assert core.leases.open_count == 0 and f.record.phase is Phase.DONE and len(core.table) == 0


async def test_run_with_kv_held_releases_it_once() -> None:
    walk, up, f, _ = held()
    await walk.cleanup.run(f)
    await walk.cleanup.run(f)  # the release task is kept: nothing is sent twice
    assert len(up.releases) == 1 and reason(f) == "aborted"
    assert f.record.phase is Phase.DONE and len(walk.core.table) == 0


async def decode_task(f: Flight, answer: asyncio.Future[Any]) -> asyncio.Task[Any]:
    """A decode hop as ``FullDecode`` runs it: ``f.settled`` once it ended."""
    async def hop() -> Any:
        try:
            return await answer
        finally:
            f.settled.set()

    task = asyncio.get_running_loop().create_task(hop())
    await asyncio.sleep(0)
    return task


@pytest.mark.parametrize(("d_ends", "lease"), [
    ("answered", "aborted"),  # D answered: it had the KV
    ("failed", "unknown"),  # D's hop failed: whether it pulled is not known
])
async def test_run_while_decoding_aborts_d_until_it_settles(d_ends: str, lease: str) -> None:
    walk, up, f, _ = held(abort_grace=0.01)
    f.record.phase = Phase.DECODING
    answer: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    f.decode_task = await decode_task(f, answer)
    aborts: list[str] = []

    def d_ends_on_the_second_abort(url: str, ids: list[str]) -> None:
        aborts.append(url)
        if len(aborts) == 2:  # the first came before D registered the request: lost
            answer.set_result({"choices": []}) if d_ends == "answered" else \
                answer.set_exception(UpstreamUnavailable("decode", url, "closed"))

    up.on_abort = d_ends_on_the_second_abort
    await asyncio.wait_for(walk.cleanup.run(f), 5)
    assert aborts == [D_URLS[0], D_URLS[0]]
    assert reason(f) == lease and up.releases == []
    assert f.record.phase is Phase.DONE and len(walk.core.table) == 0


async def test_run_after_the_decode_settled_aborts_d_cancels_the_hop_and_the_lease_is_unknown() -> None:
    """D registered the request (``settled``) and still runs it: aborted, its hop cancelled (the
    connection may close now); with no answer seen, whether D pulled is not known."""
    walk, up, f, _ = held()
    f.record.phase = Phase.DECODING
    answer: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    f.decode_task = await decode_task(f, answer)
    f.settled.set()
    await asyncio.wait_for(walk.cleanup.run(f), 5)
    assert up.aborts == [(D_URLS[0], [f.record.engine_id])]
    assert f.decode_task.cancelled() and reason(f) == "unknown"


async def test_run_while_decoding_keeps_a_lease_the_walk_already_closed() -> None:
    walk, _, f, _ = held()
    f.record.phase = Phase.DECODING
    walk.core.close_lease(f, "pulled")
    f.decode_task = await finished(UpstreamUnavailable("decode", D_URLS[0], "closed"))
    f.settled.set()
    await walk.cleanup.run(f)
    assert reason(f) == "pulled"


async def test_run_ends_the_forced_end_and_forgets_the_request() -> None:
    core, up, _ = make_core()
    walk = Walk.over(core)
    f = make_flight(core)  # aborted before any worker took it
    f.force_end = asyncio.get_running_loop().call_later(60, lambda: None)
    handle = f.force_end
    await walk.cleanup.run(f)
    assert handle.cancelled() and f.force_end is None
    assert f.record.phase is Phase.DONE and core.table.entries(f.record.engine_id) == []
    assert up.calls == [] and up.aborts == []
