from __future__ import annotations

import random

import pytest

from proxy.errors import (
    UpstreamProtocolError,
    UpstreamStatusError,
    UpstreamTimeout,
    UpstreamUnavailable,
)
from proxy.pools.admission import Deadline
from proxy.pools.retry import RetryPolicy, retryable_decode, retryable_prefill, with_retries
from tests.proxy.pools.helpers import FakeClock


def status(code: int) -> UpstreamStatusError:
    return UpstreamStatusError("prefill", "http://127.0.0.1:1", code, b"{}", "application/json")


def test_what_is_retryable() -> None:
    assert retryable_prefill(UpstreamUnavailable("prefill", "w", "connect"))
    assert retryable_prefill(UpstreamTimeout("prefill", "w", "slow"))
    assert retryable_prefill(status(503))
    assert not retryable_prefill(status(400))
    assert not retryable_prefill(UpstreamProtocolError("prefill", "w", "bad json"))
    assert not retryable_prefill(ValueError("x"))
    err = UpstreamUnavailable("decode", "w", "connect")
    assert retryable_decode(err, first_byte_seen=False, lease_valid=True)
    assert not retryable_decode(err, first_byte_seen=True, lease_valid=True)
    assert not retryable_decode(err, first_byte_seen=False, lease_valid=False)


def test_backoff_full_jitter_is_bounded_and_grows() -> None:
    p = RetryPolicy(attempts=5, base_delay=0.1, max_delay=0.3)
    rng = random.Random(1)
    for retry, cap in [(0, 0.1), (1, 0.2), (2, 0.3), (6, 0.3)]:
        samples = [p.delay(retry, rng) for _ in range(200)]
        assert all(0 <= s <= cap for s in samples)
        assert max(samples) > cap * 0.8
    with pytest.raises(ValueError):
        RetryPolicy(attempts=0)


async def test_with_retries_bounded_attempts_and_sleeps() -> None:
    slept: list[float] = []
    seen: list[int] = []

    async def sleep(s: float) -> None:
        slept.append(s)

    async def call(attempt: int) -> str:
        seen.append(attempt)
        if attempt < 2:
            raise UpstreamUnavailable("prefill", f"w{attempt}", "connect")
        return "ok"

    retried: list[int] = []
    out = await with_retries(call, policy=RetryPolicy(attempts=3), retryable=retryable_prefill,
                             rng=random.Random(0), sleep=sleep, on_retry=lambda a, e: retried.append(a))
    assert out == "ok" and seen == [0, 1, 2] and retried == [0, 1] and len(slept) == 2

    seen.clear()
    with pytest.raises(UpstreamUnavailable):
        await with_retries(call, policy=RetryPolicy(attempts=2), retryable=retryable_prefill,
                           rng=random.Random(0), sleep=sleep)
    assert seen == [0, 1]


async def test_with_retries_stops_on_permanent_error_and_deadline() -> None:
    calls = 0

    async def sleep(s: float) -> None:
        pass

    async def bad(attempt: int) -> None:
        nonlocal calls
        calls += 1
        raise status(400)

    with pytest.raises(UpstreamStatusError):
        await with_retries(bad, policy=RetryPolicy(attempts=5), retryable=retryable_prefill,
                           rng=random.Random(0), sleep=sleep)
    assert calls == 1

    clock = FakeClock()
    calls = 0

    async def flaky(attempt: int) -> None:
        nonlocal calls
        calls += 1
        raise status(502)

    with pytest.raises(UpstreamStatusError):
        await with_retries(flaky, policy=RetryPolicy(attempts=5, base_delay=1.0, max_delay=1.0),
                           retryable=retryable_prefill, rng=random.Random(3),
                           deadline=Deadline(clock(), clock), sleep=sleep)
    assert calls == 1  # no time left for any backoff
