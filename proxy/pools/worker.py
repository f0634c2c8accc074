"""One upstream worker as the pools see it: load through this proxy, health, breaker, membership."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from proxy.pools.breaker import BreakerConfig, CircuitBreaker, CircuitState


class Outcome(enum.Enum):
    SUCCESS = "success"
    FAILURE = "failure"
    NEUTRAL = "neutral"
    """Nothing learnt about the worker (the client went away, a 4xx the client caused)."""


@dataclass(frozen=True, slots=True)
class ScrapedLoad:
    """What a worker's own ``/metrics`` said at ``at`` (the pool's clock)."""

    waiting: float
    running: float
    kv_usage: float
    at: float


@dataclass(eq=False, slots=True)
class Worker:
    url: str
    pool: str
    breaker: CircuitBreaker = field(default_factory=lambda: CircuitBreaker(BreakerConfig(), time.monotonic))
    max_inflight: int | None = None
    inflight: int = 0
    outstanding_tokens: int = 0
    healthy: bool = True
    """The active probe's verdict (``True`` until probes say otherwise)."""
    draining: bool = False
    sources: set[str] = field(default_factory=set)
    load: ScrapedLoad | None = None
    block_size: int | None = None
    """The worker's KV block size (tokens), from its ``/metrics`` (``proxy.pools.blocks``); None
    until known."""
    max_model_len: int | None = None
    """The worker's model length (prompt and output tokens), from its ``GET /v1/models``
    (``proxy.pools.blocks``); None until known."""

    @property
    def saturated(self) -> bool:
        return self.max_inflight is not None and self.inflight >= self.max_inflight

    @property
    def admissible(self) -> bool:
        """Could take traffic if it had room: healthy, not draining, circuit letting requests in."""
        return self.healthy and not self.draining and self.breaker.can_take()

    @property
    def available(self) -> bool:
        return self.admissible and not self.saturated

    @property
    def admissible_in_panic(self) -> bool:
        """As ``admissible``, ignoring the probes' verdict (a pool in panic: every worker failed them)."""
        return not self.draining and self.breaker.can_take()

    @property
    def circuit(self) -> CircuitState:
        return self.breaker.state

    def begin(self, tokens: int = 0) -> None:
        self.inflight += 1
        self.outstanding_tokens += tokens
        self.breaker.begin()

    def end(self, tokens: int = 0, outcome: Outcome = Outcome.NEUTRAL) -> None:
        self.inflight = max(0, self.inflight - 1)
        self.outstanding_tokens = max(0, self.outstanding_tokens - tokens)
        if outcome is Outcome.SUCCESS:
            self.breaker.record_success()
        elif outcome is Outcome.FAILURE:
            self.breaker.record_failure()
        else:
            self.breaker.record_neutral()

    def as_dict(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "pool": self.pool,
            "inflight": self.inflight,
            "outstanding_tokens": self.outstanding_tokens,
            "healthy": self.healthy,
            "draining": self.draining,
            "circuit": self.circuit.name.lower().replace("_", "-"),
            "sources": sorted(self.sources),
            "max_inflight": self.max_inflight,
            "block_size": self.block_size,
            "load": None if self.load is None else {
                "waiting": self.load.waiting, "running": self.load.running, "kv_usage": self.load.kv_usage},
        }
