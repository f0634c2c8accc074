"""proxy.walk.prefill: the prefill hop (picked, retried on another worker after a backoff, judged),
P's reply accepted under a KV lease, and a migrated stream's continuation; on a Core built from
settings and a recording upstream."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kv_transfer.handoff import PREFILL_REQUEST
from proxy.observe.state import Phase
from proxy.pools import CircuitState, DeadlineExceeded, NoWorkerAvailable, Outcome, PoolSettings, Worker
from proxy.pools.admission import Deadline
from proxy.walk.prefill import Prefill
from proxy.wire.errors import UpstreamProtocolError, UpstreamStatusError, UpstreamTimeout, UpstreamUnavailable
from tests.proxy.conftest import ProxyFactory
from tests.proxy.parts import (
    P_URLS,
    BoundRng,
    Call,
    count,
    decode_reply,
    make_core,
    make_flight,
    worker,
)
from tests.proxy.scripted import KV_PARAMS, Scripted, ScriptedFactory, prefill_reply


def status(code: int, url: str = "p") -> UpstreamStatusError:
    return UpstreamStatusError("prefill", url, code, b'{"error":"x"}', "application/json")


def good(call: Call) -> dict[str, Any]:
    return prefill_reply(call.body)


def no_params(call: Call) -> dict[str, Any]:
    return {**prefill_reply(call.body), "kv_transfer_params": None}


def retries(prefill: Prefill) -> float:
    metrics = prefill.pools.metrics
    assert metrics is not None
    return float(metrics.retries.labels(hop="prefill")._value.get())


def rng(prefill: Prefill) -> BoundRng:
    assert isinstance(prefill.pools.rng, BoundRng)
    return prefill.pools.rng


# ------------------------------------------------------------------ retries


async def test_a_failed_prefill_moves_to_another_worker_after_a_backoff() -> None:
    core, up, _ = make_core(2, pools={"prefill_attempts": 3, "retry_base_delay": 0.02})
    prefill = Prefill(core)
    f = make_flight(core)
    up.script("prefill", status(503))
    w, reply, error = await prefill.with_retries(f)
    first, second = up.to("prefill")
    assert first != second and w is not None and w.url == second and f.record.prefill_worker is w
    assert error is None and reply["kv_transfer_params"] == KV_PARAMS
    assert rng(prefill).bounds == [0.02] and retries(prefill) == 1
    assert all(worker(core, u).inflight == 0 for u in P_URLS)


async def test_a_retry_goes_to_the_untried_worker_even_when_it_is_busier() -> None:
    core, up, _ = make_core(2, pools={"prefill_attempts": 2})
    busy = worker(core, P_URLS[1])
    busy.begin()  # least-loaded would pick the worker that failed again
    up.script("prefill", status(503))
    w, _, error = await Prefill(core).with_retries(make_flight(core))
    assert up.to("prefill") == [P_URLS[0], P_URLS[1]] and w is busy and error is None
    busy.end()
    assert all(worker(core, u).inflight == 0 for u in P_URLS)


async def test_every_attempt_failing_backs_off_longer_and_the_last_error_stands() -> None:
    core, up, _ = make_core(1, pools={"prefill_attempts": 3, "retry_base_delay": 0.02})
    prefill = Prefill(core)
    f = make_flight(core)
    up.script("prefill", status(500), UpstreamUnavailable("prefill", P_URLS[0], "down"), status(503))
    w, reply, error = await prefill.with_retries(f)
    assert up.to("prefill") == [P_URLS[0]] * 3  # every worker failed once: the same one again
    assert isinstance(error, UpstreamStatusError) and error.upstream_status == 503
    assert w is not None and w.url == P_URLS[0] and reply == {}
    assert rng(prefill).bounds == [0.02, 0.04] and retries(prefill) == 2


@pytest.mark.parametrize("error", [status(400), UpstreamProtocolError("prefill", "p", "bad JSON")])
async def test_a_failure_another_worker_would_repeat_is_not_retried(error: Exception) -> None:
    """A 4xx is the client's (``Serving`` answers it as is), a 2xx that is not JSON would repeat."""
    core, up, _ = make_core(2, pools={"prefill_attempts": 3})
    prefill = Prefill(core)
    up.script("prefill", error)
    _, _, last = await prefill.with_retries(make_flight(core))
    assert last is error and len(up.calls) == 1 and rng(prefill).bounds == []


async def test_an_abort_during_a_failed_attempt_ends_the_retries() -> None:
    core, up, _ = make_core(2, pools={"prefill_attempts": 3})
    prefill = Prefill(core)
    f = make_flight(core)

    def aborted_then_503(call: Call) -> Exception:
        core.note_abort(f, "client_call")
        return status(503)

    up.script("prefill", aborted_then_503)
    _, _, error = await prefill.with_retries(f)
    assert isinstance(error, UpstreamStatusError) and len(up.calls) == 1 and retries(prefill) == 0


async def test_an_abort_during_the_backoff_ends_the_retries() -> None:
    core, up, _ = make_core(2, pools={"prefill_attempts": 3})
    prefill = Prefill(core)
    f = make_flight(core)

    class AbortedWhilePausing(BoundRng):
        def uniform(self, a: float, b: float) -> float:
            asyncio.get_running_loop().call_soon(core.note_abort, f, "deadline")
            return 0.0

    core.pools.rng = AbortedWhilePausing()  # type: ignore[assignment]
    up.script("prefill", status(503))
    await prefill.with_retries(f)
    assert len(up.calls) == 1 and f.record.abort_source == "deadline"


async def test_no_retry_when_the_deadline_comes_before_the_pause_ends() -> None:
    core, up, clock = make_core(2, pools={"prefill_attempts": 3, "retry_base_delay": 0.5})
    prefill = Prefill(core)
    pauses: list[float] = []

    class FullPause(BoundRng):
        def uniform(self, a: float, b: float) -> float:
            pauses.append(b)
            return b

    core.pools.rng = FullPause()  # type: ignore[assignment]
    f = make_flight(core)
    f.deadline = Deadline(clock() + 0.4, clock)
    up.script("prefill", UpstreamTimeout("prefill", "p", "timed out"))
    _, _, error = await prefill.with_retries(f)
    assert isinstance(error, UpstreamTimeout) and len(up.calls) == 1 and pauses == [0.5]
    # the prefill's share of the deadline, then the abort grace for P's answer to the abort
    assert up.calls[0].total == pytest.approx(0.2 + core.settings.abort_grace)


async def test_a_hop_past_its_deadline_is_not_sent_and_leaves_no_worker_counted() -> None:
    core, up, clock = make_core(1)
    f = make_flight(core)
    f.deadline = Deadline(clock() - 1.0, clock)
    with pytest.raises(DeadlineExceeded):
        await Prefill(core).with_retries(f)
    assert up.calls == [] and worker(core, P_URLS[0]).inflight == 0


@pytest.mark.parametrize("bypass", [False, True])
async def test_no_prefill_worker_available(bypass: bool) -> None:
    core, up, _ = make_core(1, pools={"bypass_when_prefill_unavailable": bypass})
    worker(core, P_URLS[0]).draining = True
    f = make_flight(core)
    if not bypass:
        with pytest.raises(NoWorkerAvailable):
            await Prefill(core).with_retries(f)
    else:  # the decode worker computes the prompt
        assert await Prefill(core).with_retries(f) == (None, {}, None)
    assert up.calls == [] and f.record.prefill_worker is None


# ------------------------------------------------------------------ P's reply


async def test_a_reply_without_kv_params_goes_to_another_prefill_worker() -> None:
    core, up, _ = make_core(2, pools={"prefill_attempts": 3})
    prefill = Prefill(core)
    up.script("prefill", no_params)
    w, reply, error = await prefill.with_retries(make_flight(core))
    first, second = up.to("prefill")
    assert first != second and w is not None and w.url == second and error is None
    assert reply["kv_transfer_params"] == KV_PARAMS
    assert count(core.metrics.prefill_missing_kv) == 1


async def test_replies_without_kv_params_from_every_worker_are_the_walks_to_judge() -> None:
    """Each prefill worker answered once without usable params: none is asked again."""
    core, up, _ = make_core(2, pools={"prefill_attempts": 3})
    up.script("prefill", no_params, no_params, no_params)
    w, reply, error = await Prefill(core).with_retries(make_flight(core))
    assert sorted(up.to("prefill")) == list(P_URLS)
    assert w is not None and w.url == up.calls[-1].worker and reply["kv_transfer_params"] is None
    assert error is None


async def test_a_reply_without_kv_params_and_no_worker_left_is_decode_only_with_the_bypass() -> None:
    core, up, _ = make_core(1, pools={"prefill_attempts": 3, "bypass_when_prefill_unavailable": True})
    f = make_flight(core)
    up.script("prefill", no_params)
    assert await Prefill(core).with_retries(f) == (None, {}, None)
    assert len(up.calls) == 1 and f.record.prefill_worker is None


async def test_a_reply_without_kv_params_and_nothing_better_is_the_walks_to_judge() -> None:
    core, up, _ = make_core(1, pools={"prefill_attempts": 3})
    up.script("prefill", no_params)
    w, reply, error = await Prefill(core).with_retries(make_flight(core))
    assert w is not None and reply["kv_transfer_params"] is None and error is None
    assert len(up.calls) == 1


@pytest.mark.parametrize(("answer", "outcome"), [
    (good, Outcome.NEUTRAL),  # judged at the hand-off (P may still fail every pull)
    (no_params, Outcome.FAILURE),  # a 200 without usable params is P's failure
    (status(503), Outcome.FAILURE),
    (UpstreamTimeout("prefill", "p", "timed out"), Outcome.FAILURE),
    (status(400), Outcome.NEUTRAL),  # the client's request, not P's fault
])
async def test_what_the_prefill_hop_counts_on_ps_breaker(answer: Any, outcome: Outcome) -> None:
    core, up, _ = make_core(1, pools={"breaker_failures": 1})
    up.script("prefill", answer)
    await Prefill(core).with_retries(make_flight(core))
    p = worker(core, P_URLS[0])
    assert p.inflight == 0
    assert (p.breaker.state is CircuitState.OPEN) == (outcome is Outcome.FAILURE)


async def test_the_prefill_hop_asks_p_to_keep_the_kv_within_its_timeout() -> None:
    core, up, _ = make_core(1, prefill_timeout=7.0, prefill_tokens_only=True)
    f = make_flight(core, rid="abc", sp={"max_tokens": 50, "stop": ["x"], "min_tokens": 3})
    await Prefill(core).with_retries(f)
    call = up.calls[0]
    assert call.request_id == "abc" and call.total == 7.0 + core.settings.abort_grace
    assert call.body["kv_transfer_params"] == PREFILL_REQUEST and call.body["request_id"] == "abc"
    assert call.body["sampling_params"]["max_tokens"] == 1
    assert "stop" not in call.body["sampling_params"]  # a tokens-only prefill pool has no detokenizer


async def test_accepting_ps_reply_holds_the_kv_under_one_lease() -> None:
    core, _, _ = make_core(1)
    prefill = Prefill(core)
    f = make_flight(core)
    p = worker(core, P_URLS[0])
    kv = {**KV_PARAMS, "remote_block_ids": [[1, 2, 3]]}
    params, error = prefill.accept_reply(f, p, prefill_reply({"token_ids": [1], "request_id": "r1"}, kv))
    assert error is None and params == kv and f.record.kv_params == kv
    assert f.record.phase is Phase.KV_HELD and f.kv_blocks == 3
    lease = f.record.lease
    assert lease is not None and lease.worker == p.url and lease.blocks == 3
    assert core.leases.ledger.open_leases() == [lease] and core.leases.ledger.recent_closed() == []
    assert core.metrics.kv_leases_open._value.get() == 1


async def test_a_reply_without_kv_params_is_missing_kv_params() -> None:
    core, _, _ = make_core(1)
    f = make_flight(core)
    reply = {**prefill_reply({"token_ids": [1], "request_id": "r1"}), "kv_transfer_params": None}
    params, error = Prefill(core).accept_reply(f, worker(core, P_URLS[0]), reply)
    assert params is None and isinstance(error, UpstreamProtocolError)
    assert (error.hop, error.worker, error.reason) == ("prefill", P_URLS[0], "kv_transfer_params is null")
    assert f.record.phase is Phase.PREFILLING and f.record.lease is None and core.leases.open_count == 0
    assert count(core.metrics.prefill_missing_kv) == 1


async def test_a_reply_p_ended_as_aborted_aborts_the_request_and_its_kv_is_still_held() -> None:
    """The client's abort reached P another way (another process): aborted here too, source
    ``worker``; KV that came with it is held, for the clean-up to release."""
    core, _, _ = make_core(1)
    f = make_flight(core)
    reply = prefill_reply({"token_ids": [1], "request_id": "r1"})
    reply["choices"][0]["finish_reason"] = "abort"
    params, error = Prefill(core).accept_reply(f, worker(core, P_URLS[0]), reply)
    assert error is None and params == KV_PARAMS and core.leases.open_count == 1
    assert f.record.abort_source == "worker"
    assert count(core.metrics.aborts, source="worker", state="kv_held") == 1


async def test_an_aborted_reply_without_params_is_not_counted_as_ps_fault() -> None:
    core, _, _ = make_core(1)
    f = make_flight(core)
    reply = {**prefill_reply({"token_ids": [1], "request_id": "r1"}), "kv_transfer_params": None}
    reply["choices"][0]["finish_reason"] = "abort"
    _, error = Prefill(core).accept_reply(f, worker(core, P_URLS[0]), reply)
    assert error is not None and f.record.is_aborted
    assert count(core.metrics.prefill_missing_kv) == 0


@pytest.mark.parametrize("choices", [None, [], ["x"], [{"finish_reason": "length"}]])
async def test_only_an_abort_finish_is_a_workers_abort(choices: Any) -> None:
    core, _, _ = make_core(1)
    f = make_flight(core)
    assert not Prefill(core).note_worker_abort(f, {"choices": choices})
    assert not f.record.is_aborted


async def test_prefill_workers_whose_every_pair_failed_the_preflight_are_left_out() -> None:
    core, up, _ = make_core(2, 2, pools={"preflight": True})

    async def check(p: Worker, d: Worker) -> None:
        if p.url == P_URLS[0]:
            raise RuntimeError("no route to the decode worker")

    core.pools.preflight.check = check
    core.pools.preflight.start_all(core.prefill_pool, core.decode_pool)
    await asyncio.gather(*core.pools.preflight._tasks.values())
    prefill = Prefill(core)
    assert prefill.pairless() == [worker(core, P_URLS[0])]
    for i in range(3):
        await prefill.with_retries(make_flight(core, rid=f"r{i}"))
    assert up.to("prefill") == [P_URLS[1]] * 3


# ------------------------------------------------------------------ a continuation's prefill

LONG = list(range(1, 21))


async def test_a_long_continuation_is_prefilled_and_handed_off_under_a_lease() -> None:
    core, up, _ = make_core(1, pools={"migrate_prefill_tokens": 16})
    f = make_flight(core)
    body = {"token_ids": LONG, "sampling_params": {"max_tokens": 5}}
    out = await Prefill(core).continuation(f, body)
    assert out == {**body, "kv_transfer_params": KV_PARAMS}
    assert up.calls[0].body["token_ids"] == LONG and up.calls[0].body["sampling_params"]["max_tokens"] == 1
    assert f.record.prefill_worker is worker(core, P_URLS[0]) and core.leases.open_count == 1
    assert worker(core, P_URLS[0]).inflight == 0


@pytest.mark.parametrize("case", ["short", "aborted", "failed", "no_params", "draining"])
async def test_a_continuation_the_decode_worker_computes_itself(case: str) -> None:
    core, up, _ = make_core(1, pools={"migrate_prefill_tokens": 16, "breaker_failures": 1})
    f = make_flight(core)
    body = {"token_ids": LONG[:10] if case == "short" else LONG, "sampling_params": {"max_tokens": 5}}
    p = worker(core, P_URLS[0])
    if case == "aborted":
        f.abort("client_call")
    if case == "failed":
        up.script("prefill", status(503))
    if case == "no_params":
        up.script("prefill", no_params)
    if case == "draining":
        p.draining = True
    assert await Prefill(core).continuation(f, body) is body
    assert core.leases.open_count == 0 and f.record.prefill_worker is None and p.inflight == 0
    assert len(up.calls) == (1 if case in ("failed", "no_params") else 0)
    if case == "failed":
        assert p.breaker.state is CircuitState.OPEN


@pytest.mark.parametrize("finished", [True, False], ids=["p-finished", "p-aborted"])
async def test_a_continuation_prefill_past_its_timeout_is_aborted_not_cut(finished: bool) -> None:
    """At its timeout the continuation's prefill hop sends P an abort and waits the abort grace:
    P had finished (its answer late) -> its KV is taken under a lease, not left on P; P aborted
    -> the decode worker computes the continuation, P's failure counted."""
    core, up, _ = make_core(1, pools={"migrate_prefill_tokens": 16, "breaker_failures": 1},
                            prefill_timeout=0.05)
    f = make_flight(core)
    body = {"token_ids": LONG, "sampling_params": {"max_tokens": 5}}
    answered: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()

    def on_abort(worker: str, request_ids: list[str]) -> None:  # P answers once it is sent an abort
        reply = prefill_reply({"token_ids": LONG, "request_id": "r1"})
        if not finished:
            reply = {**reply, "kv_transfer_params": None}
            reply["choices"][0]["finish_reason"] = "abort"
        answered.set_result(reply)

    up.on_abort = on_abort
    up.script("prefill", answered)
    out = await asyncio.wait_for(Prefill(core).continuation(f, body), 10)  # bounded: no abort, no answer
    assert up.aborts == [(P_URLS[0], [f.record.engine_id])]
    p = worker(core, P_URLS[0])
    if finished:
        assert out == {**body, "kv_transfer_params": KV_PARAMS}
        assert f.record.prefill_worker is p and core.leases.open_count == 1
    else:
        assert out is body and core.leases.open_count == 0 and f.record.prefill_worker is None
        assert p.breaker.state is CircuitState.OPEN  # a timeout is P's failure
    assert p.inflight == 0


# ------------------------------------------------------------------ the lease counts from the send


async def test_the_lease_expires_counting_from_when_the_prefill_hop_was_sent() -> None:
    """P may start its lease as soon as it has the request: its answer arriving late does not
    lengthen the proxy's lease. Still inside it: held, expiring ``lease_duration`` after the send."""
    core, up, clock = make_core(1, lease_duration=30.0)
    prefill = Prefill(core)
    f = make_flight(core)
    sent = clock()

    def late(call: Call) -> dict[str, Any]:
        clock.advance(20.0)
        return prefill_reply(call.body)

    up.script("prefill", late)
    p, reply, error = await prefill.with_retries(f)
    assert p is not None and error is None
    params, error = prefill.accept_reply(f, p, reply)
    assert params == KV_PARAMS and error is None and core.lease_valid(f)
    lease = f.record.lease
    assert lease is not None and (lease.start, lease.expires) == (sent + 20.0, sent + 30.0)
    clock.advance(10.0)
    assert not core.lease_valid(f)  # 30 s after the send: P's own timer may have freed the KV


async def test_an_answer_later_than_the_lease_is_taken_as_expired() -> None:
    core, up, clock = make_core(1, lease_duration=30.0)
    prefill = Prefill(core)
    f = make_flight(core)

    def too_late(call: Call) -> dict[str, Any]:
        clock.advance(31.0)
        return prefill_reply(call.body)

    up.script("prefill", too_late)
    p, reply, _ = await prefill.with_retries(f)
    assert p is not None
    assert prefill.accept_reply(f, p, reply) == (None, None)
    assert f.record.kv_params is None and not core.lease_valid(f) and core.leases.open_count == 0
    lease = f.record.lease
    assert lease is not None and lease.reason == "expired" and lease.end == lease.start
    assert count(core.metrics.prefill_missing_kv) == 0  # P did its part: no missing params


async def test_each_prefill_attempt_has_its_own_send_time() -> None:
    """A retried prefill on another worker: its lease counts from its own hop, not the first's."""
    core, up, clock = make_core(2, lease_duration=30.0,
                                pools={"prefill_attempts": 2, "retry_base_delay": 0.0})
    prefill = Prefill(core)
    f = make_flight(core)

    def slow_failure(call: Call) -> UpstreamStatusError:
        clock.advance(25.0)
        return status(503)

    up.script("prefill", slow_failure)
    before_retry = clock()
    p, reply, error = await prefill.with_retries(f)
    assert p is not None and error is None and up.to("prefill") == [P_URLS[0], P_URLS[1]]
    params, _ = prefill.accept_reply(f, p, reply)
    assert params == KV_PARAMS and f.record.lease is not None
    assert f.record.lease.expires == before_retry + 25.0 + 30.0


async def test_a_continuation_answered_after_the_lease_is_computed_by_the_decode_worker() -> None:
    core, up, clock = make_core(1, lease_duration=30.0, pools={"migrate_prefill_tokens": 16})
    f = make_flight(core)
    body = {"token_ids": LONG, "sampling_params": {"max_tokens": 5}}

    def too_late(call: Call) -> dict[str, Any]:
        clock.advance(31.0)
        return prefill_reply(call.body)

    up.script("prefill", too_late)
    assert await Prefill(core).continuation(f, body) is body
    assert core.leases.open_count == 0 and f.record.lease is not None
    assert f.record.lease.reason == "expired"


async def test_a_prefill_answer_after_the_lease_goes_decode_only(
        scripted_factory: ScriptedFactory, proxy_factory: ProxyFactory) -> None:
    """P answers after its lease ran out (counted from the hop's send): the proxy sends no decode
    hop with P's params (P may have freed the KV); the request goes decode-only, and the ledger
    closes the lease ``expired`` when the answer came, nothing left open."""
    async def late(body: dict[str, Any], request: Any) -> dict[str, Any]:
        await asyncio.sleep(1.0)
        return prefill_reply(body)

    p: Scripted = await scripted_factory(late)
    d: Scripted = await scripted_factory(lambda b, r: decode_reply(b))
    client, _ = await proxy_factory([p.url], [d.url], lease_duration=0.5, kv_block_size=4)
    r = await client.post("/inference/v1/generate", json={"token_ids": list(range(1, 13)),
                                                           "sampling_params": {"max_tokens": 4}})
    assert r.status == 200 and r.headers["X-PD-Decode-Only"] == "lease_expired"
    assert len(p.received) == 1 and len(d.received) == 1
    assert "kv_transfer_params" not in d.received[0]  # D computes the prompt itself
    ledger = await (await client.get("/debug/kv-leases")).json()
    assert ledger["open"] == []
    (closed,) = ledger["closed"]
    assert closed["reason"] == "expired" and closed["end"] == closed["start"]


async def a_decode_worker_busy_for(seconds: float, scripted_factory: ScriptedFactory,
                                   proxy_factory: ProxyFactory) -> tuple[Scripted, Scripted, Any]:
    """One prefill and one decode worker (cap 1 in flight), a 0.5 s lease; the decode worker's
    first request holds its slot for ``seconds``."""
    busy = asyncio.Event()

    async def slow_first(body: dict[str, Any], request: Any) -> dict[str, Any]:
        if not busy.is_set():
            busy.set()
            await asyncio.sleep(seconds)
        return decode_reply(body)

    p: Scripted = await scripted_factory(lambda b, r: prefill_reply(b))
    d: Scripted = await scripted_factory(slow_first)
    client, _ = await proxy_factory([p.url], [d.url], lease_duration=0.5, kv_block_size=4,
                                    pools=PoolSettings.plain(max_inflight_per_worker=1))
    return p, d, client


async def test_a_decode_hop_that_waited_past_the_lease_goes_decode_only(
        scripted_factory: ScriptedFactory, proxy_factory: ProxyFactory) -> None:
    """The decode pool is at its cap while the request's lease (0.5 s) runs out: when a slot
    frees (~1 s), its decode hop carries no params of P's (P may have freed the KV) and the
    request goes decode-only; the lease is closed ``expired``, nothing left open."""
    p, d, client = await a_decode_worker_busy_for(1.0, scripted_factory, proxy_factory)
    body = {"token_ids": list(range(1, 13)), "sampling_params": {"max_tokens": 4}}
    first = asyncio.ensure_future(client.post("/inference/v1/generate", json=body))
    for _ in range(200):  # the first request holds the decode slot
        if d.received:
            break
        await asyncio.sleep(0.01)
    r = await client.post("/inference/v1/generate", json=body)
    assert r.status == 200 and r.headers["X-PD-Decode-Only"] == "lease_expired"
    assert (await first).status == 200
    assert len(p.received) == 2 and len(d.received) == 2
    assert "kv_transfer_params" in d.received[0] and "kv_transfer_params" not in d.received[1]
    ledger = await (await client.get("/debug/kv-leases")).json()
    assert ledger["open"] == []
    assert sorted(c["reason"] for c in ledger["closed"]) == ["expired", "pulled"]
