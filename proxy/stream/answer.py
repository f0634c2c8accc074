"""The streamed decode: D's stream read into a buffer by a producer task (retried before its first
byte, migrated when it breaks later) and relayed to the client by the handler, bounded."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from aiohttp import web

from proxy.pools import NoWorkerAvailable, Outcome, Overloaded, StreamFollower, Worker, migration_blocker
from proxy.sse.relay import StreamBuffer, event_stream
from proxy.stream.client_relay import ClientRelay
from proxy.stream.read import DecodeReader, Status
from proxy.walk.aborts import Aborts
from proxy.walk.cleanup import Cleanup
from proxy.walk.core import Core, Part
from proxy.walk.decode import DecodeAttempts, DecodeEngine
from proxy.walk.flight import Flight
from proxy.walk.prefill import Prefill
from proxy.wire.errors import (
    ProxyError,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamStatusError,
    log_unexpected,
)

log = logging.getLogger("pd_proxy")


class StreamDecode(Part):
    """A streamed decode: the producer task (``produce``) and the handler's part (``decode``)."""

    def __init__(self, core: Core, engine: DecodeEngine, aborts: Aborts, cleanup: Cleanup,
                 prefill: Prefill) -> None:
        super().__init__(core)
        self.engine = engine
        self.aborts = aborts
        self.cleanup = cleanup
        self.prefill = prefill
        self.reader = DecodeReader(core)
        self.client = ClientRelay(core)

    async def decode(self, request: web.Request, f: Flight, worker: Worker,
                     body: dict[str, Any], opened: web.StreamResponse | None = None) -> web.StreamResponse:
        """``opened``: the client's stream, already open with P's token; a failure then ends in-band."""
        loop = self.tracker.loop
        buffer = f.buffer = StreamBuffer(self.settings.slow_reader_max_bytes, self.core.stream_budget, loop)
        try:
            f.headers_ready = loop.create_future()
            f.decode_started(self.tracker.spawn(self.produce(f, worker, body, buffer)))
            if opened is not None:
                try:
                    await self.client.relay(request, f, opened, buffer)
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
            resp = event_stream(request, f.headers, headers_with_first_write=False)
            await resp.prepare(request)
            try:
                await self.client.relay(request, f, resp, buffer)
            except ConnectionResetError:
                # The client went away: the clean-up aborts D, as the state is still DECODING.
                self.core.note_abort(f, "shutdown" if self.draining else "disconnect")
            return resp
        finally:
            buffer.discard()  # nothing more goes to this client: its bytes leave the budget

    def _crashed(self, f: Flight, buffer: StreamBuffer, exc: Exception) -> None:
        """The producer raised ``exc`` (a bug): its client is answered as after any unexpected error (else
        the handler waits forever); the clean-up then aborts D and closes P's lease."""
        f.settled.set()  # nothing else will: the clean-up waits on it while it aborts D
        f.crash()
        ready = f.headers_ready
        if f.first is None and ready is not None and not ready.done():
            ready.set_exception(exc)  # the handler's, or the clean-up's when it left (``abandoned``)
            return
        # The stream is open: the error goes in-band, never quoting the exception.
        log_unexpected(exc, "reading a decode stream")
        if not buffer.closed:
            buffer.finish(done=False, error=ProxyError("Internal server error").sse_event())

    async def produce(self, f: Flight, worker: Worker, body: dict[str, Any], buffer: StreamBuffer) -> None:
        try:
            await self.attempts(f, worker, body, buffer)
        except Exception as e:
            self._crashed(f, buffer, e)
            raise  # the task ends failed: the clean-up frees what D and P hold
        finally:
            f.settled.set()  # its last hop ended, however (the clean-up's repeated aborts stop)

    async def attempts(self, f: Flight, worker: Worker, body: dict[str, Any], buffer: StreamBuffer) -> None:
        """Read D's stream into ``buffer`` (never blocks on the client); a failed open goes to another
        decode worker, a stream that breaks later goes on elsewhere as a continuation."""
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
                # D's token 1 is not the client's from P: go on from prompt + P's token, never relaying D's.
                assert f.first_filter is not None
                f.first_filter.clear()
                self.metrics.first_token_mismatch.inc()
                error = UpstreamProtocolError("decode", tries.worker.url, "its first token is not the "
                                              "prefill worker's, which the client already has").sse_event()
                if not await self._migrate(f, tries, buffer, follower, status=status, error=error):
                    return
                continue
            if status is Status.KV_FAILED or (status is Status.OPEN_FAILED and not f.headers_ready.done()):
                # Nothing reached the client yet: retried as before D's first byte.
                assert exc is not None
                if not await self._retry(f, tries, buffer, status=status, error=error, exc=exc):
                    return
            elif not await self._migrate(f, tries, buffer, follower, status=status, error=error):
                if status is Status.OPEN_FAILED and exc is not None:
                    # A continuation's hop failed to open: the KV P holds for it is released.
                    self.cleanup.after_decode_error(f, exc)
                return

    async def _attempt(self, f: Flight, tries: DecodeAttempts, buffer: StreamBuffer,
                       follower: StreamFollower | None) -> tuple[Status, bytes | None, UpstreamError | None]:
        """One attempt in its span; its worker released with the outcome it earned (neutral if it raised)."""
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
                tries.suspect = None
            self.decode_pool.release(w, outcome, f.ctx.tokens)
        return status, error, exc

    async def _retry(self, f: Flight, tries: DecodeAttempts, buffer: StreamBuffer, *, status: Status,
                     error: bytes | None, exc: UpstreamError) -> bool:
        """A failure before anything reached the client: True when another attempt follows."""
        assert f.headers_ready is not None
        try:
            if await tries.next(exc):
                return True
        except UpstreamError:
            pass
        f.settled.set()
        # P's KV is released here: the handler may have gone.
        self.cleanup.after_decode_error(f, exc)
        if status is Status.OPEN_FAILED and f.first is None:
            f.headers_ready.set_exception(exc)
        else:
            self.end_with_error(f, buffer, error, exc.message)
        return False

    async def _migrate(self, f: Flight, tries: DecodeAttempts, buffer: StreamBuffer,
                       follower: StreamFollower | None, *, status: Status, error: bytes | None) -> bool:
        """The stream broke after D's first byte: True when it goes on as a continuation elsewhere."""
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
            # The next worker must register the continuation before its connection may close.
            f.settled.clear()
            self.core.decoding(f)
            if f.first_filter is not None:
                # The continuation starts after the tokens the client has: no token 1 to take out.
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
        """End the client's stream with an error event, logged (ids, workers and reasons only)."""
        if not buffer.closed:
            log.warning("request %s: stream ended with an error: %s", f.record.engine_id, why)
        buffer.finish(done=False, error=error)
