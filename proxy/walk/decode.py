"""The decode attempts of one request: which worker next, whether a failure may be retried (with
P's KV while its lease holds, else decode-only), the last rescue, whose breaker a failure hits."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from proxy.fleet import is_transient
from proxy.pools import NoWorkerAvailable, Outcome, Overloaded, Worker
from proxy.walk.core import Core, Part
from proxy.walk.flight import Flight
from proxy.wire.errors import (
    UpstreamError,
    UpstreamStatusError,
)

log = logging.getLogger("pd_proxy")


class DecodeEngine(Part):
    def __init__(self, core: Core) -> None:
        super().__init__(core)

    async def acquire(self, f: Flight, tried: list[Worker]) -> Worker:
        """Not one already tried; with the preflight on and KV to hand off, one whose pair with P passed."""
        rt, record = self.pools, f.record
        excluded = list(tried)
        prefill = record.prefill_worker
        if rt.preflight.check is not None and prefill is not None and record.kv_params is not None:
            candidates = self.decode_pool.candidates(excluded)
            usable = await rt.preflight.usable_decoders(prefill, candidates, rt.settings.preflight_timeout)
            excluded += [w for w in candidates if all(w is not u for u in usable)]
        # A decode pick waits for a circuit about to let requests in (the prefill is done); a prefill never.
        return await self.decode_pool.acquire(f.ctx, exclude=excluded, limit=self.core.queue_limit(f),
                                              wait_recovering=not tried)

    def limit(self, f: Flight) -> float:
        """At the deadline the request is aborted and D answers with what it has, hence the grace."""
        cap = self.settings.decode_timeout
        if f.deadline is None:
            return cap
        return min(cap, max(0.0, f.deadline.remaining()) + self.settings.abort_grace)

    def may_retry(self, f: Flight, e: UpstreamError) -> bool:
        """Before D's first byte a 5xx, connect error or timeout may go to another decode worker."""
        return not f.record.is_aborted and is_transient(e) and (
            f.deadline is None or not f.deadline.expired)

    async def next_decode(self, f: Flight, body: dict[str, Any], tried: list[Worker], attempt: int,
                           error: UpstreamError) -> tuple[Worker, dict[str, Any]]:
        rt = self.pools
        await asyncio.sleep(rt.decode_retry.delay(attempt, rt.rng))
        try:
            try:
                w = await self.acquire(f, tried)
            except NoWorkerAvailable:
                w = await self.acquire(f, [])  # every admitted worker failed once: any again
        except (NoWorkerAvailable, Overloaded):
            raise error from None
        f.decode_on(w)
        rt.count_retry("decode")
        log.warning("request %s: retrying decode on %s after %s", f.record.engine_id, w.url, error.message)
        if "kv_transfer_params" not in body or (attempt == 0 and self.core.lease_valid(f)):
            return w, body  # decode-only already, or the same KV (P still holds it under the lease)
        self.core.decode_only(f, "decode_retry")
        return w, without_kv(body)

    @staticmethod
    def kv_ambiguous(e: UpstreamError, body: dict[str, Any]) -> bool:
        """A 5xx on a decode hop that carried P's KV params: D broke, or its pull from P failed."""
        return isinstance(e, UpstreamStatusError) and e.upstream_status >= 500 \
            and "kv_transfer_params" in body

    def may_rescue(self, f: Flight, e: UpstreamError, body: dict[str, Any]) -> bool:
        """One more, decode-only, once the KV retries are spent on an ambiguous failure."""
        return self.pools.decode_retry.attempts > 1 and self.kv_ambiguous(e, body) \
            and self.may_retry(f, e)

    async def rescue(self, f: Flight, error: UpstreamError,
                     body: dict[str, Any]) -> tuple[Worker, dict[str, Any]]:
        """The last attempt, decode-only on any decode worker; raises ``error`` if there is none."""
        try:
            w = await self.acquire(f, [])
        except (NoWorkerAvailable, Overloaded):
            raise error from None
        f.decode_on(w)
        self.pools.count_retry("decode")
        log.warning("request %s: decode-only on %s after its KV failed: %s", f.record.engine_id, w.url,
                    error.message)
        self.core.decode_only(f, "decode_retry")
        return w, without_kv(body)

    def attribute_failure(self, f: Flight, w: Worker, body: dict[str, Any], e: UpstreamError, *,
                                  outcome: Outcome, suspect: Worker | None,
                                  retry_with_kv: bool) -> tuple[Outcome, Worker | None]:
        """Whose breaker a failure before D's first byte counts on, and the decode worker still suspect.
        A 5xx on a hop with P's KV is ambiguous: NEUTRAL on D when a retry on the same KV can settle it,
        else P's failure (opening decode circuits for P's fault could stop all traffic)."""
        if outcome is not Outcome.FAILURE or not self.kv_ambiguous(e, body) \
                or f.record.prefill_worker is None:
            return outcome, None
        if suspect is not None and suspect is not w:
            self.blame(f.record.prefill_worker, f, "two decode workers failed its KV")
            return Outcome.NEUTRAL, None
        if suspect is None and retry_with_kv and self.core.lease_valid(f) \
                and self.decode_pool.admissible(exclude=(w,)):
            return Outcome.NEUTRAL, w
        self.blame(f.record.prefill_worker, f, "a decode worker failed its KV, no other to settle it")
        return Outcome.NEUTRAL, None

    def handoff_done(self, f: Flight, body: dict[str, Any], suspect: Worker | None) -> None:
        """With P's KV the hand-off worked; a decode worker ambiguous on the same KV gets the blame now."""
        if "kv_transfer_params" not in body:
            return
        prefill = f.record.prefill_worker
        if prefill is not None:
            prefill.breaker.record_success()
        if suspect is not None:
            self.blame(suspect, f, "another decode worker served the same KV")

    def blame(self, worker: Worker | None, f: Flight, why: str) -> None:
        if worker is None:
            return
        log.warning("request %s: failure counted on %s worker %s (%s)", f.record.engine_id,
                    worker.pool, worker.url, why)
        worker.breaker.record_failure()


def without_kv(body: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k != "kv_transfer_params"}


class DecodeAttempts:
    """One request's decode attempts, for the non-stream and the streamed decode alike."""

    __slots__ = ("attempt", "body", "engine", "f", "first_body", "rescued", "suspect", "tried", "worker")

    def __init__(self, engine: DecodeEngine, f: Flight, worker: Worker, body: dict[str, Any]) -> None:
        self.engine, self.f = engine, f
        self.worker, self.body, self.first_body = worker, body, body
        self.tried: list[Worker] = []
        self.attempt = 0
        self.rescued = False
        self.suspect: Worker | None = None

    def failed(self, e: UpstreamError, outcome: Outcome) -> Outcome:
        """The outcome the worker's breaker gets for a failure before D's first byte."""
        engine = self.engine
        retry = self.attempt + 1 < engine.pools.decode_retry.attempts and engine.may_retry(self.f, e)
        outcome, self.suspect = engine.attribute_failure(
            self.f, self.worker, self.body, e, outcome=outcome, suspect=self.suspect,
            retry_with_kv=retry and self.attempt == 0)
        return outcome

    def answered(self) -> None:
        if self.body is self.first_body:
            self.engine.handoff_done(self.f, self.body, self.suspect)
        else:
            self.suspect = None

    async def next(self, e: UpstreamError) -> bool:
        """On to a retry or the decode-only rescue; False when neither follows; raises ``e`` if no worker."""
        engine, f = self.engine, self.f
        if self.attempt + 1 < engine.pools.decode_retry.attempts and engine.may_retry(f, e):
            self.tried.append(self.worker)
            self.worker, self.body = await engine.next_decode(f, self.first_body, self.tried, self.attempt, e)
        elif not self.rescued and engine.may_rescue(f, e, self.body):
            self.rescued = True
            self.tried.append(self.worker)
            self.worker, self.body = await engine.rescue(f, e, self.first_body)
        else:
            return False
        self.attempt += 1
        return True

    def move(self, worker: Worker, body: dict[str, Any]) -> None:
        """A stream migrated: the attempts start over from ``body`` on ``worker``, never the first body,
        whose tokens the client has."""
        self.worker, self.body, self.first_body = worker, body, body
        self.attempt = 0
        self.rescued = False
        self.suspect = None
