"""One hop connection's answer parser (``proxy.upstream.hop_wire``): strict framing through the client
against scripted servers, and the parser alone, fed byte by byte and in odd splits."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterable, Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.upstream.hop_answer import AnswerLimits, HopTooLarge
from proxy.upstream.hop_wire import HopConnection, HopDisconnected, HopProtocolError, parse_origin
from tests.proxy.hop_servers import chunked, post, serving, until

_CHUNKED = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
_TAIL = b"{}\r\n0\r\n\r\n"
"""A chunk of 2 bytes once its size line is given, then the last chunk."""


@pytest.mark.parametrize("answer", [
    b"SPDY/3 200 OK\r\n\r\n",
    b"HTTP/1.1 abc OK\r\n\r\n",
    b"HTTP/1.1 +200 OK\r\nContent-Length: 2\r\n\r\n{}",
    _CHUNKED + b"zz\r\n",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n",
    _CHUNKED + b"2\r\nabc\r\n0\r\n\r\n",
    # Content-Length: plain ASCII digits, at most 18 of them, one value.
    b"HTTP/1.1 200 OK\r\nContent-Length: +2\r\n\r\n{}",
    b"HTTP/1.1 200 OK\r\nContent-Length: 2 2\r\n\r\n{}",
    b"HTTP/1.1 200 OK\r\nContent-Length: 2, 2\r\n\r\n{}",
    b"HTTP/1.1 200 OK\r\nContent-Length: \xb2\r\n\r\n{}",  # a latin-1 superscript two
    b"HTTP/1.1 200 OK\r\nContent-Length: " + b"0" * 5000 + b"2\r\n\r\n{}",
    b"HTTP/1.1 200 OK\r\nContent-Length: " + b"1" * 19 + b"\r\n\r\n{}",
    b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}x",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n" + b"2\r\n" + _TAIL,
    # Chunk sizes: 1 to 16 hex digits, no sign, prefix, separator or stray whitespace.
    _CHUNKED + b"+2\r\n" + _TAIL,
    _CHUNKED + b" 2\r\n" + _TAIL,
    _CHUNKED + b"2 \r\n" + _TAIL,
    _CHUNKED + b"0x2\r\n" + _TAIL,
    _CHUNKED + b"0_2\r\n" + _TAIL,
    _CHUNKED + b"\xb2\r\n" + _TAIL,
    _CHUNKED + b"0" * 16 + b"2\r\n" + _TAIL,
    _CHUNKED + b"-0\r\n\r\n",
])
async def test_a_broken_answer_is_a_protocol_error_and_its_connection_is_closed(answer: bytes) -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        await server.request(r)
        w.write(answer)
        await w.drain()
        await r.read()
        server.closed_by_client.append(n)

    async with serving(handler) as (server, url, client):
        with pytest.raises(HopProtocolError) as e:
            await post(client, url)
        assert not isinstance(e.value, HopDisconnected)
        assert client.counts() == {"in_use": 0, "idle": 0}
        await until(lambda: bool(server.closed_by_client))
        assert server.closed_by_client == [0]


@pytest.mark.parametrize("size_line", [b"2", b"02", b"0000000000000002", b"2;ext", b"2 ;a=b",
                                       b'2\t; a="x;y" ;b', b"2;"])
async def test_chunk_extensions_are_tolerated(size_line: bytes) -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        while await server.request(r):
            w.write(_CHUNKED + size_line + b"\r\n{}\r\n0;end\r\n\r\n")
            await w.drain()

    async with serving(handler) as (server, url, client):
        assert await post(client, url) == (200, b"{}")
        assert await post(client, url) == (200, b"{}")
        assert server.connections == 1


async def test_an_answer_with_both_transfer_encoding_and_content_length_is_chunked_and_not_reused() -> None:
    """RFC 9112 6.3: Transfer-Encoding overrides Content-Length, and such a message may be an
    attempt at request smuggling: read as chunked, and its connection is closed afterwards."""
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        while await server.request(r):
            w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n"
                    b"4\r\nabcd\r\n0\r\n\r\n")
            await w.drain()
        server.closed_by_client.append(n)

    async with serving(handler) as (server, url, client):
        assert await post(client, url) == (200, b"abcd")
        assert client.counts() == {"in_use": 0, "idle": 0}
        await until(lambda: bool(server.closed_by_client))
        assert server.closed_by_client == [0]
        assert await post(client, url) == (200, b"abcd")
        assert server.connections == 2


@pytest.mark.parametrize(("url", "key", "host", "path"), [
    ("http://127.0.0.1:8000", "http://127.0.0.1:8000", b"127.0.0.1:8000", ""),
    ("http://[::1]:9/", "http://[::1]:9", b"[::1]:9", ""),
    ("https://w.example/v", "https://w.example:443", b"w.example", "/v"),
])
def test_origins(url: str, key: str, host: bytes, path: str) -> None:
    o = parse_origin(url)
    assert (o.key, o.host_header, o.base_path) == (key, host, path)


class _Transport:
    def __init__(self) -> None:
        self.paused = False
        self.closing = False

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False

    def close(self) -> None:
        self.closing = True

    def is_closing(self) -> bool:
        return self.closing

    def get_extra_info(self, name: str) -> None:
        return None


@settings(max_examples=200, deadline=None)
@given(parts=st.lists(st.binary(min_size=1, max_size=40), min_size=1, max_size=8),
       cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=12),
       extension=st.booleans())
def test_the_parser_gives_the_same_body_however_the_bytes_are_split(
        parts: list[bytes], cuts: list[int], extension: bool) -> None:
    wire = chunked(*parts)
    if extension:
        wire = wire[:-5] + b"0;ext=1\r\nTrailer: x\r\n\r\n"  # the last chunk with both
    loop = asyncio.new_event_loop()
    try:
        conn = HopConnection(loop, parse_origin("http://127.0.0.1:1"))
        conn.connection_made(_Transport())  # type: ignore[arg-type]
        conn.begin()
        points = sorted({c % len(wire) for c in cuts} | {0, len(wire)})
        body = b""
        for a, b in itertools.pairwise(points):
            conn.data_received(wire[a:b])
            body += conn.take()
        assert conn.head is not None and conn.head[0] == 200
        assert body == b"".join(parts)
        assert conn.finished and conn.reusable
    finally:
        loop.close()


Parsed = tuple[int | None, bytes, bool, bool, BaseException | None]
"""What the parser made of an answer: its status, its body, whether it ended, whether the
connection may carry the next request, and the error it stopped at."""


def parse(pieces: Iterable[bytes], *, close: bool = False, limits: AnswerLimits | None = None,
          stream: bool = False) -> Parsed:
    """Feed ``pieces`` to a fresh connection (as reads), the body taken after each; ``close``:
    then the worker closes the connection."""
    loop = asyncio.new_event_loop()
    try:
        conn = HopConnection(loop, parse_origin("http://127.0.0.1:1"), limits)
        conn.connection_made(_Transport())  # type: ignore[arg-type]
        conn.begin(stream=stream)
        body = b""
        for piece in pieces:
            conn.data_received(piece)
            body += conn.take()
            if conn.error is not None:
                break  # the transport is closed: nothing more arrives
        if close:
            conn.connection_lost(None)
        return (conn.head[0] if conn.head else None), body, conn.finished, conn.reusable, conn.error
    finally:
        loop.close()


def splits(wire: bytes) -> Iterator[list[bytes]]:
    """The answer whole, byte by byte, cut once at every point, and cut twice close together (a
    CRLF, a size line or a short chunk across three reads)."""
    yield [wire]
    yield [wire[i:i + 1] for i in range(len(wire))]
    for i in range(1, len(wire)):
        yield [wire[:i], wire[i:]]
        for k in (1, 2, 3, 5):
            if i + k < len(wire):
                yield [wire[:i], wire[i:i + k], wire[i + k:]]


_EVENTS = [b'data: {"t":[1]}\n\n', b'data: {"t":[22]}\n\n', b"data: [DONE]\n\n"]
_LONG = bytes(range(256)) + b"\r\n0\r\n" * 8
"""A chunk longer than a read's cut, with CRLFs and what looks like a last chunk inside it."""
_ANSWERS = {
    "length": (b"HTTP/1.1 200 OK\r\nContent-Length: 13\r\n\r\n{\"a\":\"\r\n\r\n0\"}",
               b'{"a":"\r\n\r\n0"}', True),
    "length zero": (b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n", b"", True),
    "chunked events": (chunked(*_EVENTS), b"".join(_EVENTS), True),
    "chunked, extensions and a trailer": (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2;a=b\r\n{}\r\nA ;x\r\n0123456789\r\n"
        b"0;end\r\nX-Trailer: 1\r\nY: 2\r\n\r\n", b"{}0123456789", True),
    "a long chunk": (chunked(_LONG, b"x"), _LONG + b"x", True),
    "an interim answer first": (b"HTTP/1.1 100 Continue\r\n\r\n"
                                b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}", b"{}", True),
    "no content": (b"HTTP/1.1 204 No Content\r\n\r\n", b"", True),
    "chunked and a length": (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n"
                             b"4\r\nabcd\r\n0\r\n\r\n", b"abcd", False),
    "HTTP/1.0": (b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\n{}", b"{}", False),
    "connection close": (b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\n{}",
                         b"{}", False),
}


@pytest.mark.parametrize("name", list(_ANSWERS))
def test_an_answer_is_parsed_the_same_however_its_reads_are_cut(name: str) -> None:
    """Content-Length, chunked (events, extensions, trailers, a chunk longer than a read), an
    interim answer, no body: the same status, body and reuse for any cut of the reads."""
    wire, body, reusable = _ANSWERS[name]
    for pieces in splits(wire):
        assert parse(pieces) == (200 if name != "no content" else 204, body, True, reusable, None), pieces


def test_a_body_until_the_connection_ends_is_whole_only_at_the_end() -> None:
    wire = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n{\"x\":\"\r\n0\r\n\r\n\"}"
    for pieces in splits(wire):
        assert parse(pieces) == (200, b'{"x":"\r\n0\r\n\r\n"}', False, False, None)
        assert parse(pieces, close=True) == (200, b'{"x":"\r\n0\r\n\r\n"}', True, False, None)


@pytest.mark.parametrize("wire", [
    b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}",
    chunked(b"{}"),
])
def test_bytes_past_the_answer_keep_the_connection_from_being_reused(wire: bytes) -> None:
    for extra in (b"H", b"HTTP/1.1 200 OK\r\n\r\n"):
        assert parse([wire + extra]) == (200, b"{}", True, False, None)  # in the same read
        assert parse([wire, extra]) == (200, b"{}", True, False, None)  # in a read of its own


@pytest.mark.parametrize("wire", [
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nabc\r\n0\r\n\r\n",  # data past its size
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n+1\r\nx\r\n0\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}x\r\n0\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nContent-Length: 0x2\r\n\r\n{}",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n",
    b"HTTP/1.1 2000 OK\r\n\r\n",
])
def test_a_broken_answer_is_a_protocol_error_however_its_reads_are_cut(wire: bytes) -> None:
    for pieces in splits(wire):
        *_, reusable, error = parse(pieces)
        assert isinstance(error, HopProtocolError) and not isinstance(error, HopDisconnected), pieces
        assert not reusable


@pytest.mark.parametrize(("line", "fails"), [(b"2;" + b"e" * 4000, False), (b"2;" + b"e" * 5000, True)])
def test_a_chunk_line_may_not_grow_past_4_kib_over_many_reads(line: bytes, fails: bool) -> None:
    wire = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + line + b"\r\n{}\r\n0\r\n\r\n"
    cut = [wire[i:i + 100] for i in range(0, len(wire), 100)]
    status, body, finished, _, error = parse(cut)
    if fails:
        assert isinstance(error, HopProtocolError) and "4 KiB" in str(error)
    else:
        assert (status, body, finished, error) == (200, b"{}", True, None)


def test_headers_may_not_grow_past_64_kib_over_many_reads() -> None:
    head = b"HTTP/1.1 200 OK\r\n" + b"X-Pad: " + b"p" * (70 << 10)
    *_, error = parse([head[i:i + 4096] for i in range(0, len(head), 4096)])
    assert isinstance(error, HopTooLarge) and error.part == "head" and error.limit == 64 << 10


@pytest.mark.parametrize("wire", [
    b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n{}",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\nX: 1\r\n",
    b"HTTP/1.1 200 OK\r\nContent-Le",
])
def test_an_answer_cut_short_by_the_worker_is_a_disconnect(wire: bytes) -> None:
    for pieces in splits(wire):
        *_, finished, reusable, error = parse(pieces, close=True)
        assert isinstance(error, HopDisconnected) and not finished and not reusable, pieces


def _waiting(loop: asyncio.AbstractEventLoop) -> HopConnection:
    """A connection whose request went out: waits for its answer."""
    conn = HopConnection(loop, parse_origin("http://127.0.0.1:1"))
    conn.connection_made(_Transport())  # type: ignore[arg-type]
    conn.begin()
    return conn


async def test_the_waits_of_a_connection_share_one_timer(monkeypatch: pytest.MonkeyPatch) -> None:
    """A wait whose end is not before the armed timer's arms none: one timer for the waits of a
    hop (and of the hops after it on the connection), not one per wait."""
    loop = asyncio.get_running_loop()
    armed: list[float] = []
    call_at = loop.call_at

    def counting(when: float, *args: object, **kwargs: object) -> asyncio.TimerHandle:
        armed.append(when)
        return call_at(when, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(loop, "call_at", counting)
    conn = _waiting(loop)
    head = b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\n"
    for i, piece in enumerate((head[:10], head[10:], b"{", b"}", b" ")):
        wait = asyncio.ensure_future(conn.wait(loop.time() + 30 + i))
        await asyncio.sleep(0)
        conn.data_received(piece)
        await wait
    assert conn.finished and conn.take() == b"{} "
    assert len(armed) == 1
    conn.close()


async def _second_wait(first_s: float, second_s: float) -> tuple[HopConnection, asyncio.Future[None]]:
    """A connection whose first wait (``first_s`` long) ended with bytes, and its second wait."""
    loop = asyncio.get_running_loop()
    conn = _waiting(loop)
    first = asyncio.ensure_future(conn.wait(loop.time() + first_s))
    await asyncio.sleep(0)
    conn.data_received(b"HTTP/1.1 200")
    await first
    return conn, asyncio.ensure_future(conn.wait(loop.time() + second_s))


async def test_a_wait_ends_at_its_deadline_when_an_earlier_wait_armed_a_later_timer() -> None:
    conn, second = await _second_wait(60, 0.05)
    done, _ = await asyncio.wait({second}, timeout=10)  # a bound, should it wait for the first's end
    assert second in done, "the wait outlived its deadline"
    assert isinstance(second.exception(), TimeoutError)
    conn.close()


async def test_a_wait_is_not_cut_short_by_the_timer_an_earlier_wait_armed() -> None:
    """The timer armed for a first, shorter wait fires during a second one: the second goes on
    until its own end (the timer is armed again), and its answer arrives."""
    conn, second = await _second_wait(0.05, 60)
    await asyncio.sleep(0.2)  # past the first wait's end
    assert not second.done()
    conn.data_received(b" OK\r\nContent-Length: 0\r\n\r\n")
    await second
    assert conn.finished and conn.head is not None and conn.head[0] == 200
    conn.close()


@pytest.mark.parametrize("line", [
    b"No colon here",
    b" Leading-Space: 1",
    b"Trailing-Space : 1",
    b"\tTab: 1",
    b": no name",
    b"Content-Length : 2",  # whitespace before the colon (RFC 9112 5.1: must be rejected)
    b"X-A: 1\r\n folded",  # obs-fold: a line that starts with whitespace
])
def test_a_malformed_header_line_is_a_protocol_error(line: bytes) -> None:
    wire = b"HTTP/1.1 200 OK\r\n" + line + b"\r\nContent-Length: 2\r\n\r\n{}"
    *_, reusable, error = parse([wire])
    assert isinstance(error, HopProtocolError) and "header" in str(error)
    assert not reusable


@pytest.mark.parametrize(("fields", "reusable"), [
    (b"CONTENT-LENGTH: 2", True),
    (b"content-length:2", True),
    (b"Content-Length: \t2 ", True),
    (b"Content-Length: 2\r\nContent-Length: 2", True),  # the same value twice: one length
    (b"Connection: keep-alive\r\nContent-Length: 2\r\nConnection: close", False),  # the last one
    (b"Content-Length: 2\r\nConnection: Keep-Alive, Close", False),
    (b"X-Content-Length: 9\r\nContent-Length: 2\r\nX-Transfer-Encoding: gzip", True),
    (b"X-Value: a: b\r\nContent-Length: 2\r\nX-Odd: \xe9 \t", True),
])
def test_framing_headers_are_found_whatever_their_case_spacing_and_neighbours(fields: bytes,
                                                                             reusable: bool) -> None:
    wire = b"HTTP/1.1 200 OK\r\n" + fields + b"\r\n\r\n{}"
    assert parse([wire]) == (200, b"{}", True, reusable, None)


_LINES = [b"server: uvicorn", b"Content-Type: application/json", b"date: Sun, 06 Dec 2026 10:00:00 GMT",
          b"date: Sun, 06 Dec 2026 10:00:01 GMT", b"Connection: close", b"connection: keep-alive",
          b"X-A:  1 ", b"Content-Length: 2", b"Content-Length: 3", b"no colon", b"Transfer-Encoding: gzip",
          b"X-Odd: \xe9"]


def _answer_on(conn: HopConnection, wire: bytes) -> tuple[object, ...]:
    conn.begin()
    conn.data_received(wire)
    return conn.head, conn.take(), conn.finished, conn.reusable, repr(conn.error)


@settings(max_examples=300, deadline=None)
@given(heads=st.lists(st.lists(st.sampled_from(_LINES), max_size=6), min_size=2, max_size=8))
def test_header_lines_seen_before_on_a_connection_are_read_as_the_first_time(
        heads: list[list[bytes]]) -> None:
    loop = asyncio.new_event_loop()
    try:
        conn = HopConnection(loop, parse_origin("http://127.0.0.1:1"))
        conn.connection_made(_Transport())  # type: ignore[arg-type]
        for lines in heads:
            wire = b"HTTP/1.1 200 OK\r\n" + b"".join(line + b"\r\n" for line in lines) + \
                b"Content-Length: 2\r\n\r\n{}"
            fresh = HopConnection(loop, parse_origin("http://127.0.0.1:1"))
            fresh.connection_made(_Transport())  # type: ignore[arg-type]
            assert _answer_on(conn, wire) == _answer_on(fresh, wire)
            if not conn.reusable:
                break
    finally:
        loop.close()


def test_the_header_lines_a_connection_remembers_are_bounded() -> None:
    loop = asyncio.new_event_loop()
    try:
        conn = HopConnection(loop, parse_origin("http://127.0.0.1:1"))
        conn.connection_made(_Transport())  # type: ignore[arg-type]
        for second in range(100):
            date = b"date: Sun, 06 Dec 2026 10:%02d:%02d GMT" % (second // 60, second % 60)
            wire = b"HTTP/1.1 200 OK\r\n" + date + b"\r\nContent-Length: 2\r\n\r\n{}"
            _, body, _, reusable, _ = _answer_on(conn, wire)
            assert body == b"{}" and reusable
            assert 1 <= len(conn._seen) <= 32
    finally:
        loop.close()


# -- strict line ends and control characters (a CR or LF alone fails the answer when it arrives)

_STRICT = [
    b"HTTP/1.1 200 OK\nContent-Length: 2\n\n{}",  # LF-only head
    b"HTTP/1.1 200 OK\r\nContent-Length: 2\n\r\n{}",
    b"HTTP/1.1 200 O\rK\r\nContent-Length: 2\r\n\r\n{}",  # a CR alone in the status line
    b"HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\rX-Evil: 1\r\nContent-Length: 2\r\n\r\n{}",
    b"HTTP/1.1 200 OK\r\nX-A: a\x00b\r\nContent-Length: 2\r\n\r\n{}",  # NUL in a value
    b"HTTP/1.1 200 OK\r\nX-A: a\x7fb\r\nContent-Length: 2\r\n\r\n{}",
    _CHUNKED + b"2\n{}\n0\n\n",  # LF-only chunk lines
    _CHUNKED + b"2\r\n{}\n0\r\n\r\n",  # a chunk's data ended by LF alone
    _CHUNKED + b"2\r\n{}\rx",  # ... by CR alone
    _CHUNKED + b"2\r\n{}\r\n0\n\n",  # the last chunk's line
    _CHUNKED + b"2;a\rb\r\n{}\r\n0\r\n\r\n",  # in an extension
    _CHUNKED + b"2;a\nb\r\n{}\r\n0\r\n\r\n",
    _CHUNKED + b"2\r\n{}\r\n0\r\nX: 1\n\r\n",  # in the trailer
    _CHUNKED + b"2\r\n{}\r\n0\r\nX: 1\r\n\n",
]


@pytest.mark.parametrize("wire", _STRICT)
def test_a_cr_or_lf_alone_or_a_control_character_fails_the_answer_as_it_arrives(wire: bytes) -> None:
    """The worker keeps its connection open after these bytes: the parser does not wait for a CRLF
    (or the hop's timeout), whatever the reads' cuts."""
    for pieces in splits(wire):
        *_, reusable, error = parse(pieces)
        assert isinstance(error, HopProtocolError) and not isinstance(error, HopDisconnected), pieces
        assert not reusable


# -- limits: the parser stops at them, holding no more than the limit

_SMALL = AnswerLimits(head=200, body=10, error=5)
_OVER = [
    # (wire, the part over its limit, stream)
    (b"HTTP/1.1 200 OK\r\nContent-Length: 11\r\n\r\n" + b"x" * 11, "body", False),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 999999999999\r\n\r\n" + b"x" * 11, "body", False),
    (chunked(b"x" * 4, b"y" * 4, b"z" * 4), "body", False),
    (chunked(b"x" * 11), "body", False),
    (b"HTTP/1.1 200 OK\r\n\r\n" + b"x" * 11, "body", False),  # until the connection's end
    (b"HTTP/1.1 400 Bad Request\r\nContent-Length: 6\r\n\r\n" + b"x" * 6, "error", False),
    (b"HTTP/1.1 400 Bad Request\r\nContent-Length: 6\r\n\r\n" + b"x" * 6, "error", True),
    (chunked(b"x" * 3, b"y" * 3).replace(b"200 OK", b"503 No"), "error", True),
    (b"HTTP/1.1 200 OK\r\nX-Pad: " + b"p" * 200 + b"\r\n\r\n", "head", False),
    (b"HTTP/1.1 100 Continue\r\nX-Pad: " + b"p" * 100 + b"\r\n\r\n"
     b"HTTP/1.1 100 Continue\r\nX-Pad: " + b"p" * 100 + b"\r\n\r\nHTTP/1.1 200 OK\r\n\r\n", "head", False),
    (chunked(b"x").replace(b"0\r\n\r\n", b"0\r\n" + b"X-T: 1\r\n" * 30 + b"\r\n"), "head", False),
]


@pytest.mark.parametrize(("wire", "part", "stream"), _OVER)
def test_an_answer_past_its_limit_fails_and_the_parser_never_holds_more(wire: bytes, part: str,
                                                                        stream: bool) -> None:
    limit = {"head": _SMALL.head, "body": _SMALL.body, "error": _SMALL.error}[part]
    for pieces in splits(wire):
        loop = asyncio.new_event_loop()
        try:
            conn = HopConnection(loop, parse_origin("http://127.0.0.1:1"), _SMALL)
            conn.connection_made(_Transport())  # type: ignore[arg-type]
            conn.begin(stream=stream)
            for piece in pieces:
                conn.data_received(piece)  # nothing taken: the body queued is all it holds
                assert conn._buffered <= limit and len(conn._pending) <= _SMALL.head, pieces
                if conn.error is not None:
                    break
            assert isinstance(conn.error, HopTooLarge) and conn.error.part == part, pieces
            assert not conn.reusable
        finally:
            loop.close()


@pytest.mark.parametrize("wire", [
    b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n" + b"x" * 10,
    chunked(b"x" * 4, b"y" * 6),
    chunked(b"x" * 10).replace(b"0\r\n\r\n", b"0\r\nX-T: 1\r\n\r\n"),
])
def test_an_answer_at_its_limit_is_read_whole(wire: bytes) -> None:
    for pieces in splits(wire):
        status, body, finished, _, error = parse(pieces, limits=_SMALL)
        assert (status, len(body), finished, error) == (200, 10, True, None), pieces


def test_a_streams_2xx_body_is_not_bounded_but_its_error_body_is() -> None:
    """A stream's body is taken as it arrives (``HopResponse.pipe``): its length is not a limit."""
    wire = chunked(*[b"data: %d\n\n" % i for i in range(10)])
    assert parse([wire], limits=_SMALL, stream=True)[1:] == (b"".join(b"data: %d\n\n" % i for i in range(10)),
                                                              True, True, None)
    error = parse([wire], limits=_SMALL)[-1]
    assert isinstance(error, HopTooLarge) and error.part == "body"
