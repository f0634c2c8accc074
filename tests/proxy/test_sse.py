"""The incremental SSE reader gives the same events for every split of the bytes."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.sse.events import DONE_DATA, DONE_EVENT, Batch, SSEReader, last_data, split_events

STREAM = (
    b'data: {"choices":[{"text":"\xc3\xa9","token_ids":[1]}]}\n\n'
    b": a comment\n\n"
    b'data: {"a":1}\n\n'
    b"data: line1\ndata: line2\n\n"
    b"event: x\ndata:nospace\n\n"
    b"data: [DONE]\n\n"
)
EXPECTED = [b'{"choices":[{"text":"\xc3\xa9","token_ids":[1]}]}', b'{"a":1}', b"line1\nline2",
            b"nospace", b"[DONE]"]


def read_all(parts: list[bytes]) -> tuple[list[bytes], list[bytes], bytes]:
    r = SSEReader()
    datas, raws = [], []
    for p in parts:
        for ev in r.feed(p):
            datas.append(ev.data)
            raws.append(ev.raw)
    return datas, raws, r.pending


def split_at(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({0, len(data), *(c % (len(data) + 1) for c in cuts)})
    return [data[a:b] for a, b in itertools.pairwise(points)]


def test_whole_stream() -> None:
    datas, raws, pending = read_all([STREAM])
    assert datas == EXPECTED
    assert raws[0] == b'data: {"choices":[{"text":"\xc3\xa9","token_ids":[1]}]}\n\n'
    assert pending == b""


def test_every_single_cut() -> None:
    for i in range(len(STREAM) + 1):
        assert read_all([STREAM[:i], STREAM[i:]])[0] == EXPECTED, i


def test_byte_by_byte() -> None:
    assert read_all([STREAM[i : i + 1] for i in range(len(STREAM))])[0] == EXPECTED


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=10_000), max_size=40))
def test_any_split(cuts: list[int]) -> None:
    assert read_all(split_at(STREAM, cuts))[0] == EXPECTED


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=10_000), max_size=40))
def test_crlf_any_split(cuts: list[int]) -> None:
    crlf = STREAM.replace(b"\n", b"\r\n")
    assert read_all(split_at(crlf, cuts))[0] == EXPECTED


def test_truncated_stream_leaves_pending_bytes() -> None:
    datas, _, pending = read_all([b'data: {"a":1}\n\ndata: {"b"'])
    assert datas == [b'{"a":1}']
    assert pending == b'data: {"b"'


# ---------------------------------------------------------------- the relay's block path

PLAIN = b'data: {"choices":[{"index":0,"token_ids":[7]}]}\n\n'
EVENTS = [
    PLAIN,
    b'data: {"choices":[{"index":0,"text":"a\\n\\nb","token_ids":[8]}]}\n\n',
    b": keep-alive comment\n\n",
    b"data: line1\ndata: line2\n\n",
    b"data:nospace\n\n",
    b'data: {"error":{"message":"boom","code":500}}\n\n',
    b"\n\n",
    b"event: x\ndata: y\n\n",
]


def batch_events(parts: list[bytes]) -> tuple[list[tuple[bytes, bytes]], list[Batch]]:
    r = SSEReader()
    out: list[tuple[bytes, bytes]] = []
    batches: list[Batch] = []
    for p in parts:
        b = r.feed_batch(p)
        batches.append(b)
        out.extend((e.raw, e.data) for e in b.events())
    return out, batches


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(range(len(EVENTS))), max_size=12), st.booleans(),
       st.lists(st.integers(min_value=0, max_value=10_000), max_size=12), st.booleans())
def test_feed_batch_gives_the_events_of_a_whole_parse(kinds: list[int], done: bool, cuts: list[int],
                                                      crlf: bool) -> None:
    stream = b"".join(EVENTS[k] for k in kinds) + (DONE_EVENT if done else b"")
    if crlf:
        stream = stream.replace(b"\n", b"\r\n")
    whole = [(e.raw, e.data) for e in split_events(stream.replace(b"\r\n", b"\n"))]
    got, batches = batch_events(split_at(stream, cuts))
    assert got == whole
    for b in batches:
        if b.plain:
            # plain: single-line data events only, no error, [DONE] only as the last event
            evs = split_events(b.body)
            assert all(e.raw.count(b"\n") == 2 and e.raw.startswith(b"data: ") for e in evs)
            assert not any(e.data.startswith(b'{"error"') or e.data == DONE_DATA for e in evs)
            assert b.body + (DONE_EVENT if b.done else b"") == b.raw
            assert len(evs) + b.done == len(b.events())


def test_plain_reads_are_one_block_and_done_is_seen() -> None:
    r = SSEReader()
    b = r.feed_batch(PLAIN * 3)
    assert b.plain and not b.done and b.body == PLAIN * 3
    b = r.feed_batch(PLAIN + DONE_EVENT)
    assert b.plain and b.done and b.body == PLAIN
    assert last_data(b.body) == PLAIN[6:-2]
    assert last_data(PLAIN + b"data: {}\n\n") == b"{}"
    assert last_data(b"") == b""


def test_error_comment_or_early_done_leave_the_block_path() -> None:
    for raw in (PLAIN + EVENTS[5], PLAIN + EVENTS[2], PLAIN + DONE_EVENT + PLAIN, EVENTS[3],
                b"data:[DONE]\n\n"):
        assert not SSEReader().feed_batch(raw).plain, raw


def test_partial_event_stays_pending() -> None:
    r = SSEReader()
    b = r.feed_batch(PLAIN + PLAIN[:10])
    assert b.plain and b.body == PLAIN and r.pending == PLAIN[:10]
    b = r.feed_batch(PLAIN[10:])
    assert b.body == PLAIN and r.pending == b""


def test_split_first_gives_the_first_event_and_the_rest_as_plain_batches() -> None:
    a, b, c = b'data: {"a":1}\n\n', b'data: {"b":2}\n\n', b'data: {"c":3}\n\n'
    for done in (False, True):
        raw = a + b + c + (DONE_EVENT if done else b"")
        parts = Batch(raw, plain=True, done=done).split_first()
        assert parts is not None
        first, rest = parts
        assert (first.raw, first.body, first.done, first.plain) == (a, a, False, True)
        assert (rest.raw, rest.body, rest.done, rest.plain) == (b + c + (DONE_EVENT if done else b""),
                                                                 b + c, done, True)
        assert first.events() + rest.events() == SSEReader().feed(raw)
    assert Batch(a, plain=True).split_first() is None  # one event: nothing to split
    assert Batch(a + DONE_EVENT, plain=True, done=True).split_first() is None
    assert Batch(b"", plain=True).split_first() is None
    assert Batch(a + b"event: x\n" + b, plain=False).split_first() is None  # read event by event
