"""The request walk: validate, prefill hop, check, decode hop, relay; aborts and clean-up.

``Serving.generate`` owns one client request. Each upstream hop runs in its own tracked task
that the handler awaits through ``asyncio.shield``: when aiohttp cancels the handler (the client
went away), the hop goes on and ``Serving.cleanup`` takes it over, so whatever a worker holds
for the request is freed whatever state the walk was in (see ``proxy.state``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import ipaddress
import json
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from aiohttp import web

from kv_transfer.ledger import CloseReason, KVLeaseLedger, Lease
from kv_transfer.params import client_transfer_params
from proxy.errors import (
    BadRequest,
    ClientError,
    InvalidRequest,
    ProxyError,
    StreamOverflow,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamStatusError,
    UpstreamTimeout,
    UpstreamUnavailable,
)
from proxy.hop import HopResponse
from proxy.ids import Rewrite, abortable_id, client_request_id, upstream_id
from proxy.large_body import LARGE_BODY_BYTES, PackedTokenIds, parse_large_generate_body, prompt_too_long
from proxy.limits import request_body
from proxy.logs import ACCESS_LOG, log_access
from proxy.metrics import ProxyMetrics
from proxy.pools import Deadline, DeadlineExceeded, NoWorkerAvailable, Outcome, Overloaded, PickContext
from proxy.pools.admission import hop_budget
from proxy.pools.migration import StreamFollower, migration_blocker
from proxy.pools.preflight import handoff_check
from proxy.pools.retry import is_transient
from proxy.pools.runtime import BYPASS_HEADER, PoolRuntime
from proxy.pools.worker import Worker
from proxy.protocol import (
    GenerateRequest,
    RequestValidationError,
    VLLMValidationError,
    abort_full_response,
    abort_stream_chunk,
    check_prefill_kv_params,
    compact_json,
    engine_request_id,
    parse_generate_body,
    parse_worker_json,
    splice_null_key,
)
from proxy.relay import ByteBudget, StreamBuffer, block_token_ids
from proxy.settings import ProxySettings
from proxy.sse import DONE_DATA, DONE_EVENT, SSEReader, comment_event, data_event, last_data
from proxy.state import Phase, RequestRecord, RequestTable, TaskTracker
from proxy.tenants import OPEN, Tenant
from proxy.tracing import DISABLED as TRACING_DISABLED
from proxy.tracing import NOOP_HOP, NOOP_TRACE, Hop, RequestTrace, Tracing
from proxy.upstream import TokenIds, Upstream, ids_text

log = logging.getLogger("pd_proxy")
_LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost"})


_HOST_CACHE = 1024
_WALK_DATA = b"transfer_params"
"""Given to ``client_transfer_params`` as the body: it then walks the parsed data (small: the
packed token ids are not walked) instead of searching the raw bytes first."""


def _is_loopback_or_unspecified(host: str) -> bool:
    if host.lower() in _LOOPBACK_NAMES:
        return True
    try:
        addr = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return addr.is_loopback or addr.is_unspecified


@dataclass(slots=True)
class Timing:
    t0: float
    p0: float | None = None
    p1: float | None = None
    d0: float | None = None
    d1: float | None = None

    def durations_ms(self, now: float) -> dict[str, float]:
        def ms(a: float | None, b: float | None) -> float:
            return 0.0 if a is None or b is None else max(0.0, (b - a) * 1000.0)

        return {
            "queue": ms(self.t0, self.p0 if self.p0 is not None else self.d0),
            "prefill": ms(self.p0, self.p1),
            "handoff": ms(self.p1, self.d0),
            "decode_ttft": ms(self.d0, self.d1),
            "total": ms(self.t0, now),
        }

    def header(self, now: float) -> str:
        return ", ".join(f"{name};dur={value:.3f}" for name, value in self.durations_ms(now).items())


def error_class(e: UpstreamError) -> str:
    """The ``error`` label of ``pd_proxy_upstream_errors_total``."""
    if isinstance(e, UpstreamTimeout):
        return "timeout"
    if isinstance(e, UpstreamUnavailable):
        return "connect"
    if isinstance(e, UpstreamStatusError):
        return "http_4xx" if e.passthrough else "http_5xx"
    return "protocol"


@dataclass(eq=False, slots=True)
class Flight:
    """What the walk and the clean-up share about one request's upstream calls."""

    record: RequestRecord
    request: GenerateRequest
    data: dict[str, Any]
    timing: Timing
    prefill_task: asyncio.Task[dict[str, Any]] | None = None
    decode_task: asyncio.Task[Any] | None = None
    release_task: asyncio.Task[None] | None = None
    buffer: StreamBuffer | None = None
    headers_ready: asyncio.Future[None] | None = None
    settled: asyncio.Event = field(default_factory=asyncio.Event)
    """Set once the decode worker certainly registered the request (first event) or ended."""
    force_end: asyncio.TimerHandle | None = None
    headers: dict[str, str] = field(default_factory=dict)
    kv_blocks: int | None = None
    """Blocks the prefill worker advertised (``remote_block_ids``), once its reply is accepted."""
    completion_tokens: int | None = None
    """From the decode worker's usage (non-stream reply, or a stream's usage chunk)."""
    deadline: Deadline | None = None
    ctx: PickContext = field(default_factory=PickContext)
    """The decode pick's context (its ``tokens`` are counted on the decode worker)."""
    trace: RequestTrace = NOOP_TRACE
    """OpenTelemetry spans of this request (``proxy.tracing``; a shared no-op when off)."""
    client_id: str = ""
    """The id the client knows the request by (``record.base_id`` is the workers', ``proxy.ids``)."""
    rewrite: Rewrite | None = None
    """Puts the client's id back into worker bytes sent to the client (several tenants only)."""
    tenant: Tenant = OPEN


class Serving:
    def __init__(self, settings: ProxySettings, metrics: ProxyMetrics,
                 clock: Callable[[], float] = time.monotonic, *,
                 tracing: Tracing = TRACING_DISABLED) -> None:
        self.tracing = tracing
        self.settings = settings
        self.metrics = metrics
        self.clock = clock
        self.ledger = KVLeaseLedger(lease_duration=settings.lease_duration,
                                    keep_closed=settings.ledger_recent, on_close=self._lease_closed)
        self.pools = PoolRuntime(settings.pools, settings.prefill_urls, settings.decode_urls,
                                 block_size=settings.kv_block_size, registry=metrics.registry, clock=clock)
        self.prefill_pool = self.pools.prefill
        self.decode_pool = self.pools.decode
        self.table = RequestTable()
        self.stream_budget = ByteBudget(settings.slow_reader_total_bytes)
        """Bytes buffered for streaming clients, all streams of this process (``relay.ByteBudget``)."""
        metrics.watch_stream_budget(self.stream_budget)
        self.tracker = TaskTracker()
        self.flights: dict[int, Flight] = {}
        self.draining = False
        self._broadcast_slots = asyncio.Semaphore(settings.abort_broadcast_concurrency)
        self._broadcasts_pending = 0
        """Set at shutdown: requests ended from then on count as ``source="shutdown"``."""
        self._upstream: Upstream | None = None
        self._is_local = functools.lru_cache(maxsize=_HOST_CACHE)(_is_loopback_or_unspecified)
        """Per host name, for ``rewrite_remote_host`` (a parse per request was 1.6% of CPU)."""

    # ---------------------------------------------------------------- lifecycle

    def attach(self, upstream: Upstream) -> None:
        self._upstream = upstream

    async def start_pools(self) -> None:
        """Start the pools' background work (health probes, watchers) on the upstream session."""
        check = handoff_check(self.upstream, block_size=self.pools.block_size,
                              timeout=self.settings.pools.preflight_timeout,
                              rewrite=self.rewrite_remote_host)
        await self.pools.start(self.upstream.session, check)

    @property
    def upstream(self) -> Upstream:
        if self._upstream is None:
            raise RuntimeError("the app has not started (no upstream session)")
        return self._upstream

    # ---------------------------------------------------------------- validation

    def validate(self, body: bytes, content_type: str) -> tuple[GenerateRequest, dict[str, Any]]:
        try:
            req, data = parse_generate_body(body, content_type)
        except RequestValidationError as e:
            raise InvalidRequest.from_protocol(e) from None
        except VLLMValidationError as e:
            raise BadRequest.from_protocol(e) from None
        return self._checked(body, req, data)

    async def validate_large(self, body: bytes | bytearray,
                             content_type: str) -> tuple[GenerateRequest, dict[str, Any]]:
        """``validate`` for a body over ``LARGE_BODY_BYTES``: its token ids are parsed in slices,
        the loop given back between them (``proxy.large_body``)."""
        try:
            req, data = await parse_large_generate_body(body, content_type,
                                                        max_tokens=self.settings.max_prompt_tokens or None)
        except RequestValidationError as e:
            raise InvalidRequest.from_protocol(e) from None
        except VLLMValidationError as e:
            raise BadRequest.from_protocol(e) from None
        if type(data["token_ids"]) is PackedTokenIds:
            return self._checked(None, req, data)
        return self._checked(bytes(body), req, data)  # parsed in one go (``large_body``): as before

    def _checked(self, body: bytes | None, req: GenerateRequest,
                 data: dict[str, Any]) -> tuple[GenerateRequest, dict[str, Any]]:
        """The proxy's own checks of a parsed body. ``body`` None: the ids are packed already
        (``PackedTokenIds``, which carry their own text)."""
        s = self.settings
        if s.max_prompt_tokens and len(req.token_ids) > s.max_prompt_tokens:
            raise BadRequest.from_protocol(prompt_too_long(s.max_prompt_tokens, len(req.token_ids)))
        # Transfer params name worker-side addresses and blocks: only the proxy sets them, per
        # hop (kv_transfer.params). A top-level null names nothing and passes.
        where = client_transfer_params(body if body is not None else _WALK_DATA, data)
        if where is not None:
            raise BadRequest(f"{where} is set by the proxy for each hop and cannot come from a client: "
                             "remove it from the request.", param=where)
        if body is not None:
            data["token_ids"] = TokenIds(data["token_ids"], ids_text(body))  # not encoded again
        sp = req.sampling_params
        # The server-level checks of vLLM's serve_tokens, in its order, for the pools' config.
        if s.max_num_seqs is not None and sp.n > s.max_num_seqs:
            raise BadRequest(
                f"sampling_params.n must be at most the server's max_num_seqs ({s.max_num_seqs}), "
                f"got {sp.n}."
            )
        if req.is_stream and sp.get("prompt_logprob_token_ids") is not None:
            raise BadRequest("prompt_logprob_token_ids are not available when stream=true.")
        if s.decode_tokens_only and sp.stop:
            raise BadRequest(
                "stop strings are not supported on a --tokens-only server because detokenization "
                "is disabled. Check stop strings on the coordinator, or use stop_token_ids."
            )
        if s.decode_tokens_only and req.output_mode != "tokens":
            raise BadRequest(
                f"output_mode={req.output_mode!r} requires a tokenizer, but this server does not "
                "load one (--tokens-only or --skip-tokenizer-init). Send the request to a server "
                "that loads a tokenizer, or use output_mode='tokens'."
            )
        return req, data

    # ---------------------------------------------------------------- hop bodies

    def prefill_body(self, data: dict[str, Any], req: GenerateRequest, base_id: str) -> dict[str, Any]:
        body = dict(data)
        sp = dict(data["sampling_params"])
        sp["max_tokens"] = 1
        sp.pop("min_tokens", None)
        if self.settings.prefill_tokens_only:
            sp.pop("stop", None)
        if req.is_stream:
            sp.pop("prompt_logprobs", None)  # vLLM drops them on streams anyway
        body["sampling_params"] = sp
        body["request_id"] = base_id
        body["stream"] = False
        body.pop("stream_options", None)
        body["output_mode"] = "tokens"
        body["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False}
        return body

    @staticmethod
    def decode_body(data: dict[str, Any], base_id: str, kv_params: dict[str, Any] | None) -> dict[str, Any]:
        body = dict(data)
        body["request_id"] = base_id
        sp = data["sampling_params"]
        if "prompt_logprobs" in sp or "prompt_logprob_token_ids" in sp:
            # The prefill worker computed them; the decode worker cannot for transferred tokens.
            sp = {k: v for k, v in sp.items() if k not in ("prompt_logprobs", "prompt_logprob_token_ids")}
            body["sampling_params"] = sp
        if kv_params is not None:
            body["kv_transfer_params"] = kv_params
        else:
            body.pop("kv_transfer_params", None)
        return body

    @staticmethod
    def release_body(data: dict[str, Any], base_id: str, kv_params: dict[str, Any]) -> dict[str, Any]:
        """A decode request whose only job is to make D pull (so P frees) the KV blocks."""
        body = dict(data)
        sp = dict(data["sampling_params"])
        sp["max_tokens"] = 1
        sp["n"] = 1
        for key in ("min_tokens", "prompt_logprobs", "logprobs", "stop", "prompt_logprob_token_ids"):
            sp.pop(key, None)
        body["sampling_params"] = sp
        body["request_id"] = base_id
        body["stream"] = False
        body.pop("stream_options", None)
        body["output_mode"] = "tokens"
        body["kv_transfer_params"] = kv_params
        return body

    def rewrite_remote_host(self, params: dict[str, Any], worker: Worker) -> dict[str, Any]:
        if not self.settings.rewrite_remote_host:
            return params
        advertised = params.get("remote_host")
        if not isinstance(advertised, str) or not self._is_local(advertised):
            return params
        reached = urlsplit(worker.url).hostname
        if reached and not self._is_local(reached):
            params = dict(params)
            params["remote_host"] = reached
        return params

    # ---------------------------------------------------------------- the walk

    async def generate(self, request: web.Request, tenant: Tenant = OPEN) -> web.StreamResponse:
        t0 = self.clock()
        body = await request_body(request)
        try:
            if len(body) > LARGE_BODY_BYTES:
                req, data = await self.validate_large(body, request.headers.get("Content-Type", ""))
            else:
                req, data = self.validate(body if type(body) is bytes else bytes(body),
                                          request.headers.get("Content-Type", ""))
            client_id = client_request_id(request.headers.get("X-Request-Id"), req.request_id)
        except ClientError as e:
            self.metrics.child(self.metrics.requests, "client_error").inc()
            if ACCESS_LOG.isEnabledFor(logging.INFO):
                log_access({"request_id": request.headers.get("X-Request-Id"), "outcome": "client_error",
                            "status": e.status, "total_ms": round((self.clock() - t0) * 1000.0, 3)},
                           self.settings.log_format)
            return e.to_response()
        try:
            deadline = self.pools.deadline(request.headers)
        except ClientError as e:
            self.metrics.child(self.metrics.requests, "client_error").inc()
            return e.to_response()
        try:
            await self.pools.admission.acquire(None if deadline is None else max(0.0, deadline.remaining()))
        except Overloaded as e:
            self.pools.count_rejection()
            self.metrics.child(self.metrics.requests, "rejected").inc()
            return e.to_response()
        try:
            return await self._admitted(request, t0, req, data, deadline, tenant=tenant,
                                        client_id=client_id if client_id is not None else uuid.uuid4().hex)
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
        self.table.add(record)
        self.flights[id(record)] = flight
        outcome, status = "aborted", 499  # 499: the client went away (no response sent)
        timer = None if deadline is None else asyncio.get_running_loop().call_later(
            max(0.0, deadline.remaining()), self._deadline_passed, record)
        try:
            response = await self._walk(request, flight)
        except ProxyError as e:
            self._set_done(flight)
            if isinstance(e, UpstreamError):
                # Ids, workers and reasons only: never prompts or generated text.
                log.warning("request %s failed: %s", record.engine_id, e.message)
            if isinstance(e, Overloaded):
                self.pools.count_rejection()
            outcome = "timeout" if isinstance(e, UpstreamTimeout | DeadlineExceeded) else (
                "client_error" if isinstance(e, UpstreamStatusError) and e.passthrough
                else "rejected" if isinstance(e, Overloaded) else "upstream_error")
            self.metrics.child(self.metrics.requests, outcome).inc()
            status = e.status
            return e.to_response(flight.headers)
        except (asyncio.CancelledError, ConnectionResetError):
            # aiohttp cancels the handler (or a write fails) when the client went away.
            if self._note_abort(record, "shutdown" if self.draining else "disconnect"):
                self.metrics.child(self.metrics.requests, "aborted").inc()
            raise
        else:
            self.metrics.e2e.observe(self.clock() - t0)
            outcome = "aborted" if record.is_aborted else "ok"
            status = response.status
            self.metrics.child(self.metrics.requests, outcome).inc()
            return response
        finally:
            if timer is not None:
                timer.cancel()
            if record.phase is not Phase.DONE:
                self.tracker.spawn(self.cleanup(flight), name=f"cleanup-{record.engine_id}")
            else:
                self._forget(flight)
            if ACCESS_LOG.isEnabledFor(logging.INFO):
                self._log_access(flight, outcome, status)
            flight.trace.finish(flight, outcome, status)

    def _log_access(self, f: Flight, outcome: str, status: int) -> None:
        """The one access line of a request: ids, workers, hop timings, outcome; no content."""
        record = f.record
        fields: dict[str, Any] = {
            "request_id": f.client_id,
            **({"tenant": f.tenant.name} if f.tenant.tag else {}),
            "prefill": record.prefill_worker.url if record.prefill_worker is not None else None,
            "decode": record.decode_worker.url if record.decode_worker is not None else None,
            "stream": f.request.is_stream,
            "outcome": outcome,
            "status": status,
            "decode_only": f.headers.get("X-PD-Decode-Only"),
            "abort": record.abort_source,
        }
        for name, value in f.timing.durations_ms(self.clock()).items():
            fields[f"{name}_ms"] = round(value, 3)
        fields["completion_tokens"] = f.completion_tokens
        log_access(fields, self.settings.log_format)

    async def _walk(self, request: web.Request, f: Flight) -> web.StreamResponse:
        record, req = f.record, f.request
        s = self.settings
        kv_params: dict[str, Any] | None = None

        if f.deadline is not None:
            f.deadline.check("queue")
        max_tokens = req.sampling_params.get("max_tokens")
        f.ctx = self.pools.pick_context(req.token_ids, request.headers,
                                        tokens=max_tokens if isinstance(max_tokens, int) else 0)

        # --- PREFILLING
        f.timing.p0 = self.clock()
        bypass = self.pools.bypass_reason(len(req.token_ids))
        failure: str | None = None
        failure_error: UpstreamError | None = None
        prefill: Worker | None = None
        reply: dict[str, Any] = {}
        if bypass is None:
            prefill, reply, failure_error = await self._prefill_with_retries(f)
            if prefill is None and failure_error is None and not record.is_aborted:
                bypass = "prefill_unavailable"
            elif failure_error is not None:
                if isinstance(failure_error, UpstreamStatusError) and failure_error.passthrough:
                    f.timing.p1 = self.clock()
                    raise failure_error
                failure = "prefill_timeout" if isinstance(failure_error, UpstreamTimeout) else "prefill_error"
        f.timing.p1 = self.clock()
        self.metrics.child(self.metrics.stage, "queue").observe(f.timing.p0 - f.timing.t0)
        self.metrics.child(self.metrics.stage, "prefill").observe(f.timing.p1 - f.timing.p0)
        if bypass is not None:
            self._decode_only(f, bypass)
        elif failure is None and prefill is not None:
            kv_params, failure_error = self._accept_prefill_reply(f, prefill, reply)
            if failure_error is not None:
                failure = "missing_kv_params"
        if record.is_aborted:
            await self._release_shielded(f)
            return await self._respond_aborted(request, f)
        if failure is not None:
            assert failure_error is not None
            await self._release_shielded(f)  # a reply that failed a check may still hold KV
            if s.prefill_failure_policy == "fail":
                raise failure_error
            self._decode_only(f, failure)
            kv_params = None

        # --- KV_HELD
        if kv_params is not None and s.hold_between_hops > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(record.aborted.wait(), s.hold_between_hops)
        if record.is_aborted:
            await self._release_shielded(f)
            return await self._respond_aborted(request, f)

        # --- DECODING
        try:
            try:
                decode = await self._acquire_decode(f, [])
            except NoWorkerAvailable:
                if kv_params is None or self.pools.preflight.check is None \
                        or not self.decode_pool.admissible():
                    raise
                # No decode worker's pair with this prefill worker passed the preflight: its KV
                # can go nowhere (no release through a broken link either), so run decode-only.
                self._decode_only(f, "no_usable_pair")
                kv_params = None
                decode = await self._acquire_decode(f, [])
        except ProxyError:
            await self._release_shielded(f)
            raise
        record.decode_worker = decode
        record.phase = Phase.DECODING
        f.timing.d0 = self.clock()
        self.metrics.child(self.metrics.stage, "handoff").observe(f.timing.d0 - f.timing.p1)
        body = self.decode_body(f.data, record.base_id, kv_params)
        if req.is_stream:
            return await self._decode_stream(request, f, decode, body)
        return await self._decode_full(f, decode, body, request)

    def _accept_prefill_reply(self, f: Flight, prefill: Worker,
                              reply: dict[str, Any]) -> tuple[dict[str, Any] | None, UpstreamError | None]:
        """Check a 200 prefill reply; on success the KV is held (state KV_HELD, lease open)."""
        record = f.record
        params = reply.get("kv_transfer_params")
        reason = check_prefill_kv_params(params)
        if reason is None and isinstance(params, dict):
            params = self.rewrite_remote_host(params, prefill)
            record.kv_params = params
            record.phase = Phase.KV_HELD
            blocks = f.kv_blocks = sum(len(g) for g in params.get("remote_block_ids", []))
            record.lease = self.ledger.open(record.engine_id, prefill.url, self.clock(), blocks=blocks)
            self.metrics.kv_leases_open.set(self.ledger.open_count)
        self._note_worker_abort(f, reply)
        if reason is not None:
            if not record.is_aborted:
                self.metrics.prefill_missing_kv.inc()
            return None, UpstreamProtocolError("prefill", prefill.url, reason)
        return record.kv_params, None

    def _note_worker_abort(self, f: Flight, reply: dict[str, Any]) -> bool:
        """P ended the request as aborted, and not at this proxy's call: the client's abort went
        to the workers another way (it reached another ``--workers`` process, or this one
        before the request, and was broadcast). The client asked for it, so the request is
        aborted here too, and the client gets vLLM's aborted answer, not an error."""
        choices = reply.get("choices")
        finish = choices[0].get("finish_reason") if isinstance(choices, list) and choices and \
            isinstance(choices[0], dict) else None
        if finish != "abort":
            return False
        self._note_abort(f.record, "worker")
        return True

    async def _prefill_with_retries(
            self, f: Flight) -> tuple[Worker | None, dict[str, Any], UpstreamError | None]:
        """The prefill hop, retried on another prefill worker after a connect error, a 5xx or a
        timeout (nothing is held then). Returns the worker, its reply and the last error; no
        worker and no error when no prefill worker is available and the bypass may take it."""
        record, rt = f.record, self.pools
        ctx = PickContext(token_ids=f.ctx.token_ids, session_id=f.ctx.session_id)
        tried: list[Worker] = []
        last: UpstreamError | None = None
        for attempt in range(rt.prefill_retry.attempts):
            if record.is_aborted:
                break  # aborted (client call, deadline) during the backoff
            bypass = rt.settings.bypass_when_prefill_unavailable
            try:
                pairless = self._pairless_prefill()
                try:
                    worker = await self.prefill_pool.acquire(ctx, exclude=[*tried, *pairless],
                                                             limit=self._queue_limit(f))
                except NoWorkerAvailable:
                    if not tried:
                        raise
                    # every admitted worker failed once: any of them again (the failure may pass)
                    worker = await self.prefill_pool.acquire(ctx, exclude=pairless,
                                                             limit=self._queue_limit(f))
            except NoWorkerAvailable:
                if bypass:
                    # None left (their circuits opened, e.g. on the failure being retried): the
                    # request holds nothing usable, so the decode worker computes the prompt.
                    record.prefill_worker = None
                    return None, {}, None
                if last is not None:
                    break  # none left: the last error stands
                raise
            record.prefill_worker = worker
            try:
                limit = hop_budget(f.deadline, "prefill", self.settings.prefill_timeout,
                                   rt.settings.deadline_prefill_share)
            except DeadlineExceeded:
                self.prefill_pool.release(worker, Outcome.NEUTRAL)
                raise
            f.prefill_task = self.tracker.spawn(self._prefill_hop(f, worker, limit))
            retry_ok = False
            try:
                reply: dict[str, Any] = await asyncio.shield(f.prefill_task)
            except UpstreamError as e:
                last = e
                retry_ok = is_transient(e)
            else:
                reason = check_prefill_kv_params(reply.get("kv_transfer_params"))
                untried = [w for w in self.prefill_pool.admissible() if w is not worker and w not in tried]
                if reason is None or record.is_aborted or self._note_worker_abort(f, reply) \
                        or attempt + 1 >= rt.prefill_retry.attempts or not (untried or bypass):
                    return worker, reply, None  # _walk checks it (and applies --prefill-failure)
                # An unusable 200 (no usable kv_transfer_params): nothing it holds can be freed
                # through the proxy (no params to pull with; P frees the blocks at its lease's
                # end), so another prefill worker may take the request; with none left, as
                # when none is available, the decode worker computes the prompt.
                self.metrics.prefill_missing_kv.inc()
                if not untried:
                    record.prefill_worker = None
                    return None, {}, None
                last = UpstreamProtocolError("prefill", worker.url, reason)
                retry_ok = True
            tried.append(worker)
            if record.is_aborted or attempt + 1 >= rt.prefill_retry.attempts or not retry_ok:
                break
            pause = rt.prefill_retry.delay(attempt, rt.rng)
            if f.deadline is not None and f.deadline.remaining() <= pause:
                break
            rt.count_retry("prefill")
            log.warning("request %s: retrying prefill after %s", record.engine_id, last.message)
            await asyncio.sleep(pause)
        return record.prefill_worker, {}, last

    async def _prefill_hop(self, f: Flight, worker: Worker, limit: float) -> dict[str, Any]:
        body = self.prefill_body(f.data, f.request, f.record.base_id)
        outcome = Outcome.NEUTRAL
        try:
            reply: dict[str, Any] = await self._call(worker, self.upstream.post_generate(
                "prefill", worker.url, body, request_id=f.record.base_id, total=limit),
                f.trace.hop("prefill", worker))
            # A reply without usable KV params is P's failure; one with them is judged at the
            # hand-off (``_handoff_done`` / ``_blame``): P may have prefilled and then refuse
            # every pull, which only the decode hops see.
            if check_prefill_kv_params(reply.get("kv_transfer_params")) is not None:
                outcome = Outcome.FAILURE
            return reply
        except UpstreamStatusError as e:
            outcome = Outcome.NEUTRAL if e.passthrough else Outcome.FAILURE
            raise
        except UpstreamError:
            outcome = Outcome.FAILURE
            raise
        finally:
            self.prefill_pool.release(worker, outcome)

    def _pairless_prefill(self) -> list[Worker]:
        """With the preflight on: prefill workers whose every pair with the decode pool failed it
        (their KV could reach no decode worker), left out of prefill picks."""
        preflight = self.pools.preflight
        if preflight.check is None:
            return []
        decoders = self.decode_pool.admissible()
        return [p for p in self.prefill_pool.admissible() if preflight.all_failed(p, decoders)]

    def _queue_limit(self, f: Flight) -> float:
        """How long a pick may wait for a worker with room: the queue timeout, or less when
        the request's deadline comes first."""
        limit = self.pools.settings.queue_timeout
        return limit if f.deadline is None else min(limit, max(0.0, f.deadline.remaining()))

    async def _acquire_decode(self, f: Flight, tried: list[Worker]) -> Worker:
        """A decode worker for this request (counted on it): not one already tried, and, with
        the preflight on and KV to hand off, one whose pair with the prefill worker passed."""
        rt, record = self.pools, f.record
        excluded = list(tried)
        prefill = record.prefill_worker
        if rt.preflight.check is not None and prefill is not None and record.kv_params is not None:
            candidates = self.decode_pool.candidates(excluded)
            usable = await rt.preflight.usable_decoders(prefill, candidates, rt.settings.preflight_timeout)
            excluded += [w for w in candidates if all(w is not u for u in usable)]
        # A first pick (or a retry's pick of any worker) waits for a circuit about to let
        # requests in: the prefill is done (its KV may be held), and a decode hop has no other
        # way. A retry's pick of an untried worker does not (the caller then picks among all).
        # A prefill pick never waits: nothing is invested yet (bypass, or a quick 503).
        return await self.decode_pool.acquire(f.ctx, exclude=excluded, limit=self._queue_limit(f),
                                              wait_recovering=not tried)

    def _decode_limit(self, f: Flight) -> float:
        """A non-stream decode hop's timeout: its cap, or the deadline plus the abort grace (at
        the deadline the request is aborted and D answers with what it has)."""
        cap = self.settings.decode_timeout
        if f.deadline is None:
            return cap
        return min(cap, max(0.0, f.deadline.remaining()) + self.settings.abort_grace)

    def _lease_valid(self, f: Flight) -> bool:
        lease = f.record.lease
        return (f.record.kv_params is not None and lease is not None and lease.end is None
                and lease.expires > self.clock())

    def _deadline_passed(self, record: RequestRecord) -> None:
        if record.phase is not Phase.DONE:
            self.abort_record(record, "deadline")

    async def _call(self, worker: Worker, coro: Any, hop: Hop = NOOP_HOP) -> Any:
        """Count one call to ``worker`` (its in-flight count is the pool's: ``Pool.acquire``);
        ``hop`` is its span (``proxy.tracing``), current while the call runs."""
        self.metrics.child(self.metrics.inflight, worker.pool).inc()
        self.metrics.child(self.metrics.upstream_requests, worker.pool, worker.url).inc()
        try:
            with hop:
                return await coro
        except UpstreamError as e:
            self.metrics.child(self.metrics.upstream_errors, worker.pool, worker.url, error_class(e)).inc()
            raise
        finally:
            self.metrics.child(self.metrics.inflight, worker.pool).dec()

    # ---------------------------------------------------------------- decode: non-stream

    async def _decode_full(self, f: Flight, worker: Worker, body: dict[str, Any],
                           request: web.Request) -> web.StreamResponse:
        record = f.record

        async def hop() -> tuple[dict[str, Any], bytes]:
            w, current, tried = worker, body, []
            suspect: Worker | None = None
            attempt, rescued = 0, False
            try:
                while True:
                    outcome = Outcome.NEUTRAL
                    rescue = False
                    try:
                        answer: tuple[dict[str, Any], bytes] = await self._call(
                            w, self.upstream.post_generate_raw(
                                "decode", w.url, current, request_id=record.base_id,
                                total=self._decode_limit(f)), f.trace.hop("decode", w))
                        outcome = Outcome.SUCCESS
                        self._handoff_done(f, current, suspect)
                        return answer
                    except UpstreamError as e:
                        passthrough = isinstance(e, UpstreamStatusError) and e.passthrough
                        outcome = Outcome.NEUTRAL if passthrough else Outcome.FAILURE
                        last_attempt = attempt + 1 >= self.pools.decode_retry.attempts
                        retry = not last_attempt and self._may_retry_decode(f, e)
                        outcome, suspect = self._attribute_decode_failure(
                            f, w, current, e, outcome=outcome, suspect=suspect,
                            retry_with_kv=retry and attempt == 0)
                        rescue = not retry and not rescued and self._may_rescue(f, e, current)
                        if not retry and not rescue:
                            raise
                        error = e
                    finally:
                        self.decode_pool.release(w, outcome, f.ctx.tokens)
                    tried.append(w)
                    if rescue:
                        rescued = True
                        w, current = await self._rescue_decode_only(f, error)
                    else:
                        w, current = await self._next_decode(f, body, tried, attempt, error)
                    attempt += 1
            finally:
                f.settled.set()

        task = self.tracker.spawn(hop())
        f.decode_task = task
        if not await self._hop_or_abandon(f, task):
            return await self._respond_aborted(request, f, done=False)
        try:
            reply, raw = await asyncio.shield(task)
        except UpstreamError as e:
            self._close_lease_after_decode_error(f, e)
            self._set_done(f)
            raise
        f.timing.d1 = self.clock()
        self._close_lease(f, "aborted" if record.is_aborted else "pulled")
        self._set_done(f)
        self.metrics.child(self.metrics.stage, "decode_first_token").observe(f.timing.d1 - (f.timing.d0 or 0))
        if reply.get("output_mode") != f.request.output_mode:
            self.metrics.child(self.metrics.upstream_errors, worker.pool, worker.url, "protocol").inc()
            raise UpstreamProtocolError(
                "decode", worker.url,
                f"answered output_mode {reply.get('output_mode')!r} for a {f.request.output_mode!r} "
                "request (a server that predates output_mode?)")
        self._note_usage(f, reply.get("usage"))
        if f.completion_tokens and f.request.sampling_params.n == 1 and f.timing.d1 is not None \
                and f.timing.d0 is not None:
            # Non-stream: the decode hop (KV pull and first token included) per output token.
            self.metrics.tpot.observe((f.timing.d1 - f.timing.d0) / f.completion_tokens)
        raw = self._merge_prefill_info(f, reply, raw)
        if f.rewrite is not None:
            raw = f.rewrite.apply(raw)
        now = self.clock()
        self.metrics.ttft.observe(now - f.timing.t0)
        headers = dict(f.headers)
        headers["Server-Timing"] = f.timing.header(now)
        return web.Response(body=raw, content_type="application/json", headers=headers)

    def _note_usage(self, f: Flight, usage: object) -> None:
        """Keep D's completion token count; count a long prompt whose decode shows no KV
        transfer (the prefill advertised no blocks, or D reports zero cached tokens)."""
        if not isinstance(usage, dict):
            return
        completion = usage.get("completion_tokens")
        if isinstance(completion, int):
            f.completion_tokens = completion
        prompt = usage.get("prompt_tokens")
        if not isinstance(prompt, int) or prompt < self.settings.kv_block_size \
                or f.kv_blocks is None or "X-PD-Decode-Only" in f.headers or f.record.is_aborted:
            return
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        if f.kv_blocks == 0 or cached == 0:
            self.metrics.suspect_no_transfer.inc()

    def _may_retry_decode(self, f: Flight, e: UpstreamError) -> bool:
        """Before D's first byte a 5xx, connect error or timeout may go to another decode worker:
        with P's KV while its lease is valid, else decode-only (D computes the prompt itself)."""
        return not f.record.is_aborted and is_transient(e) and (
            f.deadline is None or not f.deadline.expired)

    async def _next_decode(self, f: Flight, body: dict[str, Any], tried: list[Worker], attempt: int,
                           error: UpstreamError) -> tuple[Worker, dict[str, Any]]:
        """The worker and body of the next decode attempt (raises ``error`` if there is none)."""
        rt = self.pools
        await asyncio.sleep(rt.decode_retry.delay(attempt, rt.rng))
        try:
            try:
                w = await self._acquire_decode(f, tried)
            except NoWorkerAvailable:
                w = await self._acquire_decode(f, [])  # every admitted worker failed once: any again
        except (NoWorkerAvailable, Overloaded):
            raise error from None
        f.record.decode_worker = w
        rt.count_retry("decode")
        log.warning("request %s: retrying decode on %s after %s", f.record.engine_id, w.url, error.message)
        if "kv_transfer_params" not in body or (attempt == 0 and self._lease_valid(f)):
            return w, body  # decode-only already, or the same KV (P still holds it under the lease)
        self._decode_only(f, "decode_retry")
        return w, self.decode_body(f.data, f.record.base_id, None)

    @staticmethod
    def _kv_ambiguous(e: UpstreamError, body: dict[str, Any]) -> bool:
        """A 5xx on a decode hop that carried P's KV params: D broke, or its pull from P failed."""
        return isinstance(e, UpstreamStatusError) and e.upstream_status >= 500 \
            and "kv_transfer_params" in body

    def _may_rescue(self, f: Flight, e: UpstreamError, body: dict[str, Any]) -> bool:
        """The retries with P's KV are spent on an ambiguous failure: one more, decode-only
        (only when decode retries are on at all: ``--decode-attempts 1`` means none)."""
        return self.pools.decode_retry.attempts > 1 and self._kv_ambiguous(e, body) \
            and self._may_retry_decode(f, e)

    async def _rescue_decode_only(self, f: Flight, error: UpstreamError) -> tuple[Worker, dict[str, Any]]:
        """The last decode attempt of a request whose KV no decode worker could use: decode-only
        (D computes the prompt), on any decode worker; raises ``error`` if there is none."""
        try:
            w = await self._acquire_decode(f, [])
        except (NoWorkerAvailable, Overloaded):
            raise error from None
        f.record.decode_worker = w
        self.pools.count_retry("decode")
        log.warning("request %s: decode-only on %s after its KV failed: %s", f.record.engine_id, w.url,
                    error.message)
        self._decode_only(f, "decode_retry")
        return w, self.decode_body(f.data, f.record.base_id, None)

    def _attribute_decode_failure(self, f: Flight, w: Worker, body: dict[str, Any], e: UpstreamError, *,
                                  outcome: Outcome, suspect: Worker | None,
                                  retry_with_kv: bool) -> tuple[Outcome, Worker | None]:
        """Whose breaker a decode failure before D's first byte counts on; returns D's outcome
        and the decode worker still under suspicion.

        A 5xx on a hop that carried P's KV params is ambiguous (D broke, or its pull from P
        failed). The first such failure counts NEUTRAL on D when the retry (on another decode
        worker, same KV) follows; that retry settles it: a success counts the FAILURE on the
        first D (``_handoff_done``), an ambiguous failure too counts it on P, NEUTRAL on both
        D. When no such retry can settle it (one decode worker, no attempt left, lease ended),
        P takes the failure: opening decode circuits for a prefill worker's fault can stop all
        traffic, while P's circuit moves requests to other prefill workers or decode-only, where
        a fault of D's own shows unambiguously. Connect errors, timeouts and failures of
        decode-only hops count on D as before."""
        if outcome is not Outcome.FAILURE or not self._kv_ambiguous(e, body) \
                or f.record.prefill_worker is None:
            return outcome, None
        if suspect is not None and suspect is not w:
            self._blame(f.record.prefill_worker, f, "two decode workers failed its KV")
            return Outcome.NEUTRAL, None
        if suspect is None and retry_with_kv and self._lease_valid(f) \
                and self.decode_pool.admissible(exclude=(w,)):
            return Outcome.NEUTRAL, w
        self._blame(f.record.prefill_worker, f, "a decode worker failed its KV, no other to settle it")
        return Outcome.NEUTRAL, None

    def _handoff_done(self, f: Flight, body: dict[str, Any], suspect: Worker | None) -> None:
        """A decode hop answered: with P's KV, the hand-off worked (P's success); a decode worker
        whose failure on the same KV was ambiguous gets the blame now."""
        if "kv_transfer_params" not in body:
            return
        prefill = f.record.prefill_worker
        if prefill is not None:
            prefill.breaker.record_success()
        if suspect is not None:
            self._blame(suspect, f, "another decode worker served the same KV")

    def _blame(self, worker: Worker | None, f: Flight, why: str) -> None:
        if worker is None:
            return
        log.warning("request %s: failure counted on %s worker %s (%s)", f.record.engine_id,
                    worker.pool, worker.url, why)
        worker.breaker.record_failure()

    def _decode_only(self, f: Flight, reason: str) -> None:
        """From here on the request runs on a decode worker alone: counted (once per request),
        named in the ``X-PD-Decode-Only`` header, and a KV lease still open ends as ``unknown``
        (no decode hop of this request will pull those blocks; P frees them at its own lease's
        end), so a decode-only hop's first event never closes it as ``pulled``."""
        if BYPASS_HEADER not in f.headers:
            self.metrics.child(self.metrics.decode_only, reason).inc()
            f.headers[BYPASS_HEADER] = reason
        self._close_lease(f, "unknown")
        f.record.kv_params = None

    def _merge_prefill_info(self, f: Flight, reply: dict[str, Any], raw: bytes) -> bytes:
        """Put what only the prefill hop knows into D's reply (``reply``, parsed from ``raw``);
        returns the bytes to send: D's own when nothing changed."""
        prefill_reply = f.prefill_task.result() if f.prefill_task is not None and \
            f.prefill_task.done() and not f.prefill_task.cancelled() and \
            f.prefill_task.exception() is None else None
        if prefill_reply is None or "X-PD-Decode-Only" in f.headers:
            return raw
        changed = False
        if f.request.sampling_params.get("prompt_logprobs") is not None:
            changed = True
            reply["prompt_logprobs"] = prefill_reply.get("prompt_logprobs")
            if prefill_reply.get("prompt_token_id_logprobs") is not None:
                reply["prompt_token_id_logprobs"] = prefill_reply["prompt_token_id_logprobs"]
        usage = reply.get("usage")
        if self.settings.report_cached_tokens and isinstance(usage, dict) and \
                usage.get("prompt_tokens_details") is None:
            p_usage = prefill_reply.get("usage")
            details = p_usage.get("prompt_tokens_details") if isinstance(p_usage, dict) else None
            if details is None:
                p_params = prefill_reply.get("kv_transfer_params")
                cached = p_params.get("remote_prefill_cached_tokens") if isinstance(p_params, dict) else None
                if isinstance(cached, int) and cached > 0:
                    details = {"cached_tokens": cached}
            if details is not None:
                d_null = "prompt_tokens_details" in usage  # D wrote it as null (absent: no splice)
                usage["prompt_tokens_details"] = details
                if not changed and d_null:
                    spliced = splice_null_key(raw, "prompt_tokens_details", details)
                    if spliced is not None:
                        return spliced  # D's bytes with one value put in: not written again
                changed = True
        return compact_json(reply) if changed else raw

    # ---------------------------------------------------------------- decode: stream

    async def _decode_stream(self, request: web.Request, f: Flight, worker: Worker,
                             body: dict[str, Any]) -> web.StreamResponse:
        buffer = f.buffer = StreamBuffer(self.settings.slow_reader_max_bytes, self.stream_budget)
        try:
            f.headers_ready = asyncio.get_running_loop().create_future()
            f.decode_task = self.tracker.spawn(self._produce(f, worker, body, buffer))
            if not await self._hop_or_abandon(f, f.headers_ready):
                return await self._respond_aborted(request, f, done=False)
            try:
                await asyncio.shield(f.headers_ready)
            except UpstreamError as e:
                self._close_lease_after_decode_error(f, e)
                self._set_done(f)
                raise
            headers = dict(f.headers)
            headers["Content-Type"] = "text/event-stream; charset=utf-8"
            headers["Cache-Control"] = "no-cache"
            resp = web.StreamResponse(status=200, headers=headers)
            await resp.prepare(request)
            try:
                await self._relay(request, f, resp, buffer)
            except ConnectionResetError:
                # The client went away mid-stream: return quietly (aiohttp ignores the failed
                # write_eof); the clean-up aborts D because the state is still DECODING.
                self._note_abort(f.record, "shutdown" if self.draining else "disconnect")
            return resp
        finally:
            buffer.discard()  # nothing more goes to this client: its bytes leave the budget

    async def _relay(self, request: web.Request, f: Flight, resp: web.StreamResponse,
                     buffer: StreamBuffer) -> None:
        want_timing = request.headers.get("X-PD-Timing") == "1"
        last_write: float | None = None
        first_write: float | None = None
        transport = request.transport
        # A write that leaves the transport's buffer at or below its high-water mark cannot pause
        # writing, so it cannot block: it needs no timer (profiled: the per-write timeout was the
        # relay loop's largest cost of its own).
        high = transport.get_write_buffer_limits()[1] if transport is not None else -1
        while True:
            # The client lags when what we wrote before is still in the transport's buffer.
            queued = transport.get_write_buffer_size() if transport is not None else 0
            items, finished = await buffer.take(merge=queued > 0)
            if items:
                data = items[0] if len(items) == 1 else b"".join(items)
                if f.rewrite is not None:
                    data = f.rewrite.apply(data)
                if queued + len(data) <= high:  # the buffer only drained while we waited
                    await resp.write(data)
                else:
                    await self._write_client(request, resp, data)
                buffer.sent()
                now = self.clock()
                if last_write is None:
                    first_write = now
                    self.metrics.ttft.observe(now - f.timing.t0)
                else:
                    self.metrics.itl.observe(now - last_write)
                last_write = now
            if finished:
                break
        if buffer.overflowed:
            self.metrics.child(self.metrics.slow_reader_ended, buffer.overflowed).inc()
            err = StreamOverflow(
                f"stream aborted: the client read too slowly ({self.settings.slow_reader_max_bytes} "
                "bytes queued)" if buffer.overflowed == "stream" else
                "stream aborted: the client read too slowly (the proxy's buffers for slow clients "
                f"are full: {self.settings.slow_reader_total_bytes} bytes)")
            await self._write_client(request, resp, err.sse_event() + DONE_EVENT, eof=True)
            return  # phase stays DECODING: the clean-up aborts D
        if f.timing.d1 is not None:
            self.metrics.child(self.metrics.stage, "decode_stream").observe(self.clock() - f.timing.d1)
        tokens = f.completion_tokens  # known only when the client asked for include_usage
        if tokens is not None and tokens > 1 and f.request.sampling_params.n == 1 \
                and first_write is not None and last_write is not None:
            self.metrics.tpot.observe((last_write - first_write) / (tokens - 1))
        tail = [buffer.error_event] if buffer.error_event is not None else []
        if want_timing:
            tail.append(comment_event("server-timing " + f.timing.header(self.clock())))
        tail.append(DONE_EVENT)
        await self._write_client(request, resp, b"".join(tail), eof=True)
        if f.decode_task is not None and f.decode_task.done():
            self._set_done(f)
        # else: the proxy ended the stream itself (abort grace passed): the clean-up aborts D.

    async def _write_client(self, request: web.Request, resp: web.StreamResponse, data: bytes, *,
                            eof: bool = False) -> None:
        """Write to a streaming client, bounded by ``slow_reader_timeout``: a client that stopped
        reading (its window is shut) cannot be told anything more, so its connection is closed
        and the caller sees a disconnect (the clean-up then aborts the decode worker)."""
        try:
            async with asyncio.timeout(self.settings.slow_reader_timeout):
                await resp.write(data)
                if eof:
                    await resp.write_eof()
        except TimeoutError:
            if request.transport is not None:
                request.transport.abort()
            raise ConnectionResetError("the client stopped reading its stream") from None

    async def _produce(self, f: Flight, worker: Worker, body: dict[str, Any], buffer: StreamBuffer) -> None:
        """Read D's stream into ``buffer`` (never blocks on the client).

        Before D's first byte, a failed open goes to another decode worker (``_next_decode``).
        A stream that breaks later (the worker died, reset, or sent an error event) continues on
        another decode worker as a continuation (``proxy.pools.migration``) when the request
        allows it: the client's stream goes on with no visible seam."""
        record = f.record
        assert f.headers_ready is not None
        rt = self.pools
        follower = (StreamFollower(f.data, f.request.output_mode)
                    if rt.settings.migrate and migration_blocker(f.data) is None else None)
        tried: list[Worker] = []
        attempt, rescued = 0, False
        w, current = worker, body
        suspect: Worker | None = None
        while True:
            status, error, exc = "broken", None, None
            try:
                with f.trace.hop("decode", w) as hop:
                    status, error, exc = await self._stream_once(f, w, current, buffer, follower)
                    hop.outcome(status)
            finally:
                passthrough = isinstance(exc, UpstreamStatusError) and exc.passthrough
                outcome = (Outcome.SUCCESS if status == "done" else
                           Outcome.NEUTRAL if status == "closed" or passthrough or record.is_aborted
                           else Outcome.FAILURE)
                if status in ("open_failed", "kv_failed") and exc is not None:
                    retry = attempt == 0 and attempt + 1 < rt.decode_retry.attempts \
                        and self._may_retry_decode(f, exc)
                    outcome, suspect = self._attribute_decode_failure(
                        f, w, current, exc, outcome=outcome, suspect=suspect, retry_with_kv=retry)
                elif status == "done" and current is body:
                    self._handoff_done(f, current, suspect)
                else:
                    suspect = None  # the retry ended otherwise: it tells nothing about the first
                self.decode_pool.release(w, outcome, f.ctx.tokens)
            if status == "done":
                buffer.finish(done=True)
                return
            if status == "closed":
                return
            kv_failed = status == "kv_failed"
            if kv_failed or (status == "open_failed" and not f.headers_ready.done()):
                # Nothing reached the client yet: another decode worker may take the same body
                # (P's KV while its lease holds), as before D's first byte; when those retries
                # are spent on an ambiguous failure, one last attempt goes decode-only.
                assert exc is not None
                try:
                    if attempt + 1 < rt.decode_retry.attempts and self._may_retry_decode(f, exc):
                        tried.append(w)
                        w, current = await self._next_decode(f, body, tried, attempt, exc)
                    elif not rescued and self._may_rescue(f, exc, current):
                        rescued = True
                        w, current = await self._rescue_decode_only(f, exc)
                    else:
                        raise exc
                except UpstreamError:
                    pass
                else:
                    attempt += 1
                    continue
                f.settled.set()
                if not kv_failed:
                    f.headers_ready.set_exception(exc)
                else:
                    self._end_stream_with_error(f, buffer, error, exc.message)
                return
            if status != "protocol" and follower is not None and not record.is_aborted \
                    and not buffer.closed and follower.migrations < rt.settings.max_migrations \
                    and (f.deadline is None or not f.deadline.expired):
                cont = follower.continue_elsewhere(record.base_id)
                if cont is None:  # the client already has every token
                    buffer.finish(done=True)
                    return
                tried.append(w)
                try:
                    w = await self.decode_pool.acquire(f.ctx, exclude=tried, limit=self._queue_limit(f),
                                                       wait_recovering=True)
                except (NoWorkerAvailable, Overloaded) as e:
                    self._end_stream_with_error(f, buffer, error, f"no decode worker to migrate to ({e})")
                    return
                record.decode_worker = w
                current = await self._prefill_continuation(f, cont.body)
                rt.count_migration()
                log.warning("request %s: stream migrated to %s after %d tokens", record.engine_id, w.url,
                            cont.kept + cont.replay)
                continue
            why = ("the worker broke the protocol" if status == "protocol" else
                   "this request cannot migrate" if follower is None else
                   "aborted" if record.is_aborted else
                   f"{follower.migrations} migrations already"
                   if follower.migrations >= rt.settings.max_migrations else "its deadline passed")
            self._end_stream_with_error(f, buffer, error,
                                        f"decode stream {status} on {w.url}, not migrated: {why}")
            return

    def _end_stream_with_error(self, f: Flight, buffer: StreamBuffer, error: bytes | None, why: str) -> None:
        """End the client's stream with D's error event (or the proxy's): logged, so that a
        client-visible stream error can be followed (ids, workers and reasons only)."""
        if not buffer.closed:
            log.warning("request %s: stream ended with an error: %s", f.record.engine_id, why)
        buffer.finish(done=False, error=error)

    async def _prefill_continuation(self, f: Flight, body: dict[str, Any]) -> dict[str, Any]:
        """A long continuation's prompt goes through a prefill worker (its KV then handed to the
        decode worker, under a lease); a short one, or one whose prefill fails, is computed by
        the decode worker itself."""
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
        try:
            reply = await self._call(p, self.upstream.post_generate(
                "prefill", p.url, self.prefill_body(body, f.request, record.base_id),
                request_id=record.base_id, total=limit), f.trace.hop("prefill", p))
            outcome = Outcome.SUCCESS
        except UpstreamError as e:
            log.warning("request %s: continuation prefill failed: %s", record.engine_id, e.message)
            return body
        finally:
            self.prefill_pool.release(p, outcome)
        params = reply.get("kv_transfer_params")
        if check_prefill_kv_params(params) is not None or not isinstance(params, dict):
            return body
        params = self.rewrite_remote_host(params, p)
        record.prefill_worker, record.kv_params = p, params
        blocks = sum(len(g) for g in params.get("remote_block_ids", []))
        record.lease = self.ledger.open(record.engine_id, p.url, self.clock(), blocks=blocks)
        self.metrics.kv_leases_open.set(self.ledger.open_count)
        return {**body, "kv_transfer_params": params}

    async def _stream_once(self, f: Flight, worker: Worker, body: dict[str, Any], buffer: StreamBuffer,
                           follower: StreamFollower | None) -> tuple[str, bytes | None, UpstreamError | None]:
        """One decode stream into ``buffer``. Returns ``done`` ([DONE] seen), ``closed`` (the
        buffer was closed: client gone, overflow, forced end), ``open_failed`` (no answer: the
        error), ``kv_failed`` (a server error event first, on a hop with P's KV: nothing was
        relayed), ``protocol`` (D answered something unusable) or ``broken`` (ended mid-way)."""
        record = f.record
        assert f.headers_ready is not None
        self.metrics.child(self.metrics.inflight, worker.pool).inc()
        self.metrics.child(self.metrics.upstream_requests, worker.pool, worker.url).inc()
        resp: HopResponse | None = None
        try:
            try:
                resp = await self.upstream.open(
                    "decode", worker.url, body, request_id=record.base_id, total=None,
                    sock_read=self.settings.stream_idle_timeout)
            except UpstreamError as e:
                self.metrics.child(self.metrics.upstream_errors, worker.pool, worker.url,
                                   error_class(e)).inc()
                return "open_failed", e.sse_event(), e
            if not f.headers_ready.done():
                f.headers_ready.set_result(None)
            reader = SSEReader()
            first = True
            done = False
            protocol = False
            error: bytes | None = None
            last: bytes = b""
            exc: UpstreamError | None = None
            try:
                async for chunk in self.upstream.iter_chunks("decode", worker.url, resp):
                    batch = reader.feed_batch(chunk)
                    # The hot path: what a read completed goes out as one block, unparsed, when
                    # it is plain vLLM events (no error, [DONE] last); only the stream's first
                    # event is parsed (its output_mode is checked).
                    fast = batch.plain and (not first or bool(batch.body))
                    if fast and batch.body:
                        if first:
                            first = False
                            error = self._first_event(f, worker, batch.body[6 : batch.body.index(b"\n\n")])
                            if error is not None:
                                protocol = True
                                break
                        if follower is not None:
                            ids = block_token_ids(batch.body) if follower.cont is None and \
                                follower.progress.output_mode == "tokens" else None
                            if ids is None:
                                fast = False  # parse event by event (text mode, migrated, odd)
                            else:
                                follower.progress.generated.extend(ids)
                        if fast:
                            buffer.put(batch.body)
                            if f.request.include_usage:
                                last = last_data(batch.body)
                    if fast:
                        if batch.done:
                            done = True
                            if f.request.include_usage:
                                self._note_stream_usage(f, last)
                            break
                        if buffer.closed:
                            break
                        if len(reader.pending) > self.settings.slow_reader_max_bytes:
                            error = self._protocol_error(worker, "sent an SSE event larger than the byte cap")
                            protocol = True
                            break
                        continue
                    for ev in batch.events():
                        if ev.data == DONE_DATA:
                            done = True
                            if f.request.include_usage:
                                self._note_stream_usage(f, last)
                            break
                        last = ev.data
                        if first:
                            kv_exc = self._kv_hop_failed(worker, body, ev.data)
                            if kv_exc is not None:
                                return "kv_failed", ev.raw, kv_exc
                            first = False
                            error = self._first_event(f, worker, ev.data)
                            if error is not None:
                                protocol = True
                                break
                        if ev.data.startswith(b'{"error"'):
                            # vLLM's in-band error event (the stream had started): a failed call.
                            self.metrics.child(self.metrics.upstream_errors, worker.pool, worker.url,
                                               "error_event").inc()
                            error = ev.raw
                            break
                        if follower is not None:
                            payload = follower.event(ev.data)
                            if payload is None:
                                continue  # only tokens the client already has
                            if payload is not ev.data:
                                buffer.put(data_event(payload), payload)
                                continue
                        buffer.put(ev.raw, ev.data)
                    if done or error is not None or buffer.closed:
                        break
                    if len(reader.pending) > self.settings.slow_reader_max_bytes:
                        error = self._protocol_error(worker, "sent an SSE event larger than the byte cap")
                        protocol = True
                        break
            except UpstreamError as e:
                self.metrics.child(self.metrics.upstream_errors, worker.pool, worker.url,
                                   error_class(e)).inc()
                error, exc = e.sse_event(), e
            if not done and error is None and not buffer.closed:
                error = self._protocol_error(worker, "stream ended without [DONE]")
            f.settled.set()
            if first and (done or error is not None):
                # The stream ended before any event: D answered, so it had the request.
                self._close_lease(f, "unknown" if error is not None else "pulled")
            if done and error is None:
                resp.release()  # kept alive once its last chunk is in (``close`` would drop it)
                return "done", None, None
            if buffer.closed:
                return "closed", None, None
            return ("protocol" if protocol else "broken"), error, exc
        finally:
            if resp is not None:
                resp.close()
            self.metrics.child(self.metrics.inflight, worker.pool).dec()

    def _kv_hop_failed(self, worker: Worker, body: dict[str, Any], data: bytes) -> UpstreamStatusError | None:
        """D's first event is a server error on a hop that carried P's KV params (vLLM sends
        the headers first; a failed KV load then ends the stream this way): as ambiguous as a
        5xx before the first byte (D broke, or its pull from P failed). Returns it as such."""
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

    def _protocol_error(self, worker: Worker, reason: str) -> bytes:
        """A decode stream broke the protocol mid-way: count it, return the in-band error event."""
        self.metrics.child(self.metrics.upstream_errors, worker.pool, worker.url, "protocol").inc()
        return UpstreamProtocolError("decode", worker.url, reason).sse_event()

    def _note_stream_usage(self, f: Flight, data: bytes) -> None:
        """The usage chunk is the last event before ``[DONE]``: one parse per stream."""
        if b'"usage"' not in data:
            return
        try:
            chunk = parse_worker_json(data)
        except ValueError:
            return
        if isinstance(chunk, dict):
            self._note_usage(f, chunk.get("usage"))

    def _first_event(self, f: Flight, worker: Worker, data: bytes) -> bytes | None:
        """D's first event: D certainly has the request (the KV was pulled); check the event."""
        if f.timing.d1 is None:
            f.timing.d1 = self.clock()
            self.metrics.child(self.metrics.stage, "decode_first_token").observe(
                f.timing.d1 - (f.timing.d0 or f.timing.d1))
        self._close_lease(f, "aborted" if f.record.is_aborted else "pulled")
        f.settled.set()
        return self._check_first_event(f, worker, data)

    def _check_first_event(self, f: Flight, worker: Worker, data: bytes) -> bytes | None:
        try:
            chunk = parse_worker_json(data)
        except ValueError:
            return self._protocol_error(worker, "sent an event that is not JSON")
        if isinstance(chunk, dict) and "error" in chunk:
            return None
        mode = chunk.get("output_mode") if isinstance(chunk, dict) else None
        if mode != f.request.output_mode:
            return self._protocol_error(
                worker, f"answered output_mode {mode!r} for a {f.request.output_mode!r} request "
                "(a server that predates output_mode?)")
        return None

    # ---------------------------------------------------------------- leases

    def _close_lease(self, f: Flight, reason: CloseReason) -> None:
        lease = f.record.lease
        if lease is not None and self.ledger.close(lease, reason, self.clock()):
            f.record.kv_params = None
            self.metrics.kv_leases_open.set(self.ledger.open_count)

    def _close_lease_after_decode_error(self, f: Flight, e: UpstreamError) -> None:
        if isinstance(e, UpstreamStatusError) and e.passthrough:
            # D rejected the request up front: vLLM does not tell P, so the blocks would wait
            # for the lease. Try the stripped-down release request (tokens mode, one token, no
            # stop strings or logprobs), which D may well accept; if not, the lease expires.
            if f.record.kv_params is not None and f.release_task is None:
                f.release_task = self.tracker.spawn(self._release(f))
            return
        # A 5xx, a transport failure or a timeout before D answered: D may or may not have
        # pulled. Release through another decode worker when there is one (a second pull of
        # already-freed blocks is harmless on vLLM: P only logs a warning).
        if f.record.kv_params is not None and f.release_task is None:
            failed = f.record.decode_worker
            others = [w for w in self.decode_pool if w is not failed]
            if others:
                f.record.decode_worker = min(others, key=lambda w: w.inflight)
                f.release_task = self.tracker.spawn(self._release(f))
                return
        self._close_lease(f, "unknown")

    def _lease_closed(self, lease: Lease) -> None:
        if lease.duration is not None:
            self.metrics.kv_lease_duration.observe(lease.duration)
        self.metrics.child(self.metrics.kv_leases_closed, lease.reason or "unknown").inc()
        self.metrics.kv_leases_open.set(self.ledger.open_count)

    def expire_leases(self) -> int:
        return self.ledger.expire(self.clock())

    # ---------------------------------------------------------------- aborts

    def _note_abort(self, record: RequestRecord, source: str) -> bool:
        if not record.mark_aborted(source):
            return False
        self.metrics.child(self.metrics.aborts, source, record.phase.value).inc()
        return True

    def abort_record(self, record: RequestRecord, source: str) -> None:
        """An abort for a known request: route it to whoever holds it now."""
        if not self._note_abort(record, source):
            return
        f = self.flights.get(id(record))
        if record.phase is Phase.PREFILLING and record.prefill_worker is not None:
            self.tracker.spawn(self._send_abort(record.prefill_worker, record.engine_id))
        elif record.phase is Phase.DECODING and record.decode_worker is not None:
            if f is not None and f.decode_task is not None:
                self.tracker.spawn(self._abort_until(record.decode_worker, record.engine_id,
                                                     f.decode_task, self.settings.decode_timeout))
            else:
                self.tracker.spawn(self._send_abort(record.decode_worker, record.engine_id))
            if f is not None and f.buffer is not None:
                loop = asyncio.get_running_loop()
                f.force_end = loop.call_later(self.settings.abort_grace, self._force_end, f)
        # KV_HELD: the walk (or its clean-up) releases the KV as soon as it sees the flag.

    def _force_end(self, f: Flight) -> None:
        """D did not end an aborted stream in time: end the client's stream as vLLM would."""
        buffer = f.buffer
        if buffer is None or buffer.closed:
            return
        for index in range(f.request.sampling_params.n):
            chunk = compact_json(abort_stream_chunk(f.record.engine_id, f.request.output_mode, index))
            buffer.put(data_event(chunk), chunk)
        buffer.finish(done=True)

    async def _send_abort(self, worker: Worker, engine_id: str) -> bool:
        ok = await self.upstream.abort(worker.url, [engine_id], limit=self.settings.control_timeout)
        self.metrics.child(self.metrics.abort_fanout, worker.pool, "ok" if ok else "error").inc()
        return ok

    async def broadcast_abort(self, request_ids: list[str]) -> None:
        async with self._broadcast_slots:  # bounded fan-outs at once (``abort_broadcast_concurrency``)
            workers = [*self.prefill_pool, *self.decode_pool]
            results = await asyncio.gather(
                *(self.upstream.abort(w.url, request_ids, limit=self.settings.control_timeout)
                  for w in workers))
        for w, ok in zip(workers, results, strict=True):
            self.metrics.child(self.metrics.abort_fanout, w.pool, "ok" if ok else "error").inc()

    def abort_ids(self, tenant: Tenant, request_ids: list[str]) -> None:
        """Abort the caller's own requests named by ``request_ids`` (vLLM's engine ids, as the
        client knows them). Ids this process does not know are sent to every worker (other
        processes' and replicas' requests), namespaced as the tenant's (``proxy.ids``); only ids
        that can be this proxy's generate ids are sent anywhere. Raises ``Overloaded`` when
        ``abort_broadcast_queue`` fan-outs are already waiting."""
        unknown: list[str] = []
        for rid in request_ids:
            client_id = abortable_id(rid)
            if client_id is None:
                continue  # vLLM accepts it and aborts nothing
            engine_id = engine_request_id(upstream_id(tenant.tag, client_id))
            records = self.table.get(engine_id)
            if not records:
                unknown.append(engine_id)
            for record in records:
                self.abort_record(record, "client_call")
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

    async def _hop_or_abandon(self, f: Flight, fut: asyncio.Future[Any]) -> bool:
        """Wait for a decode hop's answer (without cancelling it: it outlives the handler). False
        when the request was aborted and the hop did not end within ``abort_grace`` after: a
        worker that ignores the abort must not hold the client until the hop times out (the
        clean-up keeps aborting it)."""
        record = f.record
        if not fut.done() and not record.is_aborted:
            # Callbacks rather than a task waiting on ``record.aborted``: this runs per request.
            woken: asyncio.Future[None] = asyncio.get_running_loop().create_future()

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
        return fut.done()

    async def _respond_aborted(self, request: web.Request, f: Flight, *,
                               done: bool = True) -> web.StreamResponse:
        """What vLLM sends a client whose request was aborted before producing anything.
        ``done=False``: a worker still holds the request (the clean-up frees it)."""
        if done:
            self._set_done(f)
        req, rid = f.request, engine_request_id(f.client_id)
        n = req.sampling_params.n
        prompt_tokens = len(req.token_ids)
        if not req.is_stream:
            body = abort_full_response(rid, model=req.model, created=int(time.time()),
                                       prompt_tokens=prompt_tokens, output_mode=req.output_mode, n=n)
            headers = dict(f.headers)
            headers["Server-Timing"] = f.timing.header(self.clock())
            return web.Response(body=compact_json(body), content_type="application/json", headers=headers)
        headers = dict(f.headers)
        headers["Content-Type"] = "text/event-stream; charset=utf-8"
        resp = web.StreamResponse(status=200, headers=headers)
        await resp.prepare(request)
        out = [data_event(compact_json(abort_stream_chunk(rid, req.output_mode, i))) for i in range(n)]
        if req.include_usage:
            usage = {"request_id": rid, "usage": {"prompt_tokens": prompt_tokens,
                     "total_tokens": prompt_tokens, "completion_tokens": 0},
                     "output_mode": req.output_mode, "choices": []}
            out.append(data_event(compact_json(usage)))
        if request.headers.get("X-PD-Timing") == "1":
            out.append(comment_event("server-timing " + f.timing.header(self.clock())))
        out.append(DONE_EVENT)
        with contextlib.suppress(ConnectionResetError):  # the client is gone: nothing to tell
            await resp.write(b"".join(out))
            await resp.write_eof()
        return resp

    # ---------------------------------------------------------------- release / clean-up

    async def _release_shielded(self, f: Flight) -> None:
        if f.record.kv_params is None:
            return
        if f.release_task is None:
            f.release_task = self.tracker.spawn(self._release(f))
        await asyncio.shield(f.release_task)

    async def _release(self, f: Flight) -> None:
        """Free the KV that P holds for an aborted request: send D the decode request with P's
        params, one token, and let it complete (D pulls, P frees; measured under 0.25 s on
        vLLM 0.32 CPU, where aborting P after it finished does nothing)."""
        record = f.record
        params = record.kv_params
        if params is None:
            return
        fallback = self.decode_pool.candidates() or self.decode_pool.workers
        worker = record.decode_worker or (fallback[0] if fallback else None)
        if worker is None:
            return  # no decode worker at all: the lease expires on P
        record.decode_worker = worker
        body = self.release_body(f.data, record.base_id, params)
        rt = self.pools
        attempts = max(2, rt.decode_retry.attempts)
        for attempt in range(attempts):
            try:
                await self._call(worker, self.upstream.post_generate(
                    "decode", worker.url, body, request_id=record.base_id,
                    total=self.settings.decode_timeout), f.trace.hop("kv_release", worker))
            except UpstreamError as e:
                log.warning("KV release for %s failed: %s", record.engine_id, e.message)
                if isinstance(e, UpstreamStatusError) and e.passthrough:
                    record.kv_params = None  # D refused: the lease will expire on P
                    return
                # A 5xx, transport failure or timeout (seen: NIXL's first handshake with P timing
                # out on a loaded host) may pass on another try: while P still holds the blocks,
                # try again (on another decode worker when there is one; a repeated pull of
                # blocks already freed is harmless, the one token is thrown away).
                if attempt + 1 >= attempts or not self._lease_valid(f) or record.kv_params is None:
                    break
                await asyncio.sleep(rt.decode_retry.delay(attempt, rt.rng))
                others = self.decode_pool.admissible(exclude=(worker,))
                if others:
                    worker = record.decode_worker = min(others, key=lambda w: w.inflight)
                continue
            self._close_lease(f, "aborted")
            return
        self._close_lease(f, "unknown")

    async def cleanup(self, f: Flight) -> None:
        """Free whatever a worker still holds for a request the walk did not finish."""
        record = f.record
        try:
            if record.phase is Phase.PREFILLING and f.prefill_task is not None:
                await self._abort_until(record.prefill_worker, record.engine_id, f.prefill_task,
                                        self.settings.prefill_timeout)
                if not f.prefill_task.done():
                    # Its own timeout ends it; its reply may still hold KV (released below).
                    await asyncio.wait({f.prefill_task})
                if not f.prefill_task.cancelled() and f.prefill_task.exception() is None \
                        and record.phase is Phase.PREFILLING and record.prefill_worker is not None:
                    self._accept_prefill_reply(f, record.prefill_worker, f.prefill_task.result())
            if record.phase is Phase.KV_HELD or (record.kv_params is not None and f.decode_task is None):
                if f.release_task is None:
                    f.release_task = self.tracker.spawn(self._release(f))
                await f.release_task
            elif record.phase is Phase.DECODING and f.decode_task is not None:
                # Abort D until it certainly had the request (first event, or its answer);
                # only then may its connection be closed (before that, closing could leave
                # D never pulling and P holding the KV until its lease ends).
                settle: asyncio.Task[Any] = asyncio.ensure_future(f.settled.wait())
                try:
                    await self._abort_until(record.decode_worker, record.engine_id, settle,
                                            self.settings.decode_timeout)
                finally:
                    settle.cancel()
                if not f.decode_task.done():
                    f.decode_task.cancel()
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await f.decode_task
                if record.lease is not None and record.lease.end is None and f.decode_task.done():
                    # The walk that closes it is gone (client left a non-stream decode, or a
                    # stream before its first event): D answered, so it had the KV; else unknown.
                    answered = not f.decode_task.cancelled() and f.decode_task.exception() is None
                    self._close_lease(f, "aborted" if answered else "unknown")
        finally:
            if f.force_end is not None:
                f.force_end.cancel()
            # A hop that failed after the handler left (the client aborted or went away) ended
            # its task and the headers future with an error nobody awaits: it is known here,
            # not worth asyncio's "exception was never retrieved" at collection.
            for fut in (f.prefill_task, f.decode_task, f.headers_ready, f.release_task):
                if fut is not None and fut.done() and not fut.cancelled():
                    fut.exception()
            self._set_done(f)
            self._forget(f)

    async def _abort_until(self, worker: Worker | None, engine_id: str, task: asyncio.Future[Any],
                           limit: float) -> None:
        """Send abort to ``worker`` and repeat it every ``abort_grace`` until ``task`` is done
        (an abort that reaches vLLM before it registered the request is lost)."""
        deadline = self.clock() + limit
        while not task.done():
            if worker is not None:
                await self._send_abort(worker, engine_id)
            remaining = deadline - self.clock()
            if remaining <= 0:
                break
            await asyncio.wait({task}, timeout=min(self.settings.abort_grace, remaining))

    def _set_done(self, f: Flight) -> None:
        f.record.phase = Phase.DONE
        if f.force_end is not None:
            f.force_end.cancel()
            f.force_end = None

    def _forget(self, f: Flight) -> None:
        self.table.remove(f.record)
        self.flights.pop(id(f.record), None)
