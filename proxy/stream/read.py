"""Reading one decode stream (one attempt): D's events into the client's buffer (plain ones as
unparsed blocks), the first event checked, and how it ended (``Status``)."""

from __future__ import annotations

import enum
import json
import logging
from typing import Any

from proxy.pools import StreamFollower, Worker
from proxy.sse.events import DONE_DATA, Batch, SSEReader, data_event, last_data
from proxy.sse.first_token import Mismatch
from proxy.sse.relay import StreamBuffer
from proxy.upstream.hop import HopResponse
from proxy.walk.core import Part, error_class
from proxy.walk.flight import Flight
from proxy.wire.errors import UpstreamError, UpstreamProtocolError, UpstreamStatusError
from proxy.wire.protocol import parse_worker_json

log = logging.getLogger("pd_proxy")


class Status(enum.Enum):

    DONE = "done"
    CLOSED = "closed"
    """The buffer was closed: the client went away, read too slowly, or the stream was ended."""
    OPEN_FAILED = "open_failed"
    KV_FAILED = "kv_failed"
    """A server error event first, on a hop with P's KV: nothing was relayed."""
    PROTOCOL = "protocol"
    BROKEN = "broken"
    """It ended mid-way (reset, error event, no [DONE])."""
    MISMATCH = "first_token_mismatch"
    """D's token 1 is not the prefill worker's the client already has (nothing of it relayed)."""


class _Read:

    __slots__ = ("body", "buffer", "done", "error", "exc", "f", "first", "follower", "kv_failed", "last",
                 "mismatch", "protocol", "stop", "usage", "worker")

    def __init__(self, f: Flight, worker: Worker, body: dict[str, Any], buffer: StreamBuffer,
                 follower: StreamFollower | None) -> None:
        self.f, self.worker, self.body, self.buffer, self.follower = f, worker, body, buffer, follower
        self.usage = f.request.include_usage
        """The client asked for the usage chunk: D's last chunk is kept (``last``)."""
        self.first = True
        self.done = self.protocol = self.stop = self.mismatch = False
        self.error: bytes | None = None
        self.last = b""
        self.exc: UpstreamError | None = None
        self.kv_failed: UpstreamStatusError | None = None


class DecodeReader(Part):

    async def once(self, f: Flight, worker: Worker, body: dict[str, Any], buffer: StreamBuffer,
                   follower: StreamFollower | None) -> tuple[Status, bytes | None, UpstreamError | None]:
        """How the stream ended, with D's error event (or the proxy's) and the failure, if any."""
        assert f.headers_ready is not None
        series = self.metrics.calls(worker.pool, worker.url)
        series.inflight.inc()
        series.requests.inc()
        resp: HopResponse | None = None
        try:
            try:
                resp = await self.upstream.open(
                    "decode", worker.url, body, request_id=f.record.base_id, total=None,
                    sock_read=self.settings.stream_idle_timeout, stream=True)
            except UpstreamError as e:
                self.metrics.child(self.metrics.upstream_errors, worker.pool, worker.url,
                                   error_class(e)).inc()
                return Status.OPEN_FAILED, e.sse_event(), e
            if not f.headers_ready.done():
                f.headers_ready.set_result(None)
            if f.record.is_aborted:
                # An abort sent before vLLM registered the request may have been dropped: sent again now.
                self.tracker.spawn(self.send_abort(worker, f.record.engine_id))
            rd = _Read(f, worker, body, buffer, follower)
            try:
                await self._read(rd, resp)
            except UpstreamError as e:
                self.metrics.child(self.metrics.upstream_errors, worker.pool, worker.url,
                                   error_class(e)).inc()
                rd.error, rd.exc = e.sse_event(), e
                rd.protocol = isinstance(e, UpstreamProtocolError)  # broken framing: not migrated
            if rd.kv_failed is not None:
                return Status.KV_FAILED, rd.error, rd.kv_failed
            return self._ended(rd, resp)
        finally:
            if resp is not None:
                resp.close()
            series.inflight.dec()

    async def _read(self, rd: _Read, resp: HopResponse) -> None:
        """D's events into the buffer, each handled in the loop turn it arrives in (``Upstream.pipe``)."""
        reader = SSEReader()
        cap = self.settings.slow_reader_max_bytes
        first_filter = rd.f.first_filter

        def on_read(chunk: bytes) -> bool:
            batch = reader.feed_batch(chunk)
            while first_filter is not None and first_filter.pending:
                # Token 1 comes out of D's first event; the rest can then go out as a block.
                parts = batch.split_first()
                if parts is None:
                    break
                self._slow(rd, parts[0])
                if rd.stop:
                    return False
                batch = parts[1]
            if not self._fast(rd, batch):
                self._slow(rd, batch)
            if rd.stop:
                return False
            if len(reader.pending) > cap:
                rd.error = self.protocol_error(rd.worker, "sent an SSE event larger than the byte cap")
                rd.protocol = True
                return False
            return True

        await self.upstream.pipe("decode", rd.worker.url, resp, on_read)

    def _fast(self, rd: _Read, batch: Batch) -> bool:
        """The hot path: plain vLLM events (no error, [DONE] last) go out as one unparsed block; only the
        stream's first event is parsed. False: read event by event."""
        if not batch.plain or (rd.first and not batch.body):
            return False
        f, follower = rd.f, rd.follower
        if f.first_filter is not None and f.first_filter.pending:
            return False  # token 1 is still to take out of D's stream: event by event
        if batch.body:
            if rd.first:
                rd.first = False
                rd.error = self.first_event(f, rd.worker, batch.body[6 : batch.body.index(b"\n\n")])
                if rd.error is not None:
                    rd.protocol = rd.stop = True
                    return True
            if follower is not None:
                runs = follower.block_runs(batch.body, batch.body.count(b"\n\n"))
                if runs is None:
                    return False  # parse event by event (text mode, migrated, odd)
                follower.progress.add_runs(runs)
            rd.buffer.put(batch.body)
            if rd.usage:
                rd.last = last_data(batch.body)
        if batch.done:
            rd.done = rd.stop = True
            if rd.usage:
                self.note_stream_usage(f, rd.last)
        elif rd.buffer.closed:
            rd.stop = True
        return True

    def _slow(self, rd: _Read, batch: Batch) -> None:
        """Error events, the first event of a hop with P's KV, a migrated stream's replayed tokens."""
        f, worker, buffer = rd.f, rd.worker, rd.buffer
        for ev in batch.events():
            if ev.data == DONE_DATA:
                rd.done = True
                if f.request.include_usage:
                    self.note_stream_usage(f, rd.last)
                break
            rd.last = ev.data
            if rd.first:
                kv_exc = self.kv_hop_failed(worker, rd.body, ev.data)
                if kv_exc is not None:
                    rd.kv_failed, rd.error, rd.stop = kv_exc, ev.raw, True
                    return
                rd.first = False
                rd.error = self.first_event(f, worker, ev.data)
                if rd.error is not None:
                    rd.protocol = True
                    break
            if ev.data.startswith(b'{"error"'):
                # vLLM's in-band error event (the stream had started): a failed call.
                self.metrics.child(self.metrics.upstream_errors, worker.pool, worker.url, "error_event").inc()
                rd.error = ev.raw
                break
            if not self._put(rd, ev.data, ev.raw):
                break
        rd.stop = rd.done or rd.error is not None or buffer.closed or rd.mismatch

    def _put(self, rd: _Read, data: bytes, raw: bytes) -> bool:
        """One of D's chunks to the buffer; False when D's token 1 is not P's."""
        if rd.f.first_filter is not None and rd.f.first_filter.pending:
            data, raw = self._without_first(rd, data, raw)
            if not data:
                return not rd.mismatch  # nothing left but token 1, which the client has from P
        if rd.follower is not None:
            payload = rd.follower.event(data)
            if payload is None:
                return True  # only tokens the client already has
            if payload is not data:
                rd.buffer.put(data_event(payload))
                return True
        rd.buffer.put(raw)
        return True

    def _without_first(self, rd: _Read, data: bytes, raw: bytes) -> tuple[bytes, bytes]:
        """D's event without token 1, empty when nothing is left; ``rd.mismatch`` when it is not P's."""
        f = rd.f
        assert f.first_filter is not None
        out = f.first_filter.event(data)
        if out is None:
            return b"", b""
        if isinstance(out, Mismatch):
            log.warning("request %s: decode worker %s sent another first token than the prefill worker's "
                        "(%s)", f.record.engine_id, rd.worker.url, out.reason)
            rd.mismatch = True
            return b"", b""
        if out is data:
            return data, raw
        rd.last = out
        return out, data_event(out)

    def _ended(self, rd: _Read, resp: HopResponse) -> tuple[Status, bytes | None, UpstreamError | None]:
        f = rd.f
        if rd.mismatch:
            f.settled.set()
            return Status.MISMATCH, None, None
        if not rd.done and rd.error is None and not rd.buffer.closed:
            rd.error = self.protocol_error(rd.worker, "stream ended without [DONE]")
        f.settled.set()
        if rd.first and (rd.done or rd.error is not None):
            # The stream ended before any event: D answered, so it had the request.
            self.core.close_lease(f, "unknown" if rd.error is not None else "pulled")
        if rd.done and rd.error is None:
            resp.release()  # kept alive once its last chunk is in (``close`` would drop it)
            return Status.DONE, None, None
        if rd.buffer.closed:
            return Status.CLOSED, None, None
        return (Status.PROTOCOL if rd.protocol else Status.BROKEN), rd.error, rd.exc

    def kv_hop_failed(self, worker: Worker, body: dict[str, Any], data: bytes) -> UpstreamStatusError | None:
        """A server error as D's first event on a hop with P's KV: as ambiguous as a 5xx before it."""
        if not data.startswith(b'{"error"') or "kv_transfer_params" not in body:
            return None
        try:
            err = json.loads(data).get("error")
        except (ValueError, AttributeError):
            return None
        code = err.get("code") if isinstance(err, dict) else None
        status = code if isinstance(code, int) and not isinstance(code, bool) else 500
        if status < 500:
            return None
        self.metrics.child(self.metrics.upstream_errors, worker.pool, worker.url, "error_event").inc()
        return UpstreamStatusError("decode", worker.url, status, data, "application/json")

    def protocol_error(self, worker: Worker, reason: str) -> bytes:
        self.metrics.child(self.metrics.upstream_errors, worker.pool, worker.url, "protocol").inc()
        return UpstreamProtocolError("decode", worker.url, reason).sse_event()

    def note_stream_usage(self, f: Flight, data: bytes) -> None:
        """The usage chunk is the last event before ``[DONE]``: one parse per stream."""
        if b'"usage"' not in data:
            return
        try:
            chunk = parse_worker_json(data)
        except ValueError:
            return
        if isinstance(chunk, dict):
            self.core.note_usage(f, chunk.get("usage"))

    def first_event(self, f: Flight, worker: Worker, data: bytes) -> bytes | None:
        """D's first event: D certainly has the request (the KV was pulled); check the event."""
        if f.timing.first_token is None:
            f.timing.first_token = self.clock()
            self.metrics.stages["decode_first_token"].observe(
                f.timing.first_token - (f.timing.decode_start or f.timing.first_token))
        self.core.close_lease(f, "aborted" if f.record.is_aborted else "pulled")
        f.settled.set()
        if f.record.is_aborted:
            # vLLM drops an abort that came before the request, and D has it now: sent again at once.
            self.tracker.spawn(self.send_abort(worker, f.record.engine_id))
        return self.check_first_event(f, worker, data)

    def check_first_event(self, f: Flight, worker: Worker, data: bytes) -> bytes | None:
        try:
            chunk = parse_worker_json(data)
        except ValueError:
            return self.protocol_error(worker, "sent an event that is not JSON")
        if isinstance(chunk, dict) and "error" in chunk:
            return None
        mode = chunk.get("output_mode") if isinstance(chunk, dict) else None
        if mode != f.request.output_mode:
            return self.protocol_error(
                worker, f"answered output_mode {mode!r} for a {f.request.output_mode!r} request "
                "(a server that predates output_mode?)")
        return None
