"""Clean-up: free whatever a worker still holds for a request the walk did not finish, and release
(through a one-token decode) the KV a prefill worker holds for a request that will not decode."""

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
        task = f.release_task
        if task is None:
            task = self.tracker.spawn(self.release(f))
            f.releasing(task)
        return task

    async def release(self, f: Flight) -> None:
        """D decodes one token with P's params to free P's KV (aborting a finished P frees nothing)."""
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
                # A transient failure may pass on another try while P holds the blocks.
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
        """No retry follows ``e``: release the KV P still holds (the first call decides)."""
        if f.release_task is not None:
            return  # a release runs already: it ends the lease
        if isinstance(e, UpstreamStatusError) and e.passthrough:
            # D rejected the request up front and vLLM does not tell P: try the stripped-down release.
            if f.record.kv_params is not None and f.release_task is None:
                self.releasing(f)
            return
        # D may or may not have pulled: release through another decode worker when there is one.
        if f.record.kv_params is not None and f.release_task is None:
            failed = f.record.decode_worker
            others = [w for w in self.decode_pool if w is not failed]
            if others:
                f.decode_on(min(others, key=lambda w: w.inflight))
                self.releasing(f)
                return
        self.core.close_lease(f, "unknown")

    async def run(self, f: Flight) -> None:
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
            # A failed hop nobody awaits is known here; only a hop that crashed (a bug) after its client
            # was answered an abort is logged (type and frames, never the message).
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
        """PREFILLING: abort P until its hop ends; KV in a late reply is accepted, for the caller to free."""
        record = f.record
        await self.aborts.abort_until(record.prefill_worker, record.engine_id, task,
                                      self.settings.prefill_timeout)
        if not task.done():
            await asyncio.wait({task})  # its own timeout ends it; its reply may still hold KV
        if not task.cancelled() and task.exception() is None \
                and record.phase is Phase.PREFILLING and record.prefill_worker is not None:
            self.prefill.accept_reply(f, record.prefill_worker, task.result())

    async def _end_decode(self, f: Flight, task: asyncio.Future[Any]) -> None:
        """DECODING: abort D until it certainly had the request; only then may its connection close (else
        D might never pull and P hold the KV until its lease ends)."""
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
            # D failed a non-stream hop after the client left: P's KV is released.
            self.after_decode_error(f, error)
        if f.release_task is not None:
            await f.release_task  # it ends the lease (released through a decode worker, or not)
            return
        if record.lease is not None and record.lease.end is None and task.done():
            # The walk that closes it is gone: D answered, so it had the KV; else unknown.
            answered = not task.cancelled() and task.exception() is None
            self.core.close_lease(f, "aborted" if answered else "unknown")

    def forget(self, f: Flight) -> None:
        self.table.remove(f)
