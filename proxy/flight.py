"""One client request as the walk and the clean-up share it: the record the request table keeps
(``proxy.state``), the request as parsed, its timing, and its upstream tasks."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from proxy.ids import Rewrite
from proxy.pools import Deadline, PickContext
from proxy.protocol import GenerateRequest
from proxy.relay import StreamBuffer
from proxy.state import RequestRecord
from proxy.tenants import OPEN, Tenant
from proxy.tracing import NOOP_TRACE, RequestTrace


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

    def durations_ms(self, now: float) -> dict[str, float]:
        def ms(a: float | None, b: float | None) -> float:
            return 0.0 if a is None or b is None else max(0.0, (b - a) * 1000.0)

        return {
            "queue": ms(self.received,
                        self.prefill_start if self.prefill_start is not None else self.decode_start),
            "prefill": ms(self.prefill_start, self.prefill_end),
            "handoff": ms(self.prefill_end, self.decode_start),
            "decode_ttft": ms(self.decode_start, self.first_token),
            "total": ms(self.received, now),
        }

    def header(self, now: float) -> str:
        return ", ".join(f"{name};dur={value:.3f}" for name, value in self.durations_ms(now).items())



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


__all__ = ["Flight", "Timing"]
