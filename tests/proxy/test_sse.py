"""The incremental SSE reader gives the same events for every split of the bytes."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.sse import SSEReader

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
