"""One client request as the walk and the clean-up share it: the record the request table keeps
(``proxy.observe.state``), the request as parsed, its timing, and its upstream tasks.

``Flight`` owns the request's lifecycle: its phase, who holds it, its KV lease (opened and closed on
the ledger, ``kv_transfer.leases``), its abort, its upstream tasks and its end change only through
its methods; no other module assigns those fields (``tests/test_lifecycle_owner.py``)."""

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
    """The walk began the prefill stage, after the admission queue and before the pick of a
    prefill worker (so a wait for a worker, retries and their backoff count as "prefill"; a
    request that bypasses P starts here too, and its wait for a decode worker is "handoff")."""
    prefill_end: float | None = None
    """P's reply was in (or the prefill hop was given up)."""
    decode_start: float | None = None
    """The decode hop was sent."""
    first_token: float | None = None
    """D's first token (a stream's first event, or the whole non-stream reply) was in."""
    first_write: float | None = None
    """P's token was written to the client (``first_token_from_prefill``)."""
    second_write: float | None = None
    """The write after it (D's tokens from 2 on, or the stream's end) returned."""

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
"""``Timing.header``'s formats, without and with P's token first (one formatting, not one per entry)."""



@dataclass(slots=True)
class PrefillFirst:
    """P's first chunk for one request, as built from its reply (``proxy.stream.first_stream``)."""

    events: bytes
    """The data events to write (``proxy.sse.first_token.first_chunk``)."""
    tokens: list[FirstToken]
    final: bool
    """P's token ends the request (``ends_at_first_token``): no decode hop."""
    usage: bytes = b""
    """The ``include_usage`` chunk after a final first chunk."""
    written_at: float | None = None
    """When the client's write of ``events`` returned (the app's clock)."""

    def payloads(self) -> list[bytes]:
        """The ``data`` payload of each event."""
        return [block[6:] for block in self.events.split(b"\n\n") if block.startswith(b"data: ")]


@dataclass(eq=False, slots=True)
class Flight:
    """What the walk and the clean-up share about one request's upstream calls."""

    record: RequestRecord
    request: GenerateRequest
    data: dict[str, Any]
    timing: Timing
    prefill_task: asyncio.Future[dict[str, Any]] | None = None
    """The prefill hop's task."""
    prefill_sent: float | None = None
    """When the latest prefill attempt's hop was sent (the clock of ``Core``): P's KV lease may run
    from then, so the proxy's lease expires counting from it (``RequestLeases.hold``)."""
    decode_task: asyncio.Future[Any] | None = None
    """The decode hop's task (a stream's: its producer)."""
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
    """OpenTelemetry spans of this request (``proxy.observe.tracing``; a shared no-op when off)."""
    client_id: str = ""
    """The id the client knows the request by (``record.base_id`` is the workers', ``proxy.wire.ids``)."""
    rewrite: Rewrite | None = None
    """Puts the client's id back into worker bytes sent to the client (several tenants only)."""
    tenant: Tenant = OPEN
    first_token: bool = False
    """The prefill worker's token may be the client's first chunk (``first_token_from_prefill``:
    a stream); the prefill hop is then sent for it."""
    first: PrefillFirst | None = None
    """P's first chunk, once built from its reply (None: D's stream is relayed as it is)."""
    first_filter: FirstTokenFilter | None = None
    """Takes token 1 out of D's stream once P's chunk was written."""
    abandoned: bool = False
    """The handler answered the request's abort without waiting longer for D's answer
    (``Aborts.hop_or_abandon`` gave up after the grace): nothing awaits the decode hop any more
    (``headers_ready`` of a stream, the hop's task of a non-stream request), so the clean-up logs
    the error of a hop that then crashes (``Cleanup.run``)."""
    crashed: bool = False
    """The stream's producer raised what it did not expect (``StreamDecode._crashed``): its client's
    stream ended with the proxy's error event; the request's outcome is ``internal_error``."""

    # The lifecycle: PREFILLING -> KV_HELD -> DECODING -> DONE, the holders, the lease, the abort.

    def abort(self, source: str) -> bool:
        """Record the abort's source (the first one stands) and wake its waiters once
        (``RequestRecord.on_abort``); False when already aborted."""
        record = self.record
        if record.abort_source is not None:
            return False
        record.abort_source = source
        callbacks, record.on_abort = record.on_abort, []
        for callback in callbacks:
            callback()
        return True

    def done(self) -> None:
        """Nobody holds anything for the request any more: DONE, and no forced end pending."""
        self.record.phase = Phase.DONE
        if self.force_end is not None:
            self.force_end.cancel()
            self.force_end = None

    def prefill_on(self, worker: Worker | None, choice: str | None = None) -> None:
        """``worker`` prefills the request (None: nobody, it goes decode-only); ``choice``: why the
        policy chose it, when it says."""
        self.record.prefill_worker = worker
        self.record.prefill_choice = choice

    def prefill_started(self, task: asyncio.Future[dict[str, Any]]) -> None:
        """The prefill hop runs as ``task`` (the latest attempt's)."""
        self.prefill_task = task

    def prefill_hop_sent(self, at: float) -> None:
        """The latest prefill attempt's hop went out at ``at`` (P's lease may run from then)."""
        self.prefill_sent = at

    def kv_held(self, leases: RequestLeases, worker_url: str, params: dict[str, Any]) -> int:
        """P's reply is accepted: KV_HELD, its lease open (expiring from the prefill hop's send).
        Returns the blocks P advertised."""
        self.record.phase = Phase.KV_HELD
        blocks = self.kv_blocks = leases.hold(self.record, worker_url, params, sent=self.prefill_sent)
        return blocks

    def continuation_kv(self, leases: RequestLeases, worker: Worker, params: dict[str, Any],
                        sent: float) -> bool:
        """A migrated stream's continuation was prefilled on ``worker``: its KV is held under a
        lease (the phase stays DECODING). False when the lease had run out by P's answer."""
        self.record.prefill_worker = worker
        leases.hold(self.record, worker.url, params, sent=sent)
        return self.record.kv_params is not None

    def to_decoding(self, worker: Worker) -> None:
        """DECODING: the decode hop goes to ``worker``."""
        self.record.decode_worker = worker
        self.record.phase = Phase.DECODING

    def decode_on(self, worker: Worker) -> None:
        """The next decode hop (a retry, a migration, a KV release) goes to ``worker``."""
        self.record.decode_worker = worker

    def decode_started(self, task: asyncio.Future[Any]) -> None:
        """The decode hop runs as ``task`` (a stream's: its producer)."""
        self.decode_task = task

    def releasing(self, task: asyncio.Task[None]) -> None:
        """P's KV is being released through a decode worker by ``task`` (it ends the lease)."""
        self.release_task = task

    def force_end_at(self, handle: asyncio.TimerHandle) -> None:
        """An aborted stream that D does not end in time is ended by ``handle`` (cancelled at DONE)."""
        self.force_end = handle

    def abandon(self) -> None:
        """The handler stopped waiting for the decode hop (``abandoned``)."""
        self.abandoned = True

    def crash(self) -> None:
        """The stream's producer raised what it did not expect (``crashed``)."""
        self.crashed = True

    def lease_valid(self, leases: RequestLeases) -> bool:
        """P's KV may still be pulled (``RequestLeases.valid``)."""
        return leases.valid(self.record)

    def close_lease(self, leases: RequestLeases, reason: CloseReason) -> bool:
        """How P's KV ended is known: the lease closes (the first reason wins), the params go."""
        return leases.close(self.record, reason)

    def drop_kv(self, leases: RequestLeases) -> None:
        """No hop of this request will pull P's KV: a lease still open ends as ``unknown`` and the
        params go (P frees the blocks at its own lease's end)."""
        leases.close(self.record, "unknown")
        self.record.kv_params = None

    def decoding(self, leases: RequestLeases, limit: float) -> None:
        """A decode hop with P's KV goes out (``RequestLeases.decoding``)."""
        leases.decoding(self.record, limit)

    def decode_refused(self, leases: RequestLeases) -> None:
        """A decode worker refused the hop with P's KV (``RequestLeases.decode_refused``)."""
        leases.decode_refused(self.record)

    def lease_ran_out(self, leases: RequestLeases) -> bool:
        """Whether P's lease ended by the clock (``RequestLeases.ran_out``)."""
        return leases.ran_out(self.record)

    def access_fields(self, outcome: str, status: int, now: float) -> dict[str, Any]:
        """The fields of the request's one access line: ids, workers, hop timings, outcome; no
        content."""
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
