"""The latency model's schedule, asserted through an injected clock (no wall-clock timing):
an absolute token cadence that does not accumulate late wake-ups, and a decode worker that pulled
its KV paying transfer + tail compute instead of a prefill."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from tests.fixtures_sim import SimFactory, SimWorker
from tests.sim.helpers import GEN, body, post_json, stream_events, stream_tokens
from tests.sim.test_pd import PROMPT, do_prefill
from workers.sim.engine import Clock, Inflight, TokenCadence
from workers.sim.state import SIM

ITL = 0.010


class FakeClock(Clock):
    """Virtual time: a sleep advances it to the deadline plus a scripted lateness (the timer firing
    late, the loop busy), or not at all when the deadline has passed. Records every sleep."""

    def __init__(self, lateness: list[float] | None = None, default_lateness: float = 0.0004) -> None:
        self.t = 1000.0
        self.lateness = list(lateness or [])
        self.default_lateness = default_lateness
        self.sleeps: list[tuple[float, float]] = []  # (deadline, time when asked)
        self.waits: list[float] = []

    def now(self) -> float:
        return self.t

    async def wait(self, seconds: float) -> None:
        self.waits.append(seconds)
        self.t += seconds

    async def sleep_until(self, req: Inflight, deadline: float) -> bool:
        self.sleeps.append((deadline, self.t))
        if deadline > self.t:
            late = self.lateness.pop(0) if self.lateness else self.default_lateness
            self.t = deadline + late
        return not req.aborted

    sleep_until_exact = sleep_until  # virtual time has no timer resolution to make up for


def with_clock(worker: SimWorker, clock: Clock) -> None:
    worker.app[SIM].clock = clock


async def run_stream(s: aiohttp.ClientSession, w: SimWorker, n: int, **extra: Any) -> list[int]:
    events = await stream_events(
        s, w.url + GEN, body(max_tokens=n, sp={"ignore_eos": True}, stream=True, **extra)
    )
    assert events[-1] == "[DONE]"
    return stream_tokens(events)


# -- the clock and the cadence on their own -------------------------------------------------------


class ScriptedClock(Clock):
    def __init__(self, times: list[float]) -> None:
        self.times = times

    def now(self) -> float:
        return self.times.pop(0)


class RecordingInflight(Inflight):
    def __init__(self) -> None:
        super().__init__("generate-tokens-x", 1)
        self.slept: list[float] = []

    async def sleep(self, seconds: float) -> bool:
        self.slept.append(seconds)
        return not self.aborted


async def test_sleep_until_never_returns_before_the_deadline() -> None:
    # The timer wakes 0.3 ms early (uvloop rounds to whole ms): the rest is slept, then it returns.
    clock = ScriptedClock([0.0, 0.0097, 0.0101])
    req = RecordingInflight()
    assert await clock.sleep_until(req, 0.010)
    assert req.slept == [pytest.approx(0.010), pytest.approx(0.0003)]
    assert clock.times == []


async def test_sleep_until_a_passed_deadline_does_not_sleep_and_abort_wins() -> None:
    req = RecordingInflight()
    assert await ScriptedClock([5.0]).sleep_until(req, 4.0)
    assert req.slept == []
    req.abort()
    assert not await ScriptedClock([5.0]).sleep_until(req, 4.0)
    assert not await ScriptedClock([0.0]).sleep_until(req, 1.0)


async def test_sleep_until_exact_times_all_but_the_last_ms_then_yields_until_due() -> None:
    # No timer for the last millisecond (it would wake up to 1 ms late): the loop is polled instead.
    clock = ScriptedClock([0.0, 0.0492, 0.0497, 0.0499, 0.0500])
    req = RecordingInflight()
    assert await clock.sleep_until_exact(req, 0.050)
    assert req.slept == [pytest.approx(0.049)]
    assert clock.times == []


async def test_sleep_until_exact_stops_polling_on_abort() -> None:
    class AbortingClock(ScriptedClock):
        def now(self) -> float:
            t = super().now()
            if not self.times:
                req.abort()  # aborted while polling the last millisecond
            return t

    req = RecordingInflight()
    assert not await AbortingClock([0.0, 0.0495, 0.0496]).sleep_until_exact(req, 0.050)


def test_cadence_is_absolute_from_the_first_token() -> None:
    c = TokenCadence()
    c.start(100.0)
    late_now = [200.0]  # however late "now" is, a running schedule ignores it
    dues = [c.next(ITL, lambda: late_now[0]) for _ in range(3)]
    assert dues == [pytest.approx(100.0 + k * ITL) for k in (1, 2, 3)]
    c.due = None  # an unpaced step: the next delay starts from now
    assert c.next(ITL, lambda: 50.0) == pytest.approx(50.0 + ITL)


# -- fix 1: the token schedule of a real request ------------------------------------------------


def token_deadlines(clock: FakeClock) -> tuple[float, list[float]]:
    """(first-token time, the deadlines of tokens 1..n-1) from a request's recorded sleeps: the
    first sleep is the prefill, the first token is sent when it ends."""
    (prefill_deadline, _), *tokens = clock.sleeps
    return prefill_deadline, [d for d, _ in tokens]


async def test_itl_does_not_accumulate_late_wakeups(sim_factory: SimFactory) -> None:
    # Each wake-up is 0.4 ms late (what the bench measured): a relative sleep would put token k at
    # k x 10.4 ms; the absolute schedule keeps it at k x 10 ms.
    w = await sim_factory(itl_ms=10.0, prefill_base_ms=50.0, prefill_per_token_ms=0.0)
    clock = FakeClock(default_lateness=0.0004)
    with_clock(w, clock)
    async with aiohttp.ClientSession() as s:
        assert len(await run_stream(s, w, 8)) == 8
    prefill_deadline, dues = token_deadlines(clock)
    t_first = prefill_deadline + 0.0004
    assert len(dues) == 7
    assert dues == [pytest.approx(t_first + k * ITL, abs=1e-9) for k in range(1, 8)]
    # never early: every token is asked to wait for its deadline, from before it
    assert all(asked < due for due, asked in clock.sleeps)


async def test_a_late_token_is_sent_at_once_and_the_schedule_kept(sim_factory: SimFactory) -> None:
    # Token 2 wakes 25 ms late (2.5 intervals): tokens 3 and 4 are already due and go out at once;
    # token 5 is again on the original grid.
    w = await sim_factory(itl_ms=10.0, prefill_base_ms=50.0, prefill_per_token_ms=0.0)
    clock = FakeClock(lateness=[0.0, 0.0, 0.025], default_lateness=0.0)
    with_clock(w, clock)
    async with aiohttp.ClientSession() as s:
        assert len(await run_stream(s, w, 7)) == 7
    t_first, dues = token_deadlines(clock)
    assert dues == [pytest.approx(t_first + k * ITL, abs=1e-9) for k in range(1, 7)]
    behind = [due <= asked for due, asked in clock.sleeps[1:]]
    assert behind == [False, False, True, True, False, False]


class TickingClock(FakeClock):
    """Every reading is 1 us after the previous one (the handler's own work takes time)."""

    def now(self) -> float:
        self.t += 1e-6
        return self.t


async def test_prefill_starts_at_arrival_when_nothing_is_queued(sim_factory: SimFactory) -> None:
    # The headers of the stream go out while the engine prefills (vLLM's frontend and engine core
    # are two processes): the first token is due 50 ms after the request arrived, not after them.
    w = await sim_factory(itl_ms=10.0, prefill_base_ms=50.0, prefill_per_token_ms=0.0)
    clock = TickingClock(default_lateness=0.0)
    with_clock(w, clock)
    arrival = clock.t + 1e-6  # the request's first reading
    async with aiohttp.ClientSession() as s:
        assert len(await run_stream(s, w, 2)) == 2
    prefill_deadline, asked = clock.sleeps[0]
    assert asked > arrival
    assert prefill_deadline == pytest.approx(arrival + 0.050, abs=1e-12)


async def test_the_chunk_delay_fault_is_on_the_schedule(sim_factory: SimFactory) -> None:
    w = await sim_factory(zero_latency=True)
    clock = FakeClock()
    with_clock(w, clock)
    await w.set_faults(chunk_delay_ms=5.0)
    async with aiohttp.ClientSession() as s:
        assert len(await run_stream(s, w, 4)) == 4
    # zero latency: no prefill sleep; the fault delays the first chunk (relative), then 5 ms steps
    (first, asked0), *rest = clock.sleeps
    assert first - asked0 == pytest.approx(0.005)
    t_first = first + 0.0004
    assert [d for d, _ in rest] == [pytest.approx(t_first + k * 0.005, abs=1e-9) for k in (1, 2, 3)]


async def test_zero_latency_never_sleeps(sim_factory: SimFactory) -> None:
    w = await sim_factory(zero_latency=True)
    clock = FakeClock()
    with_clock(w, clock)
    async with aiohttp.ClientSession() as s:
        assert len(await run_stream(s, w, 40)) == 40
    assert clock.sleeps == []


# -- fix 2: a decode worker that pulled the KV ------------------------------------------------


async def pd_pair(
    sim_factory: SimFactory, **decode: Any
) -> tuple[SimWorker, SimWorker, FakeClock, FakeClock]:
    p = await sim_factory(
        role="prefill", prefill_base_ms=0.0, prefill_per_token_ms=0.0, transfer_per_block_ms=2.0
    )
    d = await sim_factory(
        role="decode",
        prefill_base_ms=500.0,
        prefill_per_token_ms=0.5,
        remote_prefill_step_ms=3.0,
        itl_ms=10.0,
        **decode,
    )
    pc, dc = FakeClock(default_lateness=0.0), FakeClock(default_lateness=0.0)
    with_clock(p, pc)
    with_clock(d, dc)
    return p, d, pc, dc


def first_wait(clock: FakeClock) -> float:
    deadline, asked = clock.sleeps[0]
    return deadline - asked


async def test_remote_prefill_costs_transfer_and_tail_not_a_prefill(sim_factory: SimFactory) -> None:
    p, d, pc, dc = await pd_pair(sim_factory)
    async with aiohttp.ClientSession() as s:
        kv = await do_prefill(s, p, "r1")
        assert len(kv["remote_block_ids"][0]) == 3
        st, res = await post_json(
            s, d.url + GEN, body(PROMPT, max_tokens=2, request_id="r1", kv_transfer_params=kv)
        )
        assert st == 200, res
    # transfer: the prefill worker serves the pull at 2 ms per block (3 blocks for 40 tokens)
    assert pc.waits == [pytest.approx(0.006)]
    # then D computes only the last prompt token (all 40 are covered by the pulled blocks):
    # --remote-prefill-step-ms + 1 x --prefill-per-token-ms, and no --prefill-base-ms
    assert first_wait(dc) == pytest.approx((3.0 + 0.5 * 1) / 1000)
    # a prompt as long without a pull is a full prefill on the same worker (another prompt: the
    # pulled blocks are in D's prefix cache now)
    dc.sleeps.clear()
    async with aiohttp.ClientSession() as s:
        st, _ = await post_json(s, d.url + GEN, body([t + 1 for t in PROMPT], max_tokens=2))
        assert st == 200
    assert first_wait(dc) == pytest.approx((500.0 + 0.5 * 40) / 1000)


async def test_tokens_the_pulled_blocks_do_not_cover_are_computed(sim_factory: SimFactory) -> None:
    # D's prompt is P's 40 tokens + 10 more (e.g. a continuation): the 10 are recomputed.
    p, d, _, dc = await pd_pair(sim_factory)
    longer = PROMPT + [400 + i for i in range(10)]
    async with aiohttp.ClientSession() as s:
        kv = await do_prefill(s, p, "r2")
        assert kv["remote_num_tokens"] == 40
        st, res = await post_json(
            s, d.url + GEN, body(longer, max_tokens=2, request_id="r2", kv_transfer_params=kv)
        )
        assert st == 200, res
    assert first_wait(dc) == pytest.approx((3.0 + 0.5 * 10) / 1000)


async def test_fewer_pulled_blocks_leave_a_longer_tail(sim_factory: SimFactory) -> None:
    # Params naming 2 of the 3 blocks cover 32 tokens (block size 16): 8 tokens are computed.
    p, d, _, dc = await pd_pair(sim_factory)
    async with aiohttp.ClientSession() as s:
        kv = await do_prefill(s, p, "r3")
        kv = {**kv, "remote_block_ids": [kv["remote_block_ids"][0][:2]]}
        st, res = await post_json(
            s, d.url + GEN, body(PROMPT, max_tokens=2, request_id="r3", kv_transfer_params=kv)
        )
        assert st == 200, res
    assert first_wait(dc) == pytest.approx((3.0 + 0.5 * 8) / 1000)


async def test_a_failed_pull_charges_nothing(sim_factory: SimFactory) -> None:
    p, d, _, dc = await pd_pair(sim_factory)
    await p.set_faults(refuse_kv_pulls=True)
    async with aiohttp.ClientSession() as s:
        kv = await do_prefill(s, p, "r4")
        st, res = await post_json(
            s, d.url + GEN, body(PROMPT, max_tokens=2, request_id="r4", kv_transfer_params=kv)
        )
    assert st == 500, res
    assert dc.sleeps == []
