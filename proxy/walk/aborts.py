"""Aborts (a client's call, a deadline, a disconnect, shutdown), each routed to whoever holds the
request now; unknown ids are broadcast to every worker (bounded)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from aiohttp import web

from proxy.config.tenants import Tenant
from proxy.observe.state import Phase
from proxy.pools import Overloaded
from proxy.sse.events import DONE_EVENT, comment_event, data_event
from proxy.sse.relay import event_stream
from proxy.walk.core import Core, Part
from proxy.walk.flight import Flight
from proxy.wire.errors import HTTPBadRequest
from proxy.wire.ids import abortable_id, upstream_id
from proxy.wire.protocol import JSONBodyError, compact_json, engine_request_id, loads_bounded
from proxy.wire.replies import abort_full_response, abort_stream_chunk

log = logging.getLogger("pd_proxy")


def abort_request_ids(body: bytes, *, limit: int) -> list[str]:
    """The ids an abort body names, as vLLM reads them, deduplicated; ``HTTPBadRequest`` (vLLM's 400s)
    for a body that is not JSON, has no ``request_ids``, or names more than ``limit``."""
    try:
        obj = loads_bounded(body)  # deep nesting or huge ints are a 400, not a 500
    except JSONBodyError as e:
        raise HTTPBadRequest(f"JSON decode error: {e.detail}") from None
    ids = obj.get("request_ids") if isinstance(obj, dict) else None
    if ids is None:
        raise HTTPBadRequest("Missing 'request_ids' in request body")
    if isinstance(ids, str):
        ids = [ids]
    if not isinstance(ids, list):
        return []
    unique = list(dict.fromkeys(i for i in ids if isinstance(i, str)))
    if len(unique) > limit:
        raise HTTPBadRequest(f"at most {limit} distinct request ids per abort call, got {len(unique)}",
                             param="request_ids")
    return unique


def abort_events(f: Flight) -> bytes:
    """vLLM's abort chunk of each choice of ``f``'s stream."""
    req, rid = f.request, engine_request_id(f.client_id)
    return b"".join(data_event(compact_json(abort_stream_chunk(rid, req.output_mode, i)))
                    for i in range(req.sampling_params.n))


def stream_tail(request: web.Request, f: Flight, now: float, events: bytes) -> bytes:
    """The last bytes of a client's stream: ``events``, the Server-Timing comment if asked, ``[DONE]``."""
    tail = [events] if events else []
    if request.headers.get("X-PD-Timing") == "1":
        tail.append(comment_event("server-timing " + f.timing.header(now)))
    tail.append(DONE_EVENT)
    return b"".join(tail)


async def end_stream(request: web.Request, resp: web.StreamResponse, f: Flight, now: float,
                     events: bytes) -> None:
    """End a client's stream after ``events``, with its EOF in the same write."""
    with contextlib.suppress(ConnectionResetError):  # the client is gone: nothing to tell
        await resp.write_eof(stream_tail(request, f, now, events))


class Aborts(Part):
    def __init__(self, core: Core) -> None:
        super().__init__(core)
        self._broadcast_slots = asyncio.Semaphore(core.settings.abort_broadcast_concurrency)
        self._broadcasts_pending = 0

    def abort(self, f: Flight, source: str) -> None:
        record = f.record
        if not self.core.note_abort(f, source):
            return
        if record.phase is Phase.PREFILLING and record.prefill_worker is not None:
            task = f.prefill_task
            if task is not None and not task.done():
                self.tracker.spawn(self.abort_until(record.prefill_worker, record.engine_id,
                                                     task, self.settings.prefill_timeout))
            else:
                self.tracker.spawn(self.send_abort(record.prefill_worker, record.engine_id))
        elif record.phase is Phase.DECODING and record.decode_worker is not None:
            if f.decode_task is not None:
                self.tracker.spawn(self.abort_until(record.decode_worker, record.engine_id,
                                                     f.decode_task, self.settings.decode_timeout))
            else:
                self.tracker.spawn(self.send_abort(record.decode_worker, record.engine_id))
            if f.buffer is not None:
                loop = asyncio.get_running_loop()
                f.force_end_at(loop.call_later(self.settings.abort_grace, self.force_end, f))

    def force_end(self, f: Flight) -> None:
        """D did not end an aborted stream in time: end the client's stream as vLLM would."""
        buffer = f.buffer
        if buffer is None or buffer.closed:
            return
        for index in range(f.request.sampling_params.n):
            chunk = compact_json(abort_stream_chunk(f.record.engine_id, f.request.output_mode, index))
            buffer.put(data_event(chunk))
        buffer.finish(done=True)

    async def broadcast_abort(self, request_ids: list[str]) -> None:
        async with self._broadcast_slots:  # bounded fan-outs at once (``abort_broadcast_concurrency``)
            workers = [*self.prefill_pool, *self.decode_pool]
            results = await asyncio.gather(
                *(self.upstream.abort(w.url, request_ids, limit=self.settings.control_timeout)
                  for w in workers))
        for w, ok in zip(workers, results, strict=True):
            self.metrics.child(self.metrics.abort_fanout, w.pool, "ok" if ok else "error").inc()

    def abort_ids(self, tenant: Tenant, request_ids: list[str]) -> None:
        """Abort the caller's own requests by their client ids. Unknown ids, namespaced as the tenant's,
        go to every worker; raises ``Overloaded`` when ``abort_broadcast_queue`` fan-outs wait already."""
        unknown: list[str] = []
        for rid in request_ids:
            client_id = abortable_id(rid)
            if client_id is None:
                continue  # vLLM accepts it and aborts nothing
            engine_id = engine_request_id(upstream_id(tenant.tag, client_id))
            flights = self.table.entries(engine_id)
            if not flights:
                unknown.append(engine_id)
            for f in flights:
                self.abort(f, "client_call")
        if unknown:
            self.metrics.child(self.metrics.aborts, "client_call", "unknown").inc(len(unknown))
        if unknown and self.settings.abort_unknown_broadcast:
            if self._broadcasts_pending >= self.settings.abort_broadcast_queue:
                raise Overloaded("too many abort broadcasts are waiting", retry_after=1.0,
                                 reason="queue_full")
            self._broadcasts_pending += 1
            task = self.tracker.spawn(self.broadcast_abort(unknown))
            task.add_done_callback(self._broadcast_done)

    def _broadcast_done(self, _: object) -> None:
        self._broadcasts_pending -= 1

    async def hop_or_abandon(self, f: Flight, fut: asyncio.Future[Any]) -> bool:
        """Wait for a decode hop without cancelling it. False (the flight ``abandoned``) when the request
        was aborted and the hop did not end within ``abort_grace``: the clean-up keeps aborting it."""
        record = f.record
        if not fut.done() and not record.is_aborted:
            # Callbacks rather than a task waiting on ``record.aborted``: this runs per request.
            woken: asyncio.Future[None] = self.tracker.loop.create_future()

            def wake(_: object = None) -> None:
                if not woken.done():
                    woken.set_result(None)

            fut.add_done_callback(wake)
            record.on_abort.append(wake)
            try:
                await woken
            finally:
                fut.remove_done_callback(wake)
                with contextlib.suppress(ValueError):  # already called (and dropped) on abort
                    record.on_abort.remove(wake)
        if not fut.done():
            await asyncio.wait({fut}, timeout=self.settings.abort_grace)
            if not fut.done():
                f.abandon()
        return fut.done()

    async def respond_aborted(self, request: web.Request, f: Flight, *,
                               done: bool = True) -> web.StreamResponse:
        """What vLLM sends a client aborted before anything was produced. ``done=False``: a worker still
        holds the request."""
        if done:
            self.core.set_done(f)
        req, rid = f.request, engine_request_id(f.client_id)
        prompt_tokens = len(req.token_ids)
        if not req.is_stream:
            raw, headers = self.aborted_full(f)
            return web.Response(body=raw, content_type="application/json", headers=headers)
        resp = event_stream(request, f.headers, headers_with_first_write=True)
        await resp.prepare(request)
        out = [abort_events(f)]
        if req.include_usage:
            usage = {"request_id": rid, "usage": {"prompt_tokens": prompt_tokens,
                     "total_tokens": prompt_tokens, "completion_tokens": 0},
                     "output_mode": req.output_mode, "choices": []}
            out.append(data_event(compact_json(usage)))
        await end_stream(request, resp, f, self.clock(), b"".join(out))
        return resp

    def aborted_full(self, f: Flight) -> tuple[bytes, dict[str, str]]:
        """What vLLM answers a non-stream request aborted before it produced anything."""
        req = f.request
        body = abort_full_response(engine_request_id(f.client_id), model=req.model, created=int(time.time()),
                                   prompt_tokens=len(req.token_ids), output_mode=req.output_mode,
                                   n=req.sampling_params.n)
        headers = dict(f.headers)
        headers["Server-Timing"] = f.timing.header(self.clock())
        return compact_json(body), headers

    def deadline_passed(self, f: Flight) -> None:
        if f.record.phase is not Phase.DONE:
            self.abort(f, "deadline")
