from __future__ import annotations

import pytest

from proxy.pools.breaker import BreakerConfig, CircuitBreaker, CircuitState
from tests.proxy.pools.helpers import FakeClock


def st(b: CircuitBreaker) -> CircuitState:
    """The state, read through a call (mypy would narrow the property across assertions)."""
    return b.state


def make(clock: FakeClock, **kw: object) -> CircuitBreaker:
    cfg = BreakerConfig(**{"failure_threshold": 3, "open_seconds": 5.0, "max_open_seconds": 20.0, **kw})  # type: ignore[arg-type]
    return CircuitBreaker(cfg, clock)


def test_opens_after_consecutive_failures_only() -> None:
    clock = FakeClock()
    b = make(clock)
    b.record_failure()
    b.record_failure()
    b.record_success()  # resets the run of failures
    b.record_failure()
    b.record_failure()
    assert st(b) is CircuitState.CLOSED and b.can_take()
    b.record_failure()
    assert st(b) is CircuitState.OPEN and not b.can_take()
    assert b.retry_in() == pytest.approx(5.0)


def test_half_open_after_wait_then_closes_on_success() -> None:
    clock = FakeClock()
    b = make(clock)
    for _ in range(3):
        b.record_failure()
    clock.advance(4.9)
    assert st(b) is CircuitState.OPEN
    clock.advance(0.2)
    assert st(b) is CircuitState.HALF_OPEN
    assert b.can_take()
    b.begin()
    assert not b.can_take()  # one trial at a time
    b.record_success()
    assert st(b) is CircuitState.CLOSED


def test_half_open_failure_reopens_with_doubled_wait_capped() -> None:
    clock = FakeClock()
    b = make(clock)
    for _ in range(3):
        b.record_failure()
    waits: list[float] = []
    for _ in range(4):
        clock.advance(b.retry_in())
        assert st(b) is CircuitState.HALF_OPEN
        b.begin()
        b.record_failure()
        assert st(b) is CircuitState.OPEN
        waits.append(b.retry_in())
    assert waits == [10.0, 20.0, 20.0, 20.0]
    clock.advance(20.0)
    b.begin()
    b.record_success()
    assert st(b) is CircuitState.CLOSED
    for _ in range(3):
        b.record_failure()
    assert b.retry_in() == 5.0  # back to the base wait after closing


def test_neutral_outcome_frees_the_trial_slot() -> None:
    clock = FakeClock()
    b = make(clock, failure_threshold=1)
    b.record_failure()
    clock.advance(5.0)
    b.begin()
    assert not b.can_take()
    b.record_neutral()
    assert b.can_take() and st(b) is CircuitState.HALF_OPEN


def test_a_trial_that_hangs_stops_holding_its_slot() -> None:
    """Seen in the soak: the trial hung until its 30 s hop timeout while the worker had
    recovered, so the worker stayed out of the pool (and with the other worker's circuit open,
    every request got a 503). After ``trial_seconds`` another trial goes in and can close it."""
    clock = FakeClock()
    b = make(clock, failure_threshold=1, trial_seconds=2.0)
    b.record_failure()
    clock.advance(5.0)
    b.begin()  # the trial that hangs
    clock.advance(1.9)
    assert not b.can_take()
    clock.advance(0.2)
    assert b.can_take() and st(b) is CircuitState.HALF_OPEN
    b.begin()
    assert not b.can_take()  # the new trial holds the slot
    b.record_success()
    assert st(b) is CircuitState.CLOSED
    b.record_failure()  # the hung trial ends late, as a failure: a closed circuit counts it
    assert st(b) is CircuitState.OPEN


def test_trial_time_defaults_to_the_open_time() -> None:
    clock = FakeClock()
    b = make(clock, failure_threshold=1)
    b.record_failure()
    clock.advance(5.0)
    b.begin()
    clock.advance(4.9)
    assert not b.can_take()
    clock.advance(0.2)
    assert b.can_take()


def test_trip_and_reset() -> None:
    clock = FakeClock()
    b = make(clock)
    b.trip()
    assert st(b) is CircuitState.OPEN
    b.reset()
    assert st(b) is CircuitState.CLOSED


@pytest.mark.parametrize("kw", [{"failure_threshold": 0}, {"open_seconds": 0}, {"max_open_seconds": 1.0},
                                {"trial_seconds": 0.0}])
def test_bad_config(kw: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        BreakerConfig(**kw)  # type: ignore[arg-type]


def test_available_in_tells_how_long_until_a_request_may_go_in() -> None:
    clock = FakeClock()
    b = make(clock, failure_threshold=1, trial_seconds=2.0)
    assert b.available_in() == 0.0
    b.record_failure()
    assert b.available_in() == pytest.approx(5.0)
    clock.advance(5.0)
    assert b.available_in() == 0.0  # half-open, the trial slot free
    b.begin()
    clock.advance(0.5)
    assert b.available_in() == pytest.approx(1.5)  # until the running trial stops holding its slot
    b.record_neutral()
    assert b.available_in() == 0.0
