from __future__ import annotations

import random

import pytest

from proxy.fleet.retry import RetryPolicy, is_transient
from proxy.wire.errors import (
    UpstreamProtocolError,
    UpstreamStatusError,
    UpstreamTimeout,
    UpstreamUnavailable,
)


def status(code: int) -> UpstreamStatusError:
    return UpstreamStatusError("prefill", "http://127.0.0.1:1", code, b"{}", "application/json")


def test_what_is_transient() -> None:
    assert is_transient(UpstreamUnavailable("prefill", "w", "connect"))
    assert is_transient(UpstreamTimeout("prefill", "w", "slow"))
    assert is_transient(status(503))
    assert is_transient(status(500))
    assert not is_transient(status(400))
    assert not is_transient(status(499))
    assert not is_transient(UpstreamProtocolError("prefill", "w", "bad json"))
    assert not is_transient(ValueError("x"))


def test_backoff_full_jitter_is_bounded_and_grows() -> None:
    p = RetryPolicy(attempts=5, base_delay=0.1, max_delay=0.3)
    rng = random.Random(1)
    for retry, cap in [(0, 0.1), (1, 0.2), (2, 0.3), (6, 0.3)]:
        samples = [p.delay(retry, rng) for _ in range(200)]
        assert all(0 <= s <= cap for s in samples)
        assert max(samples) > cap * 0.8
    with pytest.raises(ValueError):
        RetryPolicy(attempts=0)
