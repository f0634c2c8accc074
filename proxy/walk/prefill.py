"""The prefill hop: pick a prefill worker, send the hop (retried on another after a transient
failure) and accept P's reply; and the prefill of a migrated stream's continuation."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from kv_transfer.handoff import (
    check_prefill_params,
    prefill_body,
)
from proxy.fleet import is_transient
from proxy.observe.state import outlive
from proxy.pools import (
    DeadlineExceeded,
    NoWorkerAvailable,
    Outcome,
    Overloaded,
    PickContext,
    PickNote,
    Worker,
    hop_budget,
)
from proxy.walk.core import Core, Part
from proxy.walk.flight import Flight
from proxy.wire.errors import (
    UpstreamError,
    UpstreamProtocolError,
    UpstreamStatusError,
    UpstreamTimeout,
)

log = logging.getLogger("pd_proxy")


class Prefill(Part):
    def __init__(self, core: Core) -> None:
        super().__init__(core)
        self._well_formed: object = None

    def _params_problem(self, params: object) -> str | None:
        if params is self._well_formed and params is not None:
            return None
        reason = check_prefill_params(params)
        if reason is None:
            self._well_formed = params
        return reason

    async def with_retries(
            self, f: Flight) -> tuple[Worker | None, dict[str, Any], UpstreamError | None]:
        """Retried on another prefill worker after a transient failure; no worker, no error: the bypass."""
        record, rt = f.record, self.pools
        note = PickNote()
        ctx = PickContext(token_ids=f.ctx.token_ids, session_id=f.ctx.session_id, note=note)
        tried: list[Worker] = []
        last: UpstreamError | None = None
        for attempt in range(rt.prefill_retry.attempts):
            try:
                worker = await self._pick(f, ctx, tried)
            except NoWorkerAvailable:
                if rt.settings.bypass_when_prefill_unavailable:
                    # None left: nothing usable is held, so the decode worker computes the prompt.
                    f.prefill_on(None)
                    return None, {}, None
                if last is not None:
                    break  # none left: the last error stands
                raise
            if worker is None:
                break  # aborted (client call, deadline) during the backoff or the wait for a worker
            f.prefill_on(worker, note.describe() if note.rule else None)
            try:
                task = self._send(f, worker)
                f.prefill_started(task)
                reply: dict[str, Any] = await outlive(task)
            except UpstreamError as e:
                last, retry_ok = e, is_transient(e)
            else:
                unusable = self._unusable(f, worker, reply, tried,
                                          last_attempt=attempt + 1 >= rt.prefill_retry.attempts)
                if unusable is None:
                    rt.kv_outcome(note, reply)
                    return worker, reply, None  # _walk checks it (and applies --prefill-failure)
                if not unusable:
                    f.prefill_on(None)  # none left to try: decode-only
                    return None, {}, None
                last, retry_ok = UpstreamProtocolError("prefill", worker.url, unusable), True
            tried.append(worker)
            if not retry_ok or not await self._backoff(f, attempt, last):
                break
        return record.prefill_worker, {}, last

    def _unusable(self, f: Flight, worker: Worker, reply: dict[str, Any], tried: list[Worker], *,
                  last_attempt: bool) -> str | None:
        """A 200 from P. None: the walk takes it. An unusable 200 holds nothing the proxy can free, so
        another prefill worker may take the request: why, or "" when none is left."""
        reason = self._params_problem(reply.get("kv_transfer_params"))
        if reason is None or f.record.is_aborted or self.note_worker_abort(f, reply) or last_attempt:
            return None  # the usual case: no pass over the pool for the untried workers
        bypass = self.pools.settings.bypass_when_prefill_unavailable
        untried = [w for w in self.prefill_pool.admissible() if w is not worker and w not in tried]
        if not (untried or bypass):
            return None
        self.metrics.prefill_missing_kv.inc()
        return reason if untried else ""

    async def _backoff(self, f: Flight, attempt: int, last: UpstreamError) -> bool:
        """False when there is no next attempt (aborted, attempts spent, or the deadline comes first)."""
        rt = self.pools
        if f.record.is_aborted or attempt + 1 >= rt.prefill_retry.attempts:
            return False
        pause = rt.prefill_retry.delay(attempt, rt.rng)
        if f.deadline is not None and f.deadline.remaining() <= pause:
            return False
        rt.count_retry("prefill")
        log.warning("request %s: retrying prefill after %s", f.record.engine_id, last.message)
        await asyncio.sleep(pause)
        return True

    async def _pick(self, f: Flight, ctx: PickContext, tried: list[Worker]) -> Worker | None:
        """An untried prefill worker (any once all failed) that can take the prompt; None when aborted."""
        if f.record.is_aborted:
            return None
        left_out = [*self.pairless(), *self.pools.prefill_too_short(len(ctx.token_ids))]
        try:
            worker = await self.prefill_pool.acquire(ctx, exclude=[*tried, *left_out],
                                                     limit=self.core.queue_limit(f))
        except NoWorkerAvailable:
            if not tried:
                raise
            worker = await self.prefill_pool.acquire(ctx, exclude=left_out, limit=self.core.queue_limit(f))
        if f.record.is_aborted:
            self.prefill_pool.release(worker, Outcome.NEUTRAL)
            return None
        return worker

    def _limit(self, f: Flight, worker: Worker) -> float:
        try:
            return hop_budget(f.deadline, "prefill", self.settings.prefill_timeout,
                              self.pools.settings.deadline_prefill_share)
        except DeadlineExceeded:
            self.prefill_pool.release(worker, Outcome.NEUTRAL)
            raise

    def _send(self, f: Flight, worker: Worker) -> asyncio.Task[dict[str, Any]]:
        """A tracked task: it outlives the handler, which aiohttp cancels when the client goes away."""
        limit = self._limit(f, worker)
        task: asyncio.Task[dict[str, Any]] = self.tracker.spawn(self.hop(f, worker, limit))
        return task

    async def hop(self, f: Flight, worker: Worker, limit: float) -> dict[str, Any]:
        """At ``limit`` P is sent an abort, not cut off, so KV it finished with is taken, not left on P."""
        body = prefill_body(f.data, f.record.base_id, stream=f.request.is_stream,
                            keep_stop=not self.settings.prefill_tokens_only, first_token=f.first_token)
        outcome = Outcome.NEUTRAL
        late, aborted = self._abort_at(limit, f, worker)
        timed_out = False
        f.prefill_hop_sent(self.clock())  # P may start its KV lease once it has the request
        try:
            reply: dict[str, Any] = (await self.core.call(worker, self.upstream.post_generate_raw(
                "prefill", worker.url, body, request_id=f.record.base_id,
                total=limit + self.settings.abort_grace), f.trace.hop("prefill", worker)))[0]
            # Unusable KV params are P's failure; a refused pull is judged at the hand-off.
            if self._params_problem(reply.get("kv_transfer_params")) is not None:
                # P's failure, unless the request's own abort or deadline cut it short.
                cut_short = f.record.is_aborted or (bool(aborted) and limit < self.settings.prefill_timeout)
                outcome = Outcome.NEUTRAL if cut_short else Outcome.FAILURE
                timed_out = bool(aborted) and not f.record.is_aborted
        except UpstreamStatusError as e:
            outcome = Outcome.NEUTRAL if e.passthrough else Outcome.FAILURE
            raise
        except UpstreamError:
            outcome = Outcome.FAILURE
            raise
        finally:
            late.cancel()
            self.prefill_pool.release(worker, outcome)
        if timed_out:
            raise UpstreamTimeout("prefill", worker.url, "timed out before answering")
        return reply

    def _abort_at(self, limit: float, f: Flight,
                  worker: Worker) -> tuple[asyncio.TimerHandle, list[asyncio.Task[bool]]]:
        """At ``limit`` ``worker`` is sent an abort; returns the timer and the abort's task once sent."""
        aborted: list[asyncio.Task[bool]] = []
        late = self.tracker.loop.call_later(
            limit, lambda: aborted.append(self.tracker.spawn(self.send_abort(worker, f.record.engine_id))))
        return late, aborted

    def pairless(self) -> list[Worker]:
        """Prefill workers whose every pair failed the preflight, left out of prefill picks."""
        preflight = self.pools.preflight
        if preflight.check is None:
            return []
        decoders = self.decode_pool.admissible()
        return [p for p in self.prefill_pool.admissible() if preflight.all_failed(p, decoders)]

    def accept_reply(self, f: Flight, prefill: Worker,
                              reply: dict[str, Any]) -> tuple[dict[str, Any] | None, UpstreamError | None]:
        """On success the KV is held under a lease. No params and no error: the lease ran out first."""
        record = f.record
        params = reply.get("kv_transfer_params")
        reason = self._params_problem(params)
        if reason is None and isinstance(params, dict):
            f.kv_held(self.leases, prefill.url, self.core.rewrite_remote_host(params, prefill.url))
        self.note_worker_abort(f, reply)
        if reason is not None:
            if not record.is_aborted:
                self.metrics.prefill_missing_kv.inc()
            return None, UpstreamProtocolError("prefill", prefill.url, reason)
        return record.kv_params, None

    def note_worker_abort(self, f: Flight, reply: dict[str, Any]) -> bool:
        """P aborted the request, not at this proxy's call: the client's abort came another way."""
        choices = reply.get("choices")
        finish = choices[0].get("finish_reason") if isinstance(choices, list) and choices and \
            isinstance(choices[0], dict) else None
        if finish != "abort":
            return False
        self.core.note_abort(f, "worker")
        return True

    async def continuation(self, f: Flight, body: dict[str, Any]) -> dict[str, Any]:
        """A long continuation is prefilled on a prefill worker; a short or failed one is computed by D."""
        rt, record = self.pools, f.record
        if len(body["token_ids"]) < rt.settings.migrate_prefill_tokens or record.is_aborted:
            return body
        try:
            p = await self.prefill_pool.acquire(PickContext(token_ids=body["token_ids"]), limit=0.0)
        except (NoWorkerAvailable, Overloaded):
            return body
        limit = self.settings.prefill_timeout if f.deadline is None else \
            min(self.settings.prefill_timeout, max(0.0, f.deadline.remaining()))
        outcome = Outcome.FAILURE
        # As in ``hop``: at ``limit`` P is sent an abort, not cut off.
        late, aborted = self._abort_at(limit, f, p)
        sent = self.clock()  # P may start its KV lease once it has the request
        try:
            reply = await self.core.call(p, self.upstream.post_generate(
                "prefill", p.url, prefill_body(body, record.base_id, stream=f.request.is_stream,
                             keep_stop=not self.settings.prefill_tokens_only),
                request_id=record.base_id, total=limit + self.settings.abort_grace),
                f.trace.hop("prefill", p))
            params = reply.get("kv_transfer_params")
            if check_prefill_params(params) is not None or not isinstance(params, dict):
                params = None
            # aborted at a limit the request's deadline made shorter than P's own: not P's fault
            outcome = Outcome.SUCCESS if params is not None or not aborted else \
                Outcome.NEUTRAL if limit < self.settings.prefill_timeout else Outcome.FAILURE
        except UpstreamError as e:
            log.warning("request %s: continuation prefill failed: %s", record.engine_id, e.message)
            return body
        finally:
            late.cancel()
            self.prefill_pool.release(p, outcome)
        if params is None:
            if aborted:
                log.warning("request %s: continuation prefill timed out on %s", record.engine_id, p.url)
            return body
        params = self.core.rewrite_remote_host(params, p.url)
        if not f.continuation_kv(self.leases, p, params, sent):
            return body  # P's lease ran out before its answer came: D computes the continuation
        return {**body, "kv_transfer_params": params}
