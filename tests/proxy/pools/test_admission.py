from __future__ import annotations

import asyncio

import pytest

from proxy.pools.admission import Admission, Deadline, hop_budget
from proxy.pools.errors import DeadlineExceeded, Overloaded
from proxy.wire.errors import InvalidRequest
from tests.proxy.pools.helpers import FakeClock


async def test_admission_limit_queue_and_fifo() -> None:
    adm = Admission(2, max_queue=2, queue_timeout=30)
    await adm.acquire()
    await adm.acquire()
    order: list[str] = []

    async def enter(name: str) -> None:
        await adm.acquire()
        order.append(name)

    t1 = asyncio.create_task(enter("first"))
    await asyncio.sleep(0)
    t2 = asyncio.create_task(enter("second"))
    await asyncio.sleep(0)
    with pytest.raises(Overloaded) as e:
        await adm.acquire()
    assert e.value.reason == "queue_full"
    assert adm.queue.rejected_full == 1
    adm.release()
    await t1
    adm.release()
    await t2
    assert order == ["first", "second"] and adm.inflight == 2


async def test_admission_timeout_and_unlimited() -> None:
    adm = Admission(1, max_queue=5, queue_timeout=30)
    await adm.acquire()
    with pytest.raises(Overloaded) as e:
        await adm.acquire(limit=0.01)
    assert e.value.reason == "queue_timeout" and adm.queue.rejected_timeout == 1
    assert len(adm.queue) == 0
    free = Admission(None)
    for _ in range(100):
        await free.acquire()
    assert free.inflight == 100


async def test_admission_zero_queue_rejects_at_once() -> None:
    adm = Admission(1, max_queue=0)
    await adm.acquire()
    with pytest.raises(Overloaded):
        await adm.acquire()


def test_deadline_header_default_and_bad_values() -> None:
    clock = FakeClock()
    d = Deadline.from_header("1500", default_ms=None, clock=clock)
    assert d is not None and d.remaining() == pytest.approx(1.5)
    assert Deadline.from_header(None, default_ms=None, clock=clock) is None
    dflt = Deadline.from_header(None, default_ms=200, clock=clock)
    assert dflt is not None and dflt.remaining() == pytest.approx(0.2)
    capped = Deadline.from_header("999999", default_ms=None, clock=clock, max_ms=1000)
    assert capped is not None and capped.remaining() == pytest.approx(1.0)
    for bad in ("abc", "-5", "0", "nan", "inf"):
        with pytest.raises(InvalidRequest) as e:
            Deadline.from_header(bad, default_ms=None, clock=clock)
        assert e.value.status == 400 and e.value.param == "X-PD-Deadline-Ms"


def test_deadline_split_across_hops() -> None:
    clock = FakeClock()
    d = Deadline(clock() + 10.0, clock)
    assert d.budget("prefill", cap=30.0, share=0.5) == pytest.approx(5.0)
    assert d.budget("prefill", cap=2.0, share=0.5) == pytest.approx(2.0)
    clock.advance(4.0)
    assert hop_budget(d, "decode", cap=60.0) == pytest.approx(6.0)
    assert hop_budget(None, "decode", cap=60.0) == 60.0
    clock.advance(6.0)
    assert d.expired
    with pytest.raises(DeadlineExceeded) as e:
        d.check("decode")
    assert e.value.status == 504 and "decode" in e.value.message
    with pytest.raises(ValueError):
        Deadline(clock() + 1, clock).budget("x", None, share=0)
