"""When a hop is retried: a bounded number of attempts, backoff with full jitter, and which
failures are transient (the walk in ``proxy.walk.prefill`` and ``proxy.walk.decode`` retries them where safe):

* prefill hop: after a connect error, a 5xx or a timeout, on another prefill worker — nothing is
  held yet (a prefill that failed holds no KV; one whose reply was lost is freed by its lease).
* decode hop: on another decode worker, only before the first byte of its answer and while the
  prefill worker's KV lease is still valid (the new worker pulls the same blocks).

4xx answers are the client's fault and protocol errors (a 2xx the proxy cannot use) would repeat,
so neither is retried here; the serving layer alone sends a prefill 200 without usable
kv_transfer_params to another prefill worker not tried yet.
"""

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
        """Full jitter: uniform in [0, min(max_delay, base_delay * 2**retry)] (retry from 0)."""
        return rng.uniform(0.0, min(self.max_delay, self.base_delay * (2**retry)))


def is_transient(exc: BaseException) -> bool:
    """A failure another worker may not have: connect error, timeout, 5xx."""
    if isinstance(exc, UpstreamStatusError):
        return exc.upstream_status >= 500
    return isinstance(exc, UpstreamUnavailable | UpstreamTimeout)
