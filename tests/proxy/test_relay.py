"""Slow-reader merging: what the client gets always concatenates to what decode sent."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.pools.migration import StreamProgress, token_id_runs
from proxy.sse.events import data_event
from proxy.sse.relay import ByteBudget, StreamBuffer, merge_chunks


def chunk(index: int, toks: list[int], text: str | None, finish: str | None = None,
          lp: bool = False) -> dict[str, Any]:
    c: dict[str, Any] = {"index": index, "finish_reason": finish, "stop_reason": None, "token_ids": toks,
                         "routed_experts": None, "sampling_mask": None,
                         "weight_versions": None if finish is None else [{"version": "default"}]}
    if text is not None:
        c["text"] = text
    c["logprobs"] = {"content": [{"token_id": t, "logprob": -1.0} for t in toks]} if lp else None
    return {"request_id": "generate-tokens-x", "usage": None, "output_mode": "text" if text is not None
            else "tokens", "choices": [c]}


def concat(chunks: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    out: dict[int, dict[str, Any]] = {}
    for ch in chunks:
        for c in ch["choices"]:
            acc = out.setdefault(c["index"], {"token_ids": [], "text": "", "lp": [], "finish": None})
            acc["token_ids"] += c["token_ids"]
            acc["text"] += c.get("text") or ""
            acc["lp"] += (c["logprobs"] or {}).get("content", [])
            if c["finish_reason"] is not None:
                acc["finish"] = (c["finish_reason"], c["stop_reason"])
    return out


chunk_st = st.builds(
    chunk, st.integers(0, 2), st.lists(st.integers(3, 500), max_size=3),
    st.one_of(st.none(), st.text(max_size=4)), st.sampled_from([None, None, "stop", "length", "abort"]),
    st.booleans())


@settings(max_examples=300, deadline=None)
@given(st.lists(chunk_st, min_size=1, max_size=20))
def test_merge_preserves_concatenation(chunks: list[dict[str, Any]]) -> None:
    raws = [json.dumps(c).encode() for c in chunks]
    merged = [json.loads(m) for m in merge_chunks(raws)]
    assert concat(merged) == concat(chunks)
    indexes = [m["choices"][0]["index"] for m in merged]
    assert len(indexes) == len(set(indexes))  # one chunk per choice


def test_merge_keeps_usage_chunk_last_and_errors_after() -> None:
    usage = {"request_id": "r", "usage": {"prompt_tokens": 3, "completion_tokens": 2}, "choices": []}
    err = {"error": {"message": "boom", "type": "x", "param": None, "code": 500}}
    raws = [json.dumps(c).encode() for c in (chunk(0, [5], None), chunk(0, [6], None, "length"), usage)]
    raws.append(json.dumps(err).encode())
    merged = [json.loads(m) for m in merge_chunks(raws)]
    assert merged[0]["choices"][0]["token_ids"] == [5, 6]
    assert merged[0]["choices"][0]["finish_reason"] == "length"
    assert merged[0]["choices"][0]["weight_versions"] == [{"version": "default"}]
    assert merged[1] == usage
    assert merged[2] == err


def test_single_chunk_is_untouched() -> None:
    raw = b'{"choices": [ ], "spacing": "kept"}'
    assert merge_chunks([raw]) == [raw]


async def test_buffer_passes_events_untouched_when_not_lagging() -> None:
    buf = StreamBuffer(max_bytes=10_000)
    datas = [json.dumps(chunk(0, [i], None)).encode() for i in range(3)]
    for d in datas:
        buf.put(data_event(d))
    out, finished = await buf.take(merge=False)
    assert out == [data_event(d) for d in datas]
    assert not finished


async def test_buffer_merges_when_lagging_and_reports_finish() -> None:
    buf = StreamBuffer(max_bytes=10_000)
    for i in range(3):
        d = json.dumps(chunk(0, [i], None, "length" if i == 2 else None)).encode()
        buf.put(data_event(d))
    buf.finish(done=True)
    out, finished = await buf.take(merge=True)
    assert finished and buf.ended_with_done
    assert len(out) == 1
    merged = json.loads(out[0][len(b"data: "):])
    assert merged["choices"][0]["token_ids"] == [0, 1, 2]
    assert merged["choices"][0]["finish_reason"] == "length"


async def test_buffer_cap_closes_it() -> None:
    buf = StreamBuffer(max_bytes=100)
    d = json.dumps(chunk(0, list(range(30)), None)).encode()
    buf.put(data_event(d))
    assert buf.overflowed and buf.closed
    buf.put(data_event(d))  # ignored once closed
    out, finished = await buf.take(merge=True)
    assert finished and len(out) == 1


async def test_take_waits_for_data() -> None:
    buf = StreamBuffer(max_bytes=100)
    task = asyncio.create_task(buf.take(merge=False))
    await asyncio.sleep(0)
    assert not task.done()
    buf.put(b"data: 1\n\n")
    out, _ = await asyncio.wait_for(task, 1)
    assert out == [b"data: 1\n\n"]


# ---------------------------------------------------------------- blocks of events


def sse_block(chunks: list[dict[str, Any]]) -> bytes:
    return b"".join(data_event(json.dumps(c, separators=(",", ":")).encode()) for c in chunks)


single_choice_st = st.builds(
    chunk, st.just(0), st.lists(st.integers(0, 2**31), max_size=4),
    st.one_of(st.none(), st.text(max_size=6)), st.sampled_from([None, "stop", "length"]), st.booleans())


def block_token_ids(body: bytes) -> list[int] | None:
    """The ids ``token_id_runs`` finds in ``body``, parsed as a migration parses them."""
    runs = token_id_runs(body, body.count(b"\n\n"))
    if runs is None:
        return None
    progress = StreamProgress()
    progress.add_runs(runs)
    return progress.generated


@settings(max_examples=300, deadline=None)
@given(st.lists(single_choice_st, min_size=1, max_size=12), st.booleans())
def test_block_token_ids_equal_the_parsed_ones(chunks: list[dict[str, Any]], usage: bool) -> None:
    if usage:
        chunks = [*chunks, {"request_id": "r", "usage": {"completion_tokens": 1}, "choices": []}]
    expected = [t for c in chunks for ch in c["choices"] for t in ch["token_ids"]]
    assert block_token_ids(sse_block(chunks)) == expected


def test_block_token_ids_gives_up_on_anything_unexpected() -> None:
    ok = chunk(0, [1, 2], None)
    assert block_token_ids(sse_block([ok])) == [1, 2]
    no_ids = {"request_id": "r", "choices": [{"index": 0, "text": "x"}]}
    assert block_token_ids(sse_block([ok, no_ids])) is None  # an event without token_ids
    two = {"choices": [{"index": 0, "token_ids": [1]}, {"index": 1, "token_ids": [2]}]}
    assert block_token_ids(sse_block([two])) is None  # two arrays in one event
    for odd in (b"[1.5]", b"[[1]]", b"[-1]", b"[1,,2]", b"[1,]", b"[,1]", b"[1e3]", b"[ 1]", b'["1"]'):
        assert block_token_ids(b'data: {"token_ids":%b}\n\n' % odd) is None, odd  # parsed, never fails
    assert block_token_ids(b'data: {"token_ids":[1, 2]}\n\n') == [1, 2]
    assert block_token_ids(b'data: {"token_ids":[]}\n\n') == []
    # generated text that spells the key is escaped in JSON: not taken for the key
    text = chunk(0, [5], 'x"token_ids":[9]')
    assert block_token_ids(sse_block([text])) == [5]


def test_a_streams_ids_are_parsed_in_order_whichever_way_they_came() -> None:
    progress = StreamProgress()
    progress.add_runs([b"1,2", b""])
    progress.feed({"token_ids": [3]})  # an event read as an event, after the block
    progress.add_runs([b"4"])
    assert progress.generated == [1, 2, 3, 4]
    assert progress.generated == [1, 2, 3, 4]  # parsed once


async def test_buffer_merges_events_inside_one_block_when_lagging() -> None:
    buf = StreamBuffer(max_bytes=10_000)
    buf.put(sse_block([chunk(0, [1], None), chunk(0, [2], None)]))
    buf.put(sse_block([chunk(0, [3], None, "length")]))
    out, finished = await buf.take(merge=True)
    assert not finished and len(out) == 1
    merged = json.loads(out[0][len(b"data: "):])
    assert merged["choices"][0]["token_ids"] == [1, 2, 3]
    assert merged["choices"][0]["finish_reason"] == "length"


async def test_buffer_passes_a_block_untouched_when_not_lagging() -> None:
    buf = StreamBuffer(max_bytes=10_000)
    block = sse_block([chunk(0, [1], None), chunk(0, [2], None)])
    buf.put(block)
    assert await buf.take(merge=False) == ([block], False)


async def test_buffer_cap_counts_block_bytes() -> None:
    buf = StreamBuffer(max_bytes=300)
    buf.put(sse_block([chunk(0, [i], None) for i in range(3)]))
    assert buf.overflowed and buf.closed


# ---------------------------------------------------------------- bytes held for slow clients


def ev(n: int) -> bytes:
    """An SSE event of exactly ``n`` bytes."""
    return b"data: " + b"x" * (n - 8) + b"\n\n"


async def test_stream_cap_counts_the_bytes_being_written() -> None:
    """What was taken for a write that has not returned is still held for the client: the
    cap counts it, and ``sent`` releases it."""
    buf = StreamBuffer(max_bytes=100)
    buf.put(ev(60))
    assert await buf.take(merge=False) == ([ev(60)], False)
    assert buf.held() == 60
    buf.sent()
    assert buf.held() == 0
    buf.put(ev(60))
    await buf.take(merge=False)  # ...and the write does not return: the client is not reading
    buf.put(ev(50))
    assert buf.overflowed == "stream" and buf.closed


async def test_budget_ends_the_stream_holding_the_most() -> None:
    budget = ByteBudget(1000)
    slow, slower, fast = (StreamBuffer(10_000, budget) for _ in range(3))
    slower.put(ev(600))
    slow.put(ev(300))
    fast.put(ev(50))
    assert budget.used == 950 and not any(b.overflowed for b in (slow, slower, fast))
    fast.put(ev(100))  # past the budget: the one holding the most goes, not the last to queue
    assert slower.overflowed == "total" and slower.closed
    assert slow.overflowed is None and fast.overflowed is None
    assert budget.used == 450 and budget.ended == 1
    out, finished = await slower.take(merge=True)
    assert out == [] and finished  # its queued bytes were dropped at once
    slower.put(ev(500))
    assert budget.used == 450  # ended: nothing more is queued or charged
    for b in (slow, slower, fast):
        b.discard()
    assert budget.used == 0 and budget.doomed == 0 and len(budget) == 0


async def test_budget_counts_an_ended_streams_write_until_it_returns() -> None:
    budget = ByteBudget(1000)
    a, b = StreamBuffer(10_000, budget), StreamBuffer(10_000, budget)
    a.put(ev(700))
    await a.take(merge=False)  # being written, the client not reading
    a.put(ev(200))
    b.put(ev(200))  # 1100: ``a`` holds the most
    assert a.overflowed == "total" and b.overflowed is None
    assert budget.used == 900 and budget.doomed == 700  # a's write is still in the transport
    b.put(ev(200))  # 1100 charged, but only 400 by live streams: nobody else is ended
    assert b.overflowed is None
    a.sent()  # its write returned (or the connection was closed)
    assert budget.used == 400 and budget.doomed == 0
    a.discard()
    b.discard()
    assert budget.used == 0


async def test_discard_releases_everything_and_drops_later_puts() -> None:
    budget = ByteBudget(10_000)
    buf = StreamBuffer(10_000, budget)
    buf.put(ev(100))
    await buf.take(merge=False)
    buf.put(ev(100))
    assert budget.used == 200
    buf.discard()
    buf.put(ev(100))  # the producer may still be reading the worker: nothing is kept
    assert budget.used == 0 and buf.held() == 0 and len(budget) == 0
    buf.discard()
    assert budget.used == 0


def test_no_budget_when_total_is_zero() -> None:
    budget = ByteBudget(0)
    buf = StreamBuffer(10_000, budget)
    buf.put(ev(5000))
    assert buf.overflowed is None and budget.used == 5000
    buf.discard()


async def test_a_put_past_the_cap_ends_the_stream_and_wakes_the_writer() -> None:
    buf = StreamBuffer(10)
    waiting = asyncio.create_task(buf.take(merge=False))
    await asyncio.sleep(0)
    assert not waiting.done()
    buf.put(b"data: 12345678\n\n")
    assert buf.overflowed == "stream"
    _, finished = await asyncio.wait_for(waiting, 1)
    assert finished
