"""Clean-up: free whatever a worker still holds for a request the walk did not finish, and release
(through a one-token decode) the KV a prefill worker holds for a request that will not decode.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from kv_transfer.handoff import (
    release_body,
)
from proxy.observe.state import Phase
from proxy.walk.aborts import Aborts
from proxy.walk.core import Core, Part
from proxy.walk.flight import Flight
from proxy.walk.prefill import Prefill
from proxy.wire.errors import (
    UpstreamError,
    UpstreamStatusError,
    log_unexpected,
)

log = logging.getLogger("pd_proxy")


class Cleanup(Part):
    def __init__(self, core: Core, aborts: Aborts, prefill: Prefill) -> None:
        super().__init__(core)
        self.aborts = aborts
        self.prefill = prefill

    async def release_shielded(self, f: Flight) -> None:
        if f.record.kv_params is None:
            return
        await asyncio.shield(self.releasing(f))

    def releasing(self, f: Flight) -> asyncio.Task[None]:
        """The release of P's KV for ``f`` (``release``), started once."""
        task = f.release_task
        if task is None:
            task = self.tracker.spawn(self.release(f))
            f.releasing(task)
        return task

    async def release(self, f: Flight) -> None:
        """Free the KV that P holds for an aborted request: send D the decode request with P's
        params, one token, and let it complete (D pulls, P frees; measured under 0.25 s on
        vLLM 0.32 CPU, where aborting P after it finished does nothing)."""
        record = f.record
        params = record.kv_params
        if params is None or f.lease_ran_out(self.leases):
            return  # nothing held, or P's own timer freed it (its lease ran out): no hop to send
        fallback = self.decode_pool.candidates() or self.decode_pool.workers
        worker = record.decode_worker or (fallback[0] if fallback else None)
        if worker is None:
            return  # no decode worker at all: the lease expires on P
        f.decode_on(worker)
        self.core.decoding(f)
        body = release_body(f.data, record.base_id, params)
        rt = self.pools
        attempts = max(2, rt.decode_retry.attempts)
        for attempt in range(attempts):
            try:
                await self.core.call(worker, self.upstream.post_generate(
                    "decode", worker.url, body, request_id=record.base_id,
                    total=self.settings.decode_timeout), f.trace.hop("kv_release", worker))
            except UpstreamError as e:
                log.warning("KV release for %s failed: %s", record.engine_id, e.message)
                if isinstance(e, UpstreamStatusError) and e.passthrough:
                    f.decode_refused(self.leases)  # D refused: the lease will expire on P
                    return
                # A 5xx, transport failure or timeout (seen: NIXL's first handshake with P timing
                # out on a loaded host) may pass on another try: while P still holds the blocks,
                # try again (on another decode worker when there is one; a repeated pull of
                # blocks already freed is harmless, the one token is thrown away).
                if attempt + 1 >= attempts or not self.core.lease_valid(f) or record.kv_params is None:
                    break
                await asyncio.sleep(rt.decode_retry.delay(attempt, rt.rng))
                others = self.decode_pool.admissible(exclude=(worker,))
                if others:
                    worker = min(others, key=lambda w: w.inflight)
                    f.decode_on(worker)
                continue
            self.core.close_lease(f, "aborted")
            return
        self.core.close_lease(f, "unknown")

    def after_decode_error(self, f: Flight, e: UpstreamError) -> None:
        """The decode hop failed with ``e`` (no retry follows): release the KV P still holds.
        Called where the failure is known (the handler, the stream's producer, the clean-up
        when the client had gone), once or more: the first call decides."""
        if f.release_task is not None:
            return  # a release runs already: it ends the lease
        if isinstance(e, UpstreamStatusError) and e.passthrough:
            # D rejected the request up front: vLLM does not tell P, so the blocks would wait
            # for the lease. Try the stripped-down release request (tokens mode, one token, no
            # stop strings or logprobs), which D may well accept; if not, the lease expires.
            if f.record.kv_params is not None and f.release_task is None:
                self.releasing(f)
            return
        # A 5xx, a transport failure or a timeout before D answered: D may or may not have
        # pulled. Release through another decode worker when there is one (a second pull of
        # already-freed blocks is harmless on vLLM: P only logs a warning).
        if f.record.kv_params is not None and f.release_task is None:
            failed = f.record.decode_worker
            others = [w for w in self.decode_pool if w is not failed]
            if others:
                f.decode_on(min(others, key=lambda w: w.inflight))
                self.releasing(f)
                return
        self.core.close_lease(f, "unknown")

    async def run(self, f: Flight) -> None:
        """Free whatever a worker still holds for a request the walk did not finish."""
        record = f.record
        try:
            if record.phase is Phase.PREFILLING and f.prefill_task is not None:
                await self._end_prefill(f, f.prefill_task)
            if record.phase is Phase.KV_HELD or (record.kv_params is not None and f.decode_task is None):
                await self.releasing(f)
            elif record.phase is Phase.DECODING and f.decode_task is not None:
                await self._end_decode(f, f.decode_task)
        finally:
            if f.force_end is not None:
                f.force_end.cancel()
            # A hop that failed after the handler left (the client aborted or went away) ended
            # its task and the headers future with an error nobody awaits: it is known here,
            # not worth asyncio's "exception was never retrieved" at collection. But a decode hop
            # that crashed (a bug, not a worker's failure) after its client was answered an abort
            # is seen nowhere else: logged (type and frames, never the message).
            task = f.decode_task
            if f.abandoned and task is not None and task.done() and not task.cancelled():
                error = task.exception()
                if error is not None and not isinstance(error, UpstreamError):
                    log_unexpected(error, "decoding a request whose client was answered an abort")
            for fut in (f.prefill_task, f.decode_task, f.headers_ready, f.release_task):
                if fut is not None and fut.done() and not fut.cancelled():
                    fut.exception()
            self.core.set_done(f)
            self.forget(f)

    async def _end_prefill(self, f: Flight, task: asyncio.Future[dict[str, Any]]) -> None:
        """PREFILLING: abort P until its hop ends; a reply that still came with KV is accepted
        (``KV_HELD``), so that the caller releases it."""
        record = f.record
        await self.aborts.abort_until(record.prefill_worker, record.engine_id, task,
                                      self.settings.prefill_timeout)
        if not task.done():
            await asyncio.wait({task})  # its own timeout ends it; its reply may still hold KV
        if not task.cancelled() and task.exception() is None \
                and record.phase is Phase.PREFILLING and record.prefill_worker is not None:
            self.prefill.accept_reply(f, record.prefill_worker, task.result())

    async def _end_decode(self, f: Flight, task: asyncio.Future[Any]) -> None:
        """DECODING: abort D until it certainly had the request (first event, or its answer);
        only then may its connection be closed (before that, closing could leave D never pulling
        and P holding the KV until its lease ends)."""
        record = f.record
        settle: asyncio.Task[Any] = asyncio.ensure_future(f.settled.wait())
        try:
            await self.aborts.abort_until(record.decode_worker, record.engine_id, settle,
                                          self.settings.decode_timeout)
        finally:
            settle.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if task.done() and not task.cancelled() and isinstance(error := task.exception(), UpstreamError):
            # D failed the hop after the client left (a non-stream hop: its handler is gone): as
            # with the client there, P's KV is released (``after_decode_error``).
            self.after_decode_error(f, error)
        if f.release_task is not None:
            await f.release_task  # it ends the lease (released through a decode worker, or not)
            return
        if record.lease is not None and record.lease.end is None and task.done():
            # The walk that closes it is gone (client left a non-stream decode, or a stream
            # before its first event): D answered, so it had the KV; else unknown.
            answered = not task.cancelled() and task.exception() is None
            self.core.close_lease(f, "aborted" if answered else "unknown")

    def forget(self, f: Flight) -> None:
        self.table.remove(f)
