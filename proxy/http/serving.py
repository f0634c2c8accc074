"""The request walk: validate, admit, prefill, hand off, decode; every other step is a part.

No upstream hop is cut when the client goes away: the hops run in tracked tasks the handler awaits
without cancelling them, and the clean-up (``proxy.walk.cleanup``) takes them over, so whatever a
worker holds for the request is freed whatever state the walk was in."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web

from kv_transfer.handoff import (
    decode_body,
)
from proxy.config.logs import ACCESS_LOG, log_access
from proxy.config.settings import ProxySettings
from proxy.config.tenants import OPEN, Tenant
from proxy.fleet import handoff_check
from proxy.fleet.health import http_fetch
from proxy.http.limits import request_body
from proxy.observe.metrics import ProxyMetrics
from proxy.observe.state import Phase, RequestRecord
from proxy.observe.tracing import DISABLED as TRACING_DISABLED
from proxy.observe.tracing import Tracing
from proxy.pools import Deadline, NoWorkerAvailable, Outcome, Overloaded, Worker
from proxy.stream.answer import StreamDecode
from proxy.stream.first_stream import FirstStream
from proxy.upstream.client import Upstream
from proxy.walk.aborts import Aborts
from proxy.walk.cleanup import Cleanup
from proxy.walk.core import Core
from proxy.walk.decode import DecodeEngine
from proxy.walk.flight import Flight, Timing
from proxy.walk.full import FullDecode
from proxy.walk.prefill import Prefill
from proxy.walk.validation import Validation
from proxy.wire.errors import (
    ClientError,
    ProxyError,
    UpstreamError,
    UpstreamStatusError,
    UpstreamTimeout,
)
from proxy.wire.ids import Rewrite, client_request_id, new_client_id, upstream_id
from proxy.wire.large_body import LARGE_BODY_BYTES
from proxy.wire.protocol import GenerateRequest, engine_request_id

log = logging.getLogger("pd_proxy")


class Serving:
    def __init__(self, settings: ProxySettings, metrics: ProxyMetrics,
                 clock: Callable[[], float] = time.monotonic, *,
                 tracing: Tracing = TRACING_DISABLED) -> None:
        core = self.core = Core(settings, metrics, clock, tracing=tracing)
        self.settings, self.metrics, self.clock, self.tracing = settings, metrics, clock, tracing
        self.pools, self.prefill_pool, self.decode_pool = core.pools, core.prefill_pool, core.decode_pool
        self.leases, self.table, self.tracker = core.leases, core.table, core.tracker
        self.stream_budget = core.stream_budget
        self.validation = Validation(settings)
        self.aborts = Aborts(core)
        self.prefill = Prefill(core)
        self.cleanup = Cleanup(core, self.aborts, self.prefill)
        self.engine = DecodeEngine(core)
        self.full = FullDecode(core, self.engine, self.aborts, self.cleanup)
        self.stream = StreamDecode(core, self.engine, self.aborts, self.cleanup, self.prefill)
        self.first = FirstStream(core, self.cleanup)
        # what the app calls
        self.attach = core.attach
        self.expire_leases = core.expire_leases
        self.abort = self.aborts.abort
        self.abort_ids = self.aborts.abort_ids
        self.broadcast_abort = self.aborts.broadcast_abort

    @property
    def upstream(self) -> Upstream:
        return self.core.upstream

    @property
    def draining(self) -> bool:
        return self.core.draining

    @draining.setter
    def draining(self, value: bool) -> None:
        self.core.draining = value

    async def start_pools(self) -> None:
        """Start the pools' background work on the upstream session."""
        check = handoff_check(self.upstream, block_size=self.pools.blocks.pair,
                              timeout=self.settings.pools.preflight_timeout,
                              rewrite=self.core.rewrite_remote_host)
        key = self.settings.upstream_api_key
        await self.pools.start(self.upstream.session, check,
                               upstream_headers={"Authorization": f"Bearer {key}"} if key else None)
        if (interval := self.settings.local_prefill_interval) > 0:
            fetch = http_fetch(self.upstream.session, self.settings.pools.health_timeout)
            self.pools.spawn(self.core.local_prefill.run(fetch, interval), "decode-local-prefill")

    async def generate(self, request: web.Request, tenant: Tenant = OPEN) -> web.StreamResponse:
        """One generate call; errors are raised for the app's error middleware to answer."""
        t0 = self.clock()
        body = await request_body(request)
        return await self.generate_body(request, body, request.headers.get("Content-Type", ""), t0,
                                        tenant=tenant)

    async def generate_body(self, request: web.Request, body: bytes | bytearray, content_type: str,
                            t0: float, *, tenant: Tenant = OPEN,
                            client_id: str | None = None) -> web.StreamResponse:
        """The walk of a generate body read already (``generate``; the OpenAI routes'
        rendered request, ``proxy.openai``). ``client_id``: the id the client knows the request by,
        in place of the header's or the body's."""
        try:
            if len(body) > LARGE_BODY_BYTES:
                req, data = await self.validation.validate_large(body, content_type)
            else:
                req, data = self.validation.validate(body if type(body) is bytes else bytes(body),
                                                     content_type)
            if client_id is None:
                client_id = client_request_id(request.headers.get("X-Request-Id"), req.request_id)
        except ClientError as e:
            if ACCESS_LOG.isEnabledFor(logging.INFO):
                log_access({"request_id": request.headers.get("X-Request-Id"), "outcome": "client_error",
                            "status": e.status, "total_ms": round((self.clock() - t0) * 1000.0, 3)},
                           self.settings.log_format)
            raise
        deadline = self.pools.deadline(request.headers)
        try:
            await self.pools.admission.acquire(None if deadline is None else max(0.0, deadline.remaining()))
        except Overloaded:
            self.pools.count_rejection()
            raise
        try:
            return await self._admitted(request, t0, req, data, deadline, tenant=tenant,
                                        client_id=client_id if client_id is not None else new_client_id())
        finally:
            self.pools.admission.release()

    async def _admitted(self, request: web.Request, t0: float, req: GenerateRequest, data: dict[str, Any],
                        deadline: Deadline | None, *, client_id: str, tenant: Tenant) -> web.StreamResponse:
        base_id = upstream_id(tenant.tag, client_id)
        record = RequestRecord(base_id, engine_request_id(base_id), stream=req.is_stream)
        flight = Flight(record, req, data, Timing(t0), deadline=deadline, client_id=client_id,
                        rewrite=Rewrite.for_ids(base_id, client_id), tenant=tenant)
        flight.headers["X-Request-Id"] = client_id
        flight.trace = self.tracing.start(request.headers, client_id, t0)
        self.table.add(flight)
        outcome, status = "aborted", 499  # 499: the client went away (no response sent)
        timer = None if deadline is None else asyncio.get_running_loop().call_later(
            max(0.0, deadline.remaining()), self.aborts.deadline_passed, flight)
        try:
            response = await self._walk(request, flight)
        except ProxyError as e:
            self.core.set_done(flight)
            if isinstance(e, UpstreamError):
                # Ids, workers and reasons only: never prompts or generated text.
                log.warning("request %s failed: %s", record.engine_id, e.message)
            if isinstance(e, Overloaded):
                self.pools.count_rejection()
            outcome, status = e.outcome, e.status
            e.headers = flight.headers
            raise
        except (asyncio.CancelledError, ConnectionResetError):
            # The handler is cancelled (or a write fails) when the client went away.
            self.core.note_gone(flight)
            raise
        except Exception:  # a bug: the client gets a generic 500 (``errors.answer_error`` logs it)
            outcome, status = "internal_error", 500
            self.metrics.outcomes[outcome].inc()
            raise
        else:
            self.metrics.e2e.observe(self.clock() - t0)
            outcome = "aborted" if record.is_aborted else "internal_error" if flight.crashed else "ok"
            status = response.status
            self.metrics.outcomes[outcome].inc()
            return response
        finally:
            if timer is not None:
                timer.cancel()
            if record.phase is not Phase.DONE:
                self.tracker.spawn(self.cleanup.run(flight), name=f"cleanup-{record.engine_id}")
            else:
                self.cleanup.forget(flight)
            if ACCESS_LOG.isEnabledFor(logging.INFO):
                log_access(flight.access_fields(outcome, status, self.clock()), self.settings.log_format)
            flight.trace.finish(flight, outcome, status)

    async def _walk(self, request: web.Request, f: Flight) -> web.StreamResponse:
        """PREFILLING -> KV_HELD -> DECODING: the prefill hop (or decode-only), then the decode."""
        req = f.request
        if f.deadline is not None:
            f.deadline.check("queue")
        max_tokens = req.sampling_params.get("max_tokens")
        f.ctx = self.pools.pick_context(req.token_ids, request.headers,
                                        tokens=max_tokens if isinstance(max_tokens, int) else 0)
        self.first.arm(f)
        kv_params, failure, error = await self._prefill(f)
        if error is not None and not f.record.is_aborted:
            await self._prefill_failed(f, failure, error)
            kv_params = None
        resp: web.StreamResponse | None = None
        if f.first is not None and kv_params is not None and not f.record.is_aborted:
            resp = await self.first.start(request, f)  # the client's first token, from P
            if f.first.final:
                return await self.first.finish_at_prefill(request, f, resp)
        if kv_params is not None and self.settings.hold_between_hops > 0:  # a test hook: KV_HELD
            await f.record.aborted_within(self.settings.hold_between_hops)
        if f.record.is_aborted:
            await self.cleanup.release_shielded(f)
            if resp is not None:  # the client has P's token
                return await self.first.end_aborted(request, f, resp)
            return await self.aborts.respond_aborted(request, f)
        return await self._decode(request, f, kv_params, resp)

    async def _prefill(self, f: Flight) -> tuple[dict[str, Any] | None, str, UpstreamError | None]:
        """PREFILLING: P's checked params (KV held), or the decode-only reason and P's error. A 4xx
        from P is the client's answer: raised."""
        record, req = f.record, f.request
        f.timing.prefill_start = prefill_start = self.clock()
        bypass = self.pools.bypass_reason(len(req.token_ids))
        prefill: Worker | None = None
        reply: dict[str, Any] = {}
        error: UpstreamError | None = None
        if bypass is None:
            prefill, reply, error = await self.prefill.with_retries(f)
            if prefill is None and error is None and not record.is_aborted:
                bypass = "prefill_unavailable"
            elif isinstance(error, UpstreamStatusError) and error.passthrough:
                f.timing.prefill_end = self.clock()
                raise error
        f.timing.prefill_end = prefill_end = self.clock()
        self.metrics.stages["queue"].observe(prefill_start - f.timing.received)
        self.metrics.stages["prefill"].observe(prefill_end - prefill_start)
        if error is not None:
            return None, "prefill_timeout" if isinstance(error, UpstreamTimeout) else "prefill_error", error
        if bypass is not None:
            self.core.decode_only(f, bypass)
            return None, "", None
        if prefill is None:
            return None, "", None  # aborted before any prefill worker took it
        kv_params, error = self.prefill.accept_reply(f, prefill, reply)
        if kv_params is None and error is None and not record.is_aborted:
            self.core.decode_only(f, "lease_expired")  # P's answer came after its lease ran out
        if kv_params is not None and f.first_token and not record.is_aborted:
            self.first.build(f, reply)
        return kv_params, "missing_kv_params", error

    async def _prefill_failed(self, f: Flight, failure: str, error: UpstreamError) -> None:
        """Release whatever P holds; then fail or go on decode-only."""
        await self.cleanup.release_shielded(f)  # a reply that failed a check may still hold KV
        if self.settings.prefill_failure_policy == "fail":
            raise error
        self.core.decode_only(f, failure)

    async def _decode(self, request: web.Request, f: Flight, kv_params: dict[str, Any] | None,
                      resp: web.StreamResponse | None = None) -> web.StreamResponse:
        """DECODING with P's params or decode-only. ``resp``: the client's stream, already open
        with P's token (failures then end in-band)."""
        record = f.record
        try:
            try:
                decode = await self.engine.acquire(f, [])
            except NoWorkerAvailable:
                if kv_params is None or self.pools.preflight.check is None \
                        or not self.decode_pool.admissible():
                    raise
                # No pair with this prefill worker passed the preflight: its KV can go nowhere.
                self.core.decode_only(f, "no_usable_pair")
                kv_params = None
                decode = await self.engine.acquire(f, [])
        except ProxyError as e:
            await self.cleanup.release_shielded(f)
            if resp is None:
                raise
            return await self.first.end_with_error(request, f, resp, e)
        if record.is_aborted:  # aborted while a decode worker was picked (it may wait for one)
            self.decode_pool.release(decode, Outcome.NEUTRAL, f.ctx.tokens)
            await self.cleanup.release_shielded(f)
            if resp is not None:  # the client has P's token
                return await self.first.end_aborted(request, f, resp)
            return await self.aborts.respond_aborted(request, f)
        if kv_params is not None and not self.core.lease_valid(f):
            # Past P's lease P may have freed the KV: no hop may pull with its params.
            f.lease_ran_out(self.leases)
            self.core.decode_only(f, "lease_expired")
            kv_params = None
        f.to_decoding(decode)
        self.core.decoding(f)
        f.timing.decode_start = decode_start = self.clock()
        self.metrics.stages["handoff"].observe(
            decode_start - (f.timing.prefill_end or decode_start))
        body = decode_body(f.data, record.base_id, kv_params)
        if f.request.is_stream:
            return await self.stream.decode(request, f, decode, body, resp)
        return await self.full.decode(f, decode, body, request)
