"""proxy.observe.state: a request's record (its phase, who holds it, its abort; changed by
``proxy.walk.flight.Flight``, ``test_flight``), the table of requests in
flight (several may share an id, as vLLM allows) and the app's background tasks."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from proxy.observe.state import Phase, RequestRecord, RequestTable, TaskTracker, outlive
from proxy.pools import Worker

P = Worker("http://127.0.0.1:9101", "prefill")
D = Worker("http://127.0.0.1:9201", "decode")


@pytest.mark.parametrize(("phase", "holders"), [
    (Phase.PREFILLING, [P]),  # P computes the prompt
    (Phase.KV_HELD, [P]),  # P keeps the blocks under its lease
    (Phase.DECODING, [D]),
    (Phase.DONE, []),
])
def test_who_holds_a_request_follows_its_phase(phase: Phase, holders: list[Worker]) -> None:
    record = RequestRecord("r", "generate-tokens-r", stream=True, phase=phase, prefill_worker=P,
                           decode_worker=D)
    assert record.holders() == holders
    view = record.as_dict()
    assert view["state"] == phase.value and view["holders"] == [w.url for w in holders]
    assert (view["prefill_worker"], view["decode_worker"], view["aborted"]) == (P.url, D.url, None)


def test_a_record_with_no_worker_yet_is_held_by_nobody() -> None:
    assert RequestRecord("r", "generate-tokens-r", stream=False).holders() == []


@dataclass(eq=False)
class Entry:
    record: RequestRecord


def entry(engine_id: str) -> Entry:
    return Entry(RequestRecord(engine_id.removeprefix("generate-tokens-"), engine_id, stream=False))


def test_requests_sharing_an_id_are_each_kept_and_removed_alone() -> None:
    table: RequestTable[Entry] = RequestTable()
    a, b, other = entry("generate-tokens-x"), entry("generate-tokens-x"), entry("generate-tokens-y")
    for e in (a, b, other):
        table.add(e)
    assert table.entries("generate-tokens-x") == [a, b] and len(table) == 3
    assert table.get("generate-tokens-x") == [a.record, b.record]
    table.remove(a)
    table.remove(a)  # removing twice is harmless
    assert table.entries("generate-tokens-x") == [b] and len(table) == 2
    table.remove(b)
    assert table.entries("generate-tokens-x") == [] and table.all() == [other.record]
    assert table.all_entries() == [other]


def test_the_table_gives_copies() -> None:
    table: RequestTable[Entry] = RequestTable()
    a = entry("generate-tokens-x")
    table.add(a)
    table.entries("generate-tokens-x").clear()
    assert table.entries("generate-tokens-x") == [a]


async def test_background_tasks_are_tracked_until_they_end() -> None:
    tracker = TaskTracker()
    gate = asyncio.Event()
    waiting = tracker.spawn(gate.wait(), name="waits")
    quick = tracker.spawn(asyncio.sleep(0))
    assert len(tracker) == 2 and waiting.get_name() == "waits"
    await quick
    await asyncio.sleep(0)
    assert len(tracker) == 1
    await asyncio.wait_for(tracker.wait(0.01), 5)  # bounded: the waiting task is still there
    assert not waiting.done()
    gate.set()
    await tracker.wait(5)
    assert waiting.done() and len(tracker) == 0


async def test_cancel_all_ends_every_tracked_task() -> None:
    tracker = TaskTracker()
    tasks = [tracker.spawn(asyncio.Event().wait()) for _ in range(3)]
    tracker.cancel_all()
    await asyncio.gather(*tasks, return_exceptions=True)
    assert all(t.cancelled() for t in tasks) and len(tracker) == 0


async def test_outlive_gives_the_result_and_a_cancelled_caller_leaves_the_task_running() -> None:
    """What the walk relies on for the prefill hop (``asyncio.shield``'s promise): a client that
    goes away cancels the handler, not the hop."""
    go = asyncio.Event()

    async def hop(fail: bool) -> str:
        await go.wait()
        if fail:
            raise ValueError("refused")
        return "reply"

    ok, failing = asyncio.ensure_future(hop(False)), asyncio.ensure_future(hop(True))
    caller = asyncio.ensure_future(outlive(ok))
    await asyncio.sleep(0)
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert not ok.done()
    go.set()
    assert await outlive(ok) == "reply"
    with pytest.raises(ValueError, match="refused"):
        await outlive(failing)
    cancelled = asyncio.ensure_future(asyncio.sleep(10))
    waiting = asyncio.ensure_future(outlive(cancelled))
    await asyncio.sleep(0)
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
