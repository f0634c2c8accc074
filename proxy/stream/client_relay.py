"""The handler's relay of a decode stream to its client: writes bounded for slow readers, the
stream's end, and what the client saw measured (TTFT, ITL, TPOT)."""

from __future__ import annotations

from aiohttp import web
from prometheus_client import Histogram

from proxy.sse.events import DONE_EVENT
from proxy.sse.relay import StreamBuffer, write_bounded
from proxy.walk.aborts import stream_tail
from proxy.walk.core import Part
from proxy.walk.flight import Flight
from proxy.wire.errors import StreamOverflow


class _Writes:
    """A stream's first and last writes; the gaps between them go to the ITL histogram."""

    __slots__ = ("first", "itl", "last")

    def __init__(self, first: float | None, itl: Histogram) -> None:
        self.first = self.last = first
        self.itl = itl



class ClientRelay(Part):
    """Relays one stream's buffer to its client, every write bounded."""

    def _wrote(self, f: Flight, w: _Writes, now: float) -> None:
        if w.last is None:
            w.first = now
            self.metrics.ttft.observe(now - f.timing.received)
        else:
            w.itl.observe(now - w.last)
            if f.timing.second_write is None and f.timing.first_write is not None:
                self._second_write(f, now)
        w.last = now

    async def _pump(self, request: web.Request, f: Flight, resp: web.StreamResponse, buffer: StreamBuffer,
                    w: _Writes) -> bytes:
        """The buffer's events to the client until D's stream ends; returns the last events, which go out
        with the end in one write."""
        transport = request.transport
        # A write that leaves the transport's buffer at or below its high-water mark cannot block: no timer.
        high = transport.get_write_buffer_limits()[1] if transport is not None else -1
        while True:
            queued = transport.get_write_buffer_size() if transport is not None else 0
            items, finished = await buffer.take(merge=queued > 0)
            data = b""
            if items:
                data = items[0] if len(items) == 1 else b"".join(items)
                if f.rewrite is not None:
                    data = f.rewrite.apply(data)
                if not finished:
                    if queued + len(data) <= high:  # the buffer only drained while we waited
                        await resp.write(data)
                    else:
                        await self.write_client(request, resp, data)
                    buffer.sent()
                self._wrote(f, w, self.clock())
            if finished:
                return data

    async def relay(self, request: web.Request, f: Flight, resp: web.StreamResponse,
                     buffer: StreamBuffer) -> None:
        w = _Writes(f.timing.first_write, self.metrics.itl)
        last = await self._pump(request, f, resp, buffer, w)
        if buffer.overflowed:
            self.metrics.child(self.metrics.slow_reader_ended, buffer.overflowed).inc()
            err = StreamOverflow(
                f"stream aborted: the client read too slowly ({self.settings.slow_reader_max_bytes} "
                "bytes queued)" if buffer.overflowed == "stream" else
                "stream aborted: the client read too slowly (the proxy's buffers for slow clients "
                f"are full: {self.settings.slow_reader_total_bytes} bytes)")
            await self.write_client(request, resp, last + err.sse_event() + DONE_EVENT, eof=True)
            buffer.sent()
            return  # phase stays DECODING: the clean-up aborts D
        self._observe_stream(f, w.first, w.last)
        events = last + buffer.error_event if buffer.error_event is not None else last
        await self.write_client(request, resp, stream_tail(request, f, self.clock(), events), eof=True)
        buffer.sent()
        task = f.decode_task
        if task is not None and task.done() and not task.cancelled() and task.exception() is None:
            self.core.set_done(f)  # (a producer that raised left D and P's lease to the clean-up)

    def _second_write(self, f: Flight, now: float) -> None:
        first = f.timing.first_write
        if first is not None:
            f.timing.second_write = now
            self.metrics.stages["first_to_second"].observe(now - first)

    def _observe_stream(self, f: Flight, first_write: float | None, last_write: float | None) -> None:
        """A stream relayed to its end: the decode stage after D's first token, and the TPOT."""
        if f.timing.second_write is None:
            self._second_write(f, self.clock())
        if f.timing.first_token is not None:
            self.metrics.stages["decode_stream"].observe(
                self.clock() - f.timing.first_token)
        tokens = f.completion_tokens  # known only when the client asked for include_usage
        if tokens is not None and tokens > 1 and f.request.sampling_params.n == 1 \
                and first_write is not None and last_write is not None:
            self.metrics.tpot.observe((last_write - first_write) / (tokens - 1))

    async def write_client(self, request: web.Request, resp: web.StreamResponse, data: bytes, *,
                            eof: bool = False) -> None:
        await write_bounded(request, resp, data, self.settings.slow_reader_timeout, eof=eof)


__all__ = ["ClientRelay"]
