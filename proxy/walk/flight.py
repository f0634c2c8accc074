"""One client request as the walk and the clean-up share it. ``Flight`` owns its lifecycle (phase,
holders, KV lease, abort, upstream tasks, end): no other module assigns those fields."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from kv_transfer.leases import RequestLeases
from kv_transfer.ledger import CloseReason
from proxy.config.tenants import OPEN, Tenant
from proxy.observe.state import Phase, RequestRecord
from proxy.observe.tracing import NOOP_TRACE, RequestTrace
from proxy.pools import Deadline, PickContext, Worker
from proxy.sse.first_token import FirstToken
from proxy.sse.first_token_filter import FirstTokenFilter
from proxy.sse.relay import StreamBuffer
from proxy.wire.ids import Rewrite
from proxy.wire.protocol import GenerateRequest


@dataclass(slots=True)
class Timing:
    """When the walk reached each point of one request (the app's clock, seconds)."""

    received: float
    prefill_start: float | None = None
    """Before the pick of a prefill worker: a wait for one, retries and their backoff count as prefill."""
    prefill_end: float | None = None
    decode_start: float | None = None
    first_token: float | None = None
    """D's first token (a stream's first event, or the whole non-stream reply) was in."""
    first_write: float | None = None
    second_write: float | None = None

    def durations_ms(self, now: float) -> dict[str, float]:
        def ms(a: float | None, b: float | None) -> float:
            return 0.0 if a is None or b is None else max(0.0, (b - a) * 1000.0)

        out = {
            "queue": ms(self.received,
                        self.prefill_start if self.prefill_start is not None else self.decode_start),
            "prefill": ms(self.prefill_start, self.prefill_end),
            "handoff": ms(self.prefill_end, self.decode_start),
            "decode_ttft": ms(self.decode_start, self.first_token),
        }
        if self.first_write is not None:  # P's token went first: the hand-off the client waited
            out["first_to_second"] = ms(self.first_write, self.second_write)
        out["total"] = ms(self.received, now)
        return out

    def header(self, now: float) -> str:
        """``durations_ms`` as the ``Server-Timing`` header's value (``name;dur=ms``, in order)."""
        d = self.durations_ms(now)
        return (_SERVER_TIMING if len(d) == 5 else _SERVER_TIMING_FIRST) % tuple(d.values())


_SERVER_TIMING = "queue;dur=%.3f, prefill;dur=%.3f, handoff;dur=%.3f, decode_ttft;dur=%.3f, total;dur=%.3f"
_SERVER_TIMING_FIRST = _SERVER_TIMING.replace(", total", ", first_to_second;dur=%.3f, total")



@dataclass(slots=True)
class PrefillFirst:

    events: bytes
    tokens: list[FirstToken]
    final: bool
    """P's token ends the request (``ends_at_first_token``): no decode hop."""
    usage: bytes = b""
    written_at: float | None = None

    def payloads(self) -> list[bytes]:
        return [block[6:] for block in self.events.split(b"\n\n") if block.startswith(b"data: ")]


@dataclass(eq=False, slots=True)
class Flight:

    record: RequestRecord
    request: GenerateRequest
    data: dict[str, Any]
    timing: Timing
    prefill_task: asyncio.Future[dict[str, Any]] | None = None
    prefill_sent: float | None = None
    """When the latest prefill hop was sent: the proxy's lease expires counting from it."""
    decode_task: asyncio.Future[Any] | None = None
    release_task: asyncio.Task[None] | None = None
    buffer: StreamBuffer | None = None
    headers_ready: asyncio.Future[None] | None = None
    settled: asyncio.Event = field(default_factory=asyncio.Event)
    """Set once the decode worker certainly registered the request (first event) or ended."""
    force_end: asyncio.TimerHandle | None = None
    headers: dict[str, str] = field(default_factory=dict)
    kv_blocks: int | None = None
    completion_tokens: int | None = None
    deadline: Deadline | None = None
    ctx: PickContext = field(default_factory=PickContext)
    trace: RequestTrace = NOOP_TRACE
    client_id: str = ""
    """The id the client knows the request by (``record.base_id`` is the workers', ``proxy.wire.ids``)."""
    rewrite: Rewrite | None = None
    """Puts the client's id back into worker bytes sent to the client (several tenants only)."""
    tenant: Tenant = OPEN
    first_token: bool = False
    """The prefill worker's token may be the client's first chunk (a stream)."""
    first: PrefillFirst | None = None
    first_filter: FirstTokenFilter | None = None
    abandoned: bool = False
    """The handler stopped waiting for D after an abort: the clean-up logs a hop that then crashes."""
    crashed: bool = False
    """The stream's producer raised unexpectedly: the outcome is ``internal_error``."""

    # The lifecycle: PREFILLING -> KV_HELD -> DECODING -> DONE, the holders, the lease, the abort.

    def abort(self, source: str) -> bool:
        """Record the abort's source (the first stands), wake its waiters once; False if already aborted."""
        record = self.record
        if record.abort_source is not None:
            return False
        record.abort_source = source
        callbacks, record.on_abort = record.on_abort, []
        for callback in callbacks:
            callback()
        return True

    def done(self) -> None:
        self.record.phase = Phase.DONE
        if self.force_end is not None:
            self.force_end.cancel()
            self.force_end = None

    def prefill_on(self, worker: Worker | None, choice: str | None = None) -> None:
        """``worker`` prefills the request (None: decode-only); ``choice``: why the policy chose it."""
        self.record.prefill_worker = worker
        self.record.prefill_choice = choice

    def prefill_started(self, task: asyncio.Future[dict[str, Any]]) -> None:
        self.prefill_task = task

    def prefill_hop_sent(self, at: float) -> None:
        self.prefill_sent = at

    def kv_held(self, leases: RequestLeases, worker_url: str, params: dict[str, Any]) -> int:
        """P's reply is accepted: KV_HELD, its lease expiring from the hop's send; returns P's blocks."""
        self.record.phase = Phase.KV_HELD
        blocks = self.kv_blocks = leases.hold(self.record, worker_url, params, sent=self.prefill_sent)
        return blocks

    def continuation_kv(self, leases: RequestLeases, worker: Worker, params: dict[str, Any],
                        sent: float) -> bool:
        """A continuation's KV is held under a lease (still DECODING); False when the lease ran out."""
        self.record.prefill_worker = worker
        leases.hold(self.record, worker.url, params, sent=sent)
        return self.record.kv_params is not None

    def to_decoding(self, worker: Worker) -> None:
        self.record.decode_worker = worker
        self.record.phase = Phase.DECODING

    def decode_on(self, worker: Worker) -> None:
        self.record.decode_worker = worker

    def decode_started(self, task: asyncio.Future[Any]) -> None:
        self.decode_task = task

    def releasing(self, task: asyncio.Task[None]) -> None:
        self.release_task = task

    def force_end_at(self, handle: asyncio.TimerHandle) -> None:
        """An aborted stream that D does not end in time is ended by ``handle`` (cancelled at DONE)."""
        self.force_end = handle

    def abandon(self) -> None:
        self.abandoned = True

    def crash(self) -> None:
        self.crashed = True

    def lease_valid(self, leases: RequestLeases) -> bool:
        return leases.valid(self.record)

    def close_lease(self, leases: RequestLeases, reason: CloseReason) -> bool:
        """How P's KV ended is known: the lease closes (the first reason wins), the params go."""
        return leases.close(self.record, reason)

    def drop_kv(self, leases: RequestLeases) -> None:
        """No hop will pull P's KV: an open lease ends as ``unknown`` and the params go."""
        leases.close(self.record, "unknown")
        self.record.kv_params = None

    def decoding(self, leases: RequestLeases, limit: float) -> None:
        leases.decoding(self.record, limit)

    def decode_refused(self, leases: RequestLeases) -> None:
        leases.decode_refused(self.record)

    def lease_ran_out(self, leases: RequestLeases) -> bool:
        return leases.ran_out(self.record)

    def access_fields(self, outcome: str, status: int, now: float) -> dict[str, Any]:
        """The fields of the request's one access line; no content."""
        record = self.record
        fields: dict[str, Any] = {
            "request_id": self.client_id,
            **({"tenant": self.tenant.name} if self.tenant.tag else {}),
            "prefill": record.prefill_worker.url if record.prefill_worker is not None else None,
            "decode": record.decode_worker.url if record.decode_worker is not None else None,
            "stream": self.request.is_stream,
            "outcome": outcome,
            "status": status,
            "decode_only": self.headers.get("X-PD-Decode-Only"),
            "abort": record.abort_source,
        }
        if record.prefill_choice is not None:
            fields["kv"] = record.prefill_choice  # kv_events' reason, e.g. "kv 127.0.0.1:8100:384/448"
        for name, value in self.timing.durations_ms(now).items():
            fields[f"{name}_ms"] = round(value, 3)
        fields["completion_tokens"] = self.completion_tokens
        return fields


__all__ = ["Flight", "PrefillFirst", "Timing"]
