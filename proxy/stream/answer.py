"""The streamed decode: D's stream read into a buffer by a producer task (retried before its first
byte, migrated to another decode worker when it breaks later), and relayed to the client by the
handler, bounded for slow readers. What D sends is handled in the loop turn it arrives in, from
the hop connection (the producer waits once an attempt, ``proxy.stream.read``), and the
handler's relay writes what has queued.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from aiohttp import web
from prometheus_client import Histogram

from proxy.pools import NoWorkerAvailable, Outcome, Overloaded, StreamFollower, Worker, migration_blocker
from proxy.sse.events import DONE_EVENT
from proxy.sse.relay import StreamBuffer, event_stream, write_bounded
from proxy.stream.read import DecodeReader, Status
from proxy.walk.aborts import Aborts, stream_tail
from proxy.walk.cleanup import Cleanup
from proxy.walk.core import Core, Part
from proxy.walk.decode import DecodeAttempts, DecodeEngine
from proxy.walk.flight import Flight
from proxy.walk.prefill import Prefill
from proxy.wire.errors import (
    ProxyError,
    StreamOverflow,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamStatusError,
    log_unexpected,
)

log = logging.getLogger("pd_proxy")


class _Writes:
    """A stream's writes to its client so far: the first and the last (P's token, when it went
    first, is both at the start); the gaps between them go to the ITL histogram (``itl``)."""

    __slots__ = ("first", "itl", "last")

    def __init__(self, first: float | None, itl: Histogram) -> None:
        self.first = self.last = first
        self.itl = itl


class StreamDecode(Part):
    """A streamed decode: the producer task (``produce``: attempts, retries, migration) and the
    handler's relay to the client (``decode``, ``relay``)."""

    def __init__(self, core: Core, engine: DecodeEngine, aborts: Aborts, cleanup: Cleanup,
                 prefill: Prefill) -> None:
        super().__init__(core)
        self.engine = engine
        self.aborts = aborts
        self.cleanup = cleanup
        self.prefill = prefill
        self.reader = DecodeReader(core)

    async def decode(self, request: web.Request, f: Flight, worker: Worker,
                     body: dict[str, Any], opened: web.StreamResponse | None = None) -> web.StreamResponse:
        """``opened``: the client's stream, already open with P's token (``proxy.stream.first_stream``):
        D's stream follows it; a failure before D's first event then ends in-band."""
        loop = self.tracker.loop
        buffer = f.buffer = StreamBuffer(self.settings.slow_reader_max_bytes, self.core.stream_budget, loop)
        try:
            f.headers_ready = loop.create_future()
            f.decode_started(self.tracker.spawn(self.produce(f, worker, body, buffer)))
            if opened is not None:
                try:
                    await self.relay(request, f, opened, buffer)
                except ConnectionResetError:
                    self.core.note_abort(f, "shutdown" if self.draining else "disconnect")
                return opened
            if not await self.aborts.hop_or_abandon(f, f.headers_ready):
                return await self.aborts.respond_aborted(request, f, done=False)
            try:
                await asyncio.shield(f.headers_ready)
            except UpstreamError as e:
                self.cleanup.after_decode_error(f, e)
                self.core.set_done(f)
                raise
            # D answered: the headers go at once (the client learns its request was taken)
            resp = event_stream(request, f.headers, headers_with_first_write=False)
            await resp.prepare(request)
            try:
                await self.relay(request, f, resp, buffer)
            except ConnectionResetError:
                # The client went away mid-stream: return quietly (aiohttp ignores the failed
                # write_eof); the clean-up aborts D because the state is still DECODING.
                self.core.note_abort(f, "shutdown" if self.draining else "disconnect")
            return resp
        finally:
            buffer.discard()  # nothing more goes to this client: its bytes leave the budget

    def _crashed(self, f: Flight, buffer: StreamBuffer, exc: Exception) -> None:
        """The producer raised ``exc`` (a bug: every failure it expects ends the client's answer
        in ``produce``). Left so, the handler would wait forever, for D's answer
        (``headers_ready``) or in the relay's ``take``, and the request stay in the table until
        the client leaves. Its client is answered as after any unexpected error: a generic 500
        when nothing was sent yet (the handler raises it: ``proxy.wire.errors.answer_error`` logs it),
        else the proxy's in-band error event; when the handler already answered an abort and
        left (``abandoned``), the clean-up logs it. The phase stays DECODING: the clean-up aborts
        D and closes P's lease (``Cleanup.run``, which also retrieves the exception)."""
        f.settled.set()  # nothing else will: the clean-up waits on it while it aborts D
        f.crash()
        ready = f.headers_ready
        if f.first is None and ready is not None and not ready.done():  # no stream opened yet
            ready.set_exception(exc)  # the handler's, or the clean-up's when it left (``abandoned``)
            return
        # The client's stream is open (D answered, or P's token went first): the error goes
        # in-band, never quoting the exception (its message may quote the request).
        log_unexpected(exc, "reading a decode stream")
        if not buffer.closed:
            buffer.finish(done=False, error=ProxyError("Internal server error").sse_event())

    def _wrote(self, f: Flight, w: _Writes, now: float) -> None:
        """A write to the client at ``now``: the first one's TTFT, the gaps between the others."""
        if w.last is None:
            w.first = now
            self.metrics.ttft.observe(now - f.timing.received)
        else:
            w.itl.observe(now - w.last)
            if f.timing.second_write is None and f.timing.first_write is not None:
                self._second_write(f, now)  # once per stream, only after P's token
        w.last = now

    async def _pump(self, request: web.Request, f: Flight, resp: web.StreamResponse, buffer: StreamBuffer,
                    w: _Writes) -> bytes:
        """The buffer's events to the client until D's stream ends; the events taken with the end
        and not written: they go out with the stream's end (one write for the last events,
        ``[DONE]`` and the chunked end), counted as written now."""
        transport = request.transport
        # A write that leaves the transport's buffer at or below its high-water mark cannot pause
        # writing, so it cannot block: it needs no timer (profiled: the per-write timeout was the
        # relay loop's largest cost of its own).
        high = transport.get_write_buffer_limits()[1] if transport is not None else -1
        while True:
            # The client lags when what we wrote before is still in the transport's buffer.
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
        w = _Writes(f.timing.first_write, self.metrics.itl)  # P's token went first
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
        """The write after P's token (when P's token went first): the ``first_to_second`` stage."""
        first = f.timing.first_write
        if first is not None:
            f.timing.second_write = now
            self.metrics.stages["first_to_second"].observe(now - first)

    def _observe_stream(self, f: Flight, first_write: float | None, last_write: float | None) -> None:
        """A stream relayed to its end: the decode stage after D's first token, and the time per
        output token the client saw (when usage gives the count)."""
        if f.timing.second_write is None:  # nothing but the stream's end followed P's token
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
        """Write to a streaming client, bounded by ``slow_reader_timeout`` (``write_bounded``)."""
        await write_bounded(request, resp, data, self.settings.slow_reader_timeout, eof=eof)

    async def produce(self, f: Flight, worker: Worker, body: dict[str, Any], buffer: StreamBuffer) -> None:
        """The producer task: ``attempts``, its client answered if it raises (``_crashed``)."""
        try:
            await self.attempts(f, worker, body, buffer)
        except Exception as e:
            self._crashed(f, buffer, e)
            raise  # the task ends failed: the clean-up frees what D and P hold
        finally:
            f.settled.set()  # its last hop ended, however (the clean-up's repeated aborts stop)

    async def attempts(self, f: Flight, worker: Worker, body: dict[str, Any], buffer: StreamBuffer) -> None:
        """Read D's stream into ``buffer`` (never blocks on the client).

        Before D's first byte, a failed open goes to another decode worker (``DecodeAttempts``).
        A stream that breaks later (the worker died, reset, or sent an error event) continues on
        another decode worker as a continuation (``proxy.pools.migration``) when the request
        allows it: the client's stream goes on with no visible seam."""
        assert f.headers_ready is not None
        follower = (StreamFollower(f.data, f.request.output_mode)
                    if self.pools.settings.migrate and migration_blocker(f.data) is None else None)
        if follower is not None and f.first_filter is not None and f.first is not None:
            for payload in f.first.payloads():  # the client has P's token: the stream starts there
                follower.event(payload)
        tries = DecodeAttempts(self.engine, f, worker, body)
        while True:
            status, error, exc = await self._attempt(f, tries, buffer, follower)
            if status is Status.DONE:
                buffer.finish(done=True)
                return
            if status is Status.CLOSED:
                return
            if status is Status.MISMATCH:
                # D's token 1 is not the one the client has from P: go on from prompt + P's
                # token (a continuation), never relaying D's contradicting token.
                assert f.first_filter is not None
                f.first_filter.clear()
                self.metrics.first_token_mismatch.inc()
                error = UpstreamProtocolError("decode", tries.worker.url, "its first token is not the "
                                              "prefill worker's, which the client already has").sse_event()
                if not await self._migrate(f, tries, buffer, follower, status=status, error=error):
                    return
                continue
            if status is Status.KV_FAILED or (status is Status.OPEN_FAILED and not f.headers_ready.done()):
                # Nothing reached the client yet: another decode worker may take the same body
                # (P's KV while its lease holds), as before D's first byte; when those retries
                # are spent on an ambiguous failure, one last attempt goes decode-only.
                assert exc is not None
                if not await self._retry(f, tries, buffer, status=status, error=error, exc=exc):
                    return
            elif not await self._migrate(f, tries, buffer, follower, status=status, error=error):
                if status is Status.OPEN_FAILED and exc is not None:
                    # A continuation's hop that failed to open, not migrated again: the KV P
                    # holds for it is released (the first hop's failures go through ``_retry``).
                    self.cleanup.after_decode_error(f, exc)
                return

    async def _attempt(self, f: Flight, tries: DecodeAttempts, buffer: StreamBuffer,
                       follower: StreamFollower | None) -> tuple[Status, bytes | None, UpstreamError | None]:
        """One attempt (``once``) in its span; its worker released with the outcome it earned
        (neutral when the attempt raised: it was cancelled, or the proxy has a bug)."""
        w = tries.worker
        status, error, exc = Status.BROKEN, None, None
        raised = True
        try:
            with f.trace.hop("decode", w) as hop:
                status, error, exc = await self.reader.once(f, w, tries.body, buffer, follower)
                hop.outcome(status.value)
            raised = False
        finally:
            passthrough = isinstance(exc, UpstreamStatusError) and exc.passthrough
            outcome = (Outcome.SUCCESS if status is Status.DONE else
                       Outcome.NEUTRAL if status in (Status.CLOSED, Status.MISMATCH) or passthrough
                       or raised or f.record.is_aborted
                       else Outcome.FAILURE)
            if status in (Status.OPEN_FAILED, Status.KV_FAILED) and exc is not None:
                outcome = tries.failed(exc, outcome)
            elif status is Status.DONE:
                tries.answered()
            else:
                tries.suspect = None  # the retry ended otherwise: it tells nothing about the first
            self.decode_pool.release(w, outcome, f.ctx.tokens)
        return status, error, exc

    async def _retry(self, f: Flight, tries: DecodeAttempts, buffer: StreamBuffer, *, status: Status,
                     error: bytes | None, exc: UpstreamError) -> bool:
        """The attempt failed before anything reached the client: True when another follows;
        else the client gets the failure (an error answer, or an error event)."""
        assert f.headers_ready is not None
        try:
            if await tries.next(exc):
                return True
        except UpstreamError:
            pass  # no worker left to take it
        f.settled.set()
        # P's KV is released here, whoever hears of the failure (the handler may have gone:
        # a client that left, or one answered an abort, awaits nothing of this producer).
        self.cleanup.after_decode_error(f, exc)
        if status is Status.OPEN_FAILED and f.first is None:  # no stream opened yet: the handler's answer
            f.headers_ready.set_exception(exc)
        else:
            self.end_with_error(f, buffer, error, exc.message)
        return False

    async def _migrate(self, f: Flight, tries: DecodeAttempts, buffer: StreamBuffer,
                       follower: StreamFollower | None, *, status: Status, error: bytes | None) -> bool:
        """The stream broke after D's first byte: True when it goes on elsewhere (a continuation
        on another decode worker); else the client's stream ends, with the error when any."""
        record, rt, w = f.record, self.pools, tries.worker
        if status is not Status.PROTOCOL and follower is not None and not record.is_aborted \
                and not buffer.closed and follower.migrations < rt.settings.max_migrations \
                and (f.deadline is None or not f.deadline.expired):
            cont = follower.continue_elsewhere(record.base_id)
            if cont is None:  # the client already has every token
                buffer.finish(done=True)
                return False
            if status is not Status.MISMATCH:  # a mismatching worker is not broken: it may take it
                tries.tried.append(w)
            try:
                w = await self.decode_pool.acquire(f.ctx, exclude=tries.tried, limit=self.core.queue_limit(f),
                                                   wait_recovering=True)
            except (NoWorkerAvailable, Overloaded) as e:
                self.end_with_error(f, buffer, error, f"no decode worker to migrate to ({e})")
                return False
            f.decode_on(w)
            try:
                body = await self.prefill.continuation(f, cont.body)
            except BaseException:  # cancelled (the client left): ``w`` was taken for nothing
                self.decode_pool.release(w, Outcome.NEUTRAL, f.ctx.tokens)
                raise
            # The next worker must register the continuation before its connection may be
            # closed (its KV is P's again): what settled the last one says nothing of it.
            f.settled.clear()
            self.core.decoding(f)  # the continuation's KV, when P holds some
            if f.first_filter is not None:
                # The continuation starts after the tokens the client has, P's token among them
                # (D broke before its token 1 was checked): no token 1 to take out of it.
                f.first_filter.clear()
            tries.move(w, body)
            rt.count_migration()
            log.warning("request %s: stream migrated to %s after %d tokens", record.engine_id, w.url,
                        cont.kept + cont.replay)
            return True
        why = ("the worker broke the protocol" if status is Status.PROTOCOL else
               "this request cannot migrate" if follower is None else
               "aborted" if record.is_aborted else
               f"{follower.migrations} migrations already"
               if follower.migrations >= rt.settings.max_migrations else "its deadline passed")
        self.end_with_error(f, buffer, error, f"decode stream {status.value} on {w.url}, not migrated: {why}")
        return False

    def end_with_error(self, f: Flight, buffer: StreamBuffer, error: bytes | None, why: str) -> None:
        """End the client's stream with D's error event (or the proxy's): logged, so that a
        client-visible stream error can be followed (ids, workers and reasons only)."""
        if not buffer.closed:
            log.warning("request %s: stream ended with an error: %s", f.record.engine_id, why)
        buffer.finish(done=False, error=error)
