"""D's reads relayed as D framed them (the splice): a read of a decode stream that is whole chunks
of plain events, once the stream's first event is read, goes from the hop connection's callback to
the client's transport as it came (``hop_answer.whole_chunks``, ``sse.plain_chunks``,
``HopConnection.splice``, ``StreamBuffer.send_framed``); any other read is parsed and handed to
the stream's reader as before. The client's stream is the same either way."""

from __future__ import annotations

import asyncio
from typing import cast

import aiohttp
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from proxy.errors import UpstreamTimeout
from proxy.hop import SinkError
from proxy.hop_answer import whole_chunks
from proxy.hop_wire import HopConnection, parse_origin
from proxy.sse import DONE_EVENT, SSEReader, one_plain_chunk, plain_chunks
from proxy.upstream import Upstream
from tests.proxy.hop_servers import serving
from tests.proxy.test_hop_pipe import HEAD, Paced, Sink, chunk, event

# -- which reads are whole chunks


@pytest.mark.parametrize(("data", "chunks"), [
    (chunk(b"data: 1\n\n"), 1),
    (chunk(b"data: 1\n\n") + chunk(b"data: 2\n\n"), 2),
    (b"A\r\n" + b"x" * 10 + b"\r\n", 1),  # hex, either case
    (b"a\r\n" + b"x" * 10 + b"\r\n", 1),
    (b"", 0),
    (chunk(b"data: 1\n\n")[:-1], 0),  # the CRLF after the data not all here
    (chunk(b"data: 1\n\n")[:-2], 0),
    (chunk(b"data: 1\n\n")[:4], 0),  # cut in the data
    (b"9\r", 0),  # cut in the size line
    (chunk(b"data: 1\n\n") + b"0\r\n\r\n", 0),  # the body's end: the parser's
    (b"0\r\n\r\n", 0),
    (b"9;ext=1\r\ndata: 1\n\n\r\n", 0),  # an extension: the parser's
    (b" 9\r\ndata: 1\n\n\r\n", 0),
    (b"+9\r\ndata: 1\n\n\r\n", 0),
    (b"9\r\ndata: 1\n\nX\r\n", 0),  # longer than its size
    (b"9\r\ndata: 1\n\n\r\nzz", 0),  # then something that is not a chunk
])
def test_a_read_is_spliceable_only_when_it_is_whole_chunks(data: bytes, chunks: int) -> None:
    assert whole_chunks(data) == chunks


# -- which chunks are plain events

_PIECES = [b"data: ", b"data:", b"{\"token_ids\":[1]}", b"x", b"\n", b"\r", b"\n\n", b"[DONE]",
           b"data: [DONE]\n\n", b'{"error"', b"event: e\n", b": c\n"]


def _one_plain_event(data: bytes) -> bool:
    """The oracle, read plainly: the chunk's data is one ``data`` line and its end, no CR, and
    neither [DONE] nor an error event is in it (anywhere: a ``data: data: [DONE]`` line is
    declined too, read as events, the careful side)."""
    return (data.startswith(b"data: ") and data.endswith(b"\n\n") and data.count(b"\n") == 2
            and b"\r" not in data and DONE_EVENT not in data and b'data: {"error"' not in data)


@settings(max_examples=400)
@given(st.lists(st.lists(st.sampled_from(_PIECES), min_size=1, max_size=6).map(b"".join),
                min_size=1, max_size=5))
def test_chunks_are_plain_exactly_when_each_is_one_plain_event(datas: list[bytes]) -> None:
    framed = b"".join(chunk(d) for d in datas)
    assert whole_chunks(framed) == len(datas)
    plain = plain_chunks(framed) == len(datas)
    assert plain == all(_one_plain_event(d) for d in datas)
    if plain:  # the reader would have found the same events, plain, the stream not ended
        batch = SSEReader().feed_batch(b"".join(datas))
        assert batch.plain and not batch.done and batch.body == b"".join(datas)


_SIZES = ["%x", "%X", "%016x", "%017x", "+%x", " %x", "%x ", "0x%x", "%x;e", "0", "1", "f"]
"""A chunk's size line from its data's length: bare hex (any case, up to 16 digits) or not."""
_MIDDLES = [b"x", b'{"token_ids":[1]}', b"[DONE]", b"\n", b"\r", b'{"error"', b"data: [DONE]\n\n",
            b"data: ", b"\n\n"]


@settings(max_examples=600)
@example(b"\n", "%x", b"\r\n", b"")  # an LF inside the event: two lines, not one plain event
@example(b"\r", "%x", b"\r\n", b"")
@example(b"x", " %x", b"\r\n", b"")
@given(st.lists(st.sampled_from(_MIDDLES), max_size=3).map(b"".join),
       st.sampled_from(["%x", "%x", *_SIZES]), st.sampled_from([b"\r\n", b"\r\n", b"", b"\r", b"x"]),
       st.sampled_from([b"", b"", b"1\r\nx\r\n", b"0\r\n\r\n"]))
def test_one_plain_chunk_is_what_the_two_counts_say(middle: bytes, size: str, end: bytes,
                                                    more: bytes) -> None:
    """The one-match check of the usual read agrees with ``plain_chunks`` and ``whole_chunks``
    wherever it says yes, and says yes to every chunk of one plain event (a size line that is
    not the data's length or not bare hex, a cut or other end, a second chunk: no)."""
    data = b"data: " + middle + b"\n\n"
    framed = (size % len(data) if "%" in size else size).encode() + b"\r\n" + data + end + more
    if one_plain_chunk(framed):
        assert plain_chunks(framed) == whole_chunks(framed) == 1
    if size in ("%x", "%X", "%016x") and end == b"\r\n" and not more:
        assert one_plain_chunk(framed) == (plain_chunks(framed) == 1) == _one_plain_event(data)


def test_plain_events_of_vllms_kind_are_plain() -> None:
    events = [b'data: {"request_id":"generate-tokens-a","choices":[{"index":0,"token_ids":[264]}]}\n\n',
              b'data: {"request_id":"generate-tokens-a","choices":[{"index":0,"token_ids":[331]}]}\n\n']
    assert plain_chunks(b"".join(chunk(e) for e in events)) == 2
    assert one_plain_chunk(chunk(events[0])) and not one_plain_chunk(b"".join(chunk(e) for e in events))
    event = b"data: " + b"x" * 18 + b"\n\n"  # 0x1a bytes: a size with a letter, either case
    assert one_plain_chunk(b"1a\r\n" + event + b"\r\n") and one_plain_chunk(b"1A\r\n" + event + b"\r\n")
    assert not plain_chunks(chunk(events[0] + events[1]))  # two events in one chunk
    for other in (b": ping\n\n", b"event: x\n\n", b"datum: x\n\n"):  # no data line
        assert not one_plain_chunk(chunk(other)) and not plain_chunks(chunk(other))
    assert not plain_chunks(chunk(events[0]) + chunk(DONE_EVENT))


@pytest.mark.parametrize("data", [
    b"data: a\nb\n",  # two lines, not ended
    b"data: a\n\nb",  # ended mid-chunk: the rest is the next event's start
    b"data: x\r\n\n",  # a CR (the reader normalizes line ends)
    b"data: x\r\r\n\n",
    b"event: e\ndata: x\n\n",  # another field
    b"data:x\n\n",  # no space after the field name
    b"data: [DONE]\n\n",
    b'data: {"error":{"message":"m"}}\n\n',
])
def test_a_chunk_of_anything_but_one_plain_event_is_not_plain(data: bytes) -> None:
    ok = chunk(b"data: 1\n\n")
    assert not _one_plain_event(data)
    assert not plain_chunks(chunk(data))
    assert plain_chunks(ok + chunk(data) + ok) != 3


# -- the connection: whole chunks to the splice, the rest to the sink


class Splice:
    """Takes every read that is whole chunks (``take``) or none; records what it was offered."""

    def __init__(self, paced: Paced, *, take: bool = True, fail: bool = False) -> None:
        self.paced, self.take, self.fail = paced, take, fail
        self.reads: list[tuple[bytes, int]] = []

    def __call__(self, framed: bytes) -> bool:
        chunks = whole_chunks(framed)  # as the stream's splice: nothing else is taken
        if not chunks:
            return False
        self.reads.append((framed, chunks))
        if self.fail:
            raise RuntimeError("the splice broke")
        if self.take:
            self.paced.taken.set()
        return self.take


@pytest.mark.parametrize("take", [True, False], ids=["taken", "declined"])
async def test_reads_of_whole_chunks_go_to_the_splice_as_they_came_and_the_answer_still_ends(
        take: bool) -> None:
    """Events one a read: each read the splice takes is D's chunk itself and the sink gets none
    of them (but what came with the head); what it declines goes to the sink as before. Either
    way the last chunk still ends the answer: the connection is kept."""
    paced = Paced(12)
    async with serving(paced.handler) as (_, url, client):
        resp = await client.request(url, "/g", b"", b"{}", deadline=None, read_limit=10, stream=True)
        sink, splice = Sink(paced), Splice(paced, take=take)
        await resp.pipe(sink, splice)
        offered = [framed for framed, _ in splice.reads]
        if take:
            first = len(sink.reads)
            assert sink.reads in ([], [event(0)])  # the first event came with the head, or not
            assert offered == [chunk(event(i)) for i in range(first, 12)]
        else:
            assert sink.reads == [event(i) for i in range(12)]
            assert len(offered) >= 11  # offered, and declined
        resp.close()
        assert client.counts() == {"in_use": 0, "idle": 1}


async def test_a_read_cut_mid_chunk_goes_to_the_sink_and_the_next_whole_ones_to_the_splice() -> None:
    """Reads fed one by one: a whole chunk is spliced; a chunk in two reads is parsed, its data
    to the sink once whole; a whole chunk then, while that is still queued for the sink, is
    parsed too (nothing overtakes what is queued); once the sink has it, whole chunks are
    spliced again; the last chunk ends the answer."""
    from tests.proxy.test_hop_wire import _Transport  # noqa: PLC0415

    loop = asyncio.get_running_loop()
    conn = HopConnection(loop, parse_origin("http://127.0.0.1:9"))
    conn.connection_made(_Transport())  # type: ignore[arg-type]
    conn.begin(stream=True)
    conn.data_received(HEAD)
    got: list[tuple[str, bytes]] = []

    def sink(data: bytes) -> bool:
        got.append(("sink", data))
        return True

    def splice(framed: bytes) -> bool:
        if not whole_chunks(framed):
            return False
        got.append(("splice", framed))
        return True

    task = loop.create_task(conn.pipe(sink, None, 10.0, splice))
    await asyncio.sleep(0)  # the pipe waits
    conn.data_received(chunk(event(0)))
    assert got == [("splice", chunk(event(0)))]
    conn.data_received(chunk(event(1))[:5])
    conn.data_received(chunk(event(1))[5:])
    conn.data_received(chunk(event(2)))  # event 1 is still queued for the sink
    await asyncio.sleep(0)
    conn.data_received(chunk(event(3)) + chunk(event(4)))
    assert got == [("splice", chunk(event(0))), ("sink", event(1) + event(2)),
                   ("splice", chunk(event(3)) + chunk(event(4)))]
    conn.data_received(b"0\r\n\r\n")
    await asyncio.wait_for(task, 10)
    assert conn.sink is None and conn.splice is None and conn.finished


async def test_what_the_splice_raises_is_its_own_error() -> None:
    paced = Paced(10)
    async with serving(paced.handler) as (_, url, client):
        resp = await client.request(url, "/g", b"", b"{}", deadline=None, read_limit=10, stream=True)
        sink, splice = Sink(paced), Splice(paced, fail=True)
        with pytest.raises(SinkError) as raised:
            await resp.pipe(sink, splice)
        assert isinstance(raised.value.error, RuntimeError) and len(splice.reads) == 1
        resp.close()
        assert client.counts() == {"in_use": 0, "idle": 0}


async def test_spliced_reads_move_the_read_limit_on() -> None:
    """Spliced reads 0.05 s apart for 2 s under a 1.5 s read limit go through (each read moves
    the wait's end, as a read the sink gets does); then the worker stops: the wait times out."""
    paced = Paced(40, end="stall", gap=0.05)
    async with serving(paced.handler) as (_, url, client):
        up = Upstream(cast(aiohttp.ClientSession, None), api_key=None, connect_timeout=5, hops=client)
        loop = asyncio.get_running_loop()
        resp = await client.request(url, "/g", b"", b"{}", deadline=loop.time() + 60, read_limit=1.5,
                                    stream=True)
        sink, splice = Sink(paced), Splice(paced)
        with pytest.raises(UpstreamTimeout, match="stream stalled"):
            await up.pipe("decode", url, resp, sink, splice)
        assert len(sink.reads) + len(splice.reads) == 40 and len(splice.reads) >= 39
        resp.close()
