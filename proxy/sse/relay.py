"""The stream relay between a decode worker and a (possibly slow) client. Events queue in a
``StreamBuffer``; a lagging client gets them merged per choice (``merge_chunks``), so the
concatenation of what it receives always equals what the worker sent. Memory is bounded per
stream and per process (``ByteBudget``); past either the stream ends with an in-band error.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from aiohttp import web

from proxy.sse.events import data_event, split_events
from proxy.wire.protocol import compact_json, parse_worker_json


class EventStream(web.StreamResponse):
    """A client's event stream whose headers go out with its first write (one write, not two)."""

    _send_headers_immediately = False  # aiohttp's own switch (``web.Response`` sets it so too)


class StreamOutput:
    """What a client's stream bytes become on their way out (here: themselves). A route that
    answers in another shape (``proxy.openai``) sets its own on the request (``STREAM_OUTPUT``)
    before the walk: every write of the stream, its end included, goes through ``translate``."""

    async def translate(self, data: bytes, *, last: bool) -> bytes:
        """The bytes to write for ``data`` (whole SSE events); ``last``: the stream's end."""
        return data


STREAM_OUTPUT = web.RequestKey("stream_output", StreamOutput)


class TranslatedStream(web.StreamResponse):
    """A client's event stream whose writes go through a ``StreamOutput``."""

    def __init__(self, output: StreamOutput, *, headers_with_first_write: bool, status: int,
                 headers: Mapping[str, str]) -> None:
        super().__init__(status=status, headers=headers)
        self._output = output
        if headers_with_first_write:
            self._send_headers_immediately = False  # as ``EventStream``

    async def write(self, data: bytes | bytearray | memoryview) -> None:
        out = await self._output.translate(bytes(data), last=False)
        if out:
            await super().write(out)

    async def write_eof(self, data: bytes | bytearray | memoryview = b"") -> None:
        await super().write_eof(await self._output.translate(bytes(data), last=True))


def event_stream(request: web.Request, headers: Mapping[str, str], *,
                 headers_with_first_write: bool) -> web.StreamResponse:
    """A client's event stream (200, ``text/event-stream``, ``no-cache``) with ``headers``; a request
    with a ``STREAM_OUTPUT`` gets a ``TranslatedStream``."""
    out = dict(headers)
    out["Content-Type"] = "text/event-stream; charset=utf-8"
    out["Cache-Control"] = "no-cache"
    output = request.get(STREAM_OUTPUT)
    if output is not None:
        return TranslatedStream(output, headers_with_first_write=headers_with_first_write, status=200,
                                headers=out)
    if headers_with_first_write:
        return EventStream(status=200, headers=out)
    return web.StreamResponse(status=200, headers=out)


HEAD_ROOM = 16384
"""What a write may add to its data (framing, the stream's end, the response head)."""


async def write_bounded(request: web.Request, resp: web.StreamResponse, data: bytes, limit: float, *,
                        eof: bool = False) -> None:
    """Write to a streaming client within ``limit`` seconds, else close its connection and raise
    ``ConnectionResetError``. A write that cannot wait needs no timer."""
    transport = request.transport
    write = resp.write_eof(data) if eof else resp.write(data)  # with eof: the data and the end, one write
    if transport is not None and not transport.get_write_buffer_size() \
            and len(data) + HEAD_ROOM <= transport.get_write_buffer_limits()[1]:
        await write
        return
    try:
        async with asyncio.timeout(limit):
            await write
    except TimeoutError:
        if request.transport is not None:
            request.transport.abort()
        raise ConnectionResetError("the client stopped reading its stream") from None


def _merged_logprobs(old: Any, value: Any) -> Any:
    """Two chunks' ``logprobs`` as one: their ``content`` lists joined, other keys the newer."""
    if isinstance(old, dict) and isinstance(value, dict):
        merged = dict(old)
        merged.update({k: v for k, v in value.items() if k != "content"})
        merged["content"] = (old.get("content") or []) + (value.get("content") or [])
        return merged
    return value if value is not None else old


def _merged_list(old: Any, value: Any) -> Any:
    if isinstance(old, list) and isinstance(value, list):
        return old + value
    return value if value is not None else old


def _merge_choice(acc: dict[str, Any], new: dict[str, Any]) -> None:
    for key, value in new.items():
        if key in ("token_ids", "routed_experts"):
            if key in acc or value is not None:
                acc[key] = _merged_list(acc.get(key), value)
        elif key == "text":
            acc[key] = (acc.get(key) or "") + (value or "")
        elif key == "logprobs":
            if key in acc or value is not None:
                acc[key] = _merged_logprobs(acc.get(key), value)
        elif key == "finish_reason":
            if value is not None:
                acc["finish_reason"] = value
                acc["stop_reason"] = new.get("stop_reason")
        elif key != "stop_reason" and (value is not None or key not in acc):
            acc[key] = value


def _fold(by_index: dict[int, dict[str, Any]], order: list[int], chunk: dict[str, Any]) -> None:
    """Fold one chunk's choices into the merged chunk of each choice index."""
    for choice in chunk["choices"]:
        index = int(choice.get("index", 0))
        env = by_index.get(index)
        if env is None:
            env = {k: v for k, v in chunk.items() if k != "choices"}
            env["choices"] = [dict(choice)]
            by_index[index] = env
            order.append(index)
        else:
            for k, v in chunk.items():
                if k != "choices" and v is not None:
                    env[k] = v
            _merge_choice(env["choices"][0], choice)


def merge_chunks(datas: list[bytes]) -> list[bytes]:
    """Merge queued stream chunks into one per choice index, then the latest usage-only chunk."""
    if len(datas) < 2:
        return datas
    by_index: dict[int, dict[str, Any]] = {}
    order: list[int] = []
    tail: list[bytes] = []
    usage_only: dict[str, Any] | None = None
    latest_usage: Any = None
    for raw in datas:
        try:
            chunk = parse_worker_json(raw)
        except ValueError:
            chunk = None
        if not isinstance(chunk, dict) or "error" in chunk or not isinstance(chunk.get("choices"), list):
            tail.append(raw)
            continue
        if chunk.get("usage") is not None:
            latest_usage = chunk["usage"]
        if not chunk["choices"]:
            usage_only = chunk
            continue
        _fold(by_index, order, chunk)
    out: list[bytes] = []
    for index in order:
        env = by_index[index]
        if usage_only is None and latest_usage is not None and env.get("usage") is not None:
            env["usage"] = latest_usage
        out.append(compact_json(env))
    if usage_only is not None:
        out.append(compact_json(usage_only))
    out.extend(tail)
    return out


class ByteBudget:
    """The bytes buffered for streaming clients across the process. Past ``total`` (0: none) the
    streams holding the most are ended until the rest fits: the slowest reader goes."""

    __slots__ = ("_holders", "doomed", "ended", "total", "used")

    def __init__(self, total: int) -> None:
        if total < 0:
            raise ValueError("total must be >= 0")
        self.total = total
        self.used = 0
        self.doomed = 0
        """Bytes charged by ended streams, released when their last write returns."""
        self.ended = 0
        self._holders: set[StreamBuffer] = set()

    def __len__(self) -> int:
        return len(self._holders)

    def join(self, buffer: StreamBuffer) -> None:
        self._holders.add(buffer)

    def leave(self, buffer: StreamBuffer) -> None:
        self._holders.discard(buffer)

    def charge(self, n: int) -> None:
        self.used += n
        if self.total and self.used - self.doomed > self.total:
            self._end_the_largest()

    def release(self, n: int, *, doomed: bool = False) -> None:
        self.used -= n
        if doomed:
            self.doomed -= n

    def _end_the_largest(self) -> None:
        while self.used - self.doomed > self.total and self._holders:
            victim = max(self._holders, key=StreamBuffer.held)
            self._holders.discard(victim)
            self.ended += 1
            victim.end_for_budget()


class StreamBuffer:
    """What the producer has read and the client has not yet been sent. ``put`` never blocks; the
    bytes held are capped per stream and by the ``ByteBudget``."""

    __slots__ = ("_budget", "_closed", "_discarded", "_done", "_error", "_loop", "_raw", "_size",
                 "_waiter", "_writing", "max_bytes", "overflowed")

    def __init__(self, max_bytes: int, budget: ByteBudget | None = None,
                 loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.max_bytes = max_bytes
        self._loop = loop
        self._raw: list[bytes] = []
        self._size = 0
        self._writing = 0
        self._waiter: asyncio.Future[None] | None = None
        self._closed = False
        self._discarded = False
        self._done = False
        self._error: bytes | None = None
        self.overflowed: str | None = None
        """Why the stream was cut: ``stream`` (its own cap) or ``total`` (the process's budget)."""
        self._budget = budget
        if budget is not None:
            budget.join(self)

    def held(self) -> int:
        """Bytes held for the client: queued, and taken for a write that has not returned."""
        return self._size + self._writing

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def put(self, raw: bytes) -> None:
        if self._closed or self._discarded:
            return
        self._raw.append(raw)
        n = len(raw)
        self._size += n
        if self._size + self._writing > self.max_bytes:
            self.overflowed = "stream"
            self._closed = True
        if self._budget is not None:
            self._budget.charge(n)  # may end this stream (or another) for the process's budget
        self._wake()

    def end_for_budget(self) -> None:
        """Budget spent and this stream holds the most: drop what is queued and end the stream."""
        budget = self._budget
        if budget is not None:
            budget.release(self._size)
            budget.doomed += self._writing
        self._raw, self._size = [], 0
        self.overflowed = "total"
        self._closed = True
        self._wake()

    def sent(self) -> None:
        """The write of what ``take`` returned has returned: those bytes are no longer held."""
        if self._writing:
            if self._budget is not None:
                self._budget.release(self._writing, doomed=self.overflowed == "total")
            self._writing = 0

    def discard(self) -> None:
        """Nobody will take from this buffer again: release everything; later puts are dropped."""
        if self._discarded:
            return
        self._discarded = True
        budget = self._budget
        if budget is not None:
            budget.release(self._size)
            budget.release(self._writing, doomed=self.overflowed == "total")
            budget.leave(self)
        self._raw, self._size, self._writing = [], 0, 0

    def finish(self, *, done: bool, error: bytes | None = None) -> None:
        """The producer is finished (``done``: ``[DONE]`` seen; ``error``: an event to send last)."""
        if self._closed:
            return
        self._closed = True
        self._done = done
        self._error = error
        self._wake()

    @property
    def closed(self) -> bool:
        return self._closed

    async def take(self, *, merge: bool) -> tuple[list[bytes], bool]:
        """Wait for something; the bytes to write (merged per choice with ``merge``) and whether
        the producer is finished."""
        while not self._raw and not self._closed:
            waiter = self._waiter = (self._loop or asyncio.get_running_loop()).create_future()
            try:
                await waiter
            finally:
                self._waiter = None
        raws = self._raw
        self._writing += self._size
        self._raw, self._size = [], 0
        if merge and raws:
            events = split_events(raws[0] if len(raws) == 1 else b"".join(raws))
            if len(events) > 1:
                raws = [data_event(d) for d in merge_chunks([e.data for e in events])]
        return raws, self._closed

    @property
    def ended_with_done(self) -> bool:
        return self._done

    @property
    def error_event(self) -> bytes | None:
        return self._error
