"""When a hop is retried: bounded attempts, backoff with full jitter, and which failures are
transient. A prefill hop is retried on another worker (nothing is held yet); a decode hop only
before the first byte of its answer and while P's lease is valid. 4xx and protocol errors would
repeat: never retried here."""

from __future__ import annotations

import random
from dataclasses import dataclass

from proxy.wire.errors import UpstreamStatusError, UpstreamTimeout, UpstreamUnavailable


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    attempts: int = 3
    """Attempts in all, the first included (1: no retry)."""
    base_delay: float = 0.02
    max_delay: float = 0.5

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError("attempts must be at least 1")
        if self.base_delay < 0 or self.max_delay < self.base_delay:
            raise ValueError("need 0 <= base_delay <= max_delay")

    def delay(self, retry: int, rng: random.Random) -> float:
        """Full jitter: uniform in [0, min(max_delay, base_delay * 2**retry)]."""
        return rng.uniform(0.0, min(self.max_delay, self.base_delay * (2**retry)))


def is_transient(exc: BaseException) -> bool:
    """A failure another worker may not have: connect error, timeout, 5xx."""
    if isinstance(exc, UpstreamStatusError):
        return exc.upstream_status >= 500
    return isinstance(exc, UpstreamUnavailable | UpstreamTimeout)
