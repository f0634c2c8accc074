"""The incremental SSE decoder gives the same events however the bytes are split."""

from __future__ import annotations

from itertools import pairwise

from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.sse import SSEDecoder, SSEEvent
from tests.traces import TRACE_DIR

TRACE = TRACE_DIR / "gen-text-stream-include-usage.txt"

STREAM = (
    b'data: {"a": 1}\n\n'
    b": server-timing queue;dur=0.5, prefill;dur=12.25\n\n"
    b'data: {"b": "\xc3\xa9"}\r\n\r\n'
    b"event: x\rdata: line1\rdata: line2\r\r"
    b"id: 7\n: keep-alive\n\n"
    b"data:no-space\n\n"
    b"data: [DONE]\n\n"
)
EXPECTED = [
    SSEEvent(data='{"a": 1}'),
    SSEEvent(data=None, comment="server-timing queue;dur=0.5, prefill;dur=12.25"),
    SSEEvent(data='{"b": "é"}'),
    SSEEvent(data="line1\nline2"),
    SSEEvent(data=None, comment="keep-alive"),
    SSEEvent(data="no-space"),
    SSEEvent(data="[DONE]"),
]


def feed_all(pieces: list[bytes]) -> list[SSEEvent]:
    dec = SSEDecoder()
    out: list[SSEEvent] = []
    for p in pieces:
        out.extend(dec.feed(p))
    return out


def test_whole_stream() -> None:
    assert feed_all([STREAM]) == EXPECTED


def test_every_two_way_split() -> None:
    for i in range(len(STREAM) + 1):
        assert feed_all([STREAM[:i], STREAM[i:]]) == EXPECTED, i


def test_byte_by_byte() -> None:
    assert feed_all([STREAM[i : i + 1] for i in range(len(STREAM))]) == EXPECTED


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=len(STREAM)), max_size=12))
def test_arbitrary_splits(cuts: list[int]) -> None:
    points = [0, *sorted(cuts), len(STREAM)]
    assert feed_all([STREAM[a:b] for a, b in pairwise(points)]) == EXPECTED


def test_cr_at_chunk_end_then_lf_is_one_line_end() -> None:
    # "\r" ends one chunk, "\n" starts the next: one line end, not an empty line (no early dispatch).
    events = feed_all([b"data: a\r", b"\ndata: b\r", b"\n\r\n"])
    assert events == [SSEEvent(data="a\nb")]


def test_partial_event_is_reported() -> None:
    dec = SSEDecoder()
    assert dec.feed(b'data: {"x"') == []
    assert dec.has_partial
    dec2 = SSEDecoder()
    dec2.feed(b"data: x\n\n")
    assert not dec2.has_partial


def test_real_vllm_trace_body() -> None:
    raw = TRACE.read_bytes()
    head = raw.index(b"transfer-encoding: chunked\n\n") + len(b"transfer-encoding: chunked\n\n")
    body = raw[head : raw.index(b"data: [DONE]\n\n") + len(b"data: [DONE]\n\n")]
    events = feed_all([body[i : i + 7] for i in range(0, len(body), 7)])
    assert [e.data for e in events][-1] == "[DONE]"
    assert len(events) == 5  # three token chunks, the usage chunk, [DONE]
