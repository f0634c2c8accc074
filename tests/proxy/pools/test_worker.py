"""proxy.pools.worker: one worker as the pools see it. Whether it may take a request (health,
draining, its circuit, its in-flight cap), what a request's end tells its breaker, and its view."""

from __future__ import annotations

import pytest

from proxy.pools import BreakerConfig, CircuitBreaker, CircuitState, Outcome, ScrapedLoad, Worker
from tests.proxy.pools.helpers import FakeClock

URL = "http://127.0.0.1:9201"


def worker(failures: int = 1, **kw: object) -> Worker:
    breaker = CircuitBreaker(BreakerConfig(failure_threshold=failures, open_seconds=5.0), FakeClock())
    return Worker(URL, "decode", breaker=breaker, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(("change", "admissible", "in_panic"), [
    ({}, True, True),
    ({"healthy": False}, False, True),  # failed its probes: only a pool in panic still routes to it
    ({"draining": True}, False, False),
])
def test_who_may_take_a_request(change: dict[str, bool], admissible: bool, in_panic: bool) -> None:
    w = worker()
    for key, value in change.items():
        setattr(w, key, value)
    assert (w.admissible, w.available, w.admissible_in_panic) == (admissible, admissible, in_panic)


def test_a_worker_at_its_cap_is_admissible_but_not_available() -> None:
    w = worker(max_inflight=2)
    w.begin()
    assert w.available
    w.begin()
    assert w.saturated and w.admissible and not w.available
    w.end()
    assert w.available


def test_an_open_circuit_takes_nothing_even_in_panic() -> None:
    w = worker(failures=1)
    w.begin()
    w.end(outcome=Outcome.FAILURE)
    assert w.circuit is CircuitState.OPEN
    assert not w.admissible and not w.admissible_in_panic


@pytest.mark.parametrize(("outcome", "state"), [
    (Outcome.FAILURE, CircuitState.OPEN),
    (Outcome.NEUTRAL, CircuitState.CLOSED),  # the client went away, or a 4xx it caused
    (Outcome.SUCCESS, CircuitState.CLOSED),
])
def test_a_requests_end_tells_the_breaker_its_outcome(outcome: Outcome, state: CircuitState) -> None:
    w = worker(failures=1)
    w.begin(tokens=30)
    assert (w.inflight, w.outstanding_tokens) == (1, 30)
    w.end(tokens=30, outcome=outcome)
    assert (w.inflight, w.outstanding_tokens, w.circuit) == (0, 0, state)


def test_counts_never_go_below_zero() -> None:
    w = worker()
    w.end(tokens=5)  # a release of a worker that left and came back (counted on the old object)
    assert (w.inflight, w.outstanding_tokens) == (0, 0)


def test_the_view_names_the_circuit_and_the_scraped_load() -> None:
    w = worker(failures=1, block_size=16)
    w.sources = {"static", "admin"}
    w.load = ScrapedLoad(waiting=2.0, running=3.0, kv_usage=0.5, at=1.0)
    w.begin()
    w.end(outcome=Outcome.FAILURE)
    view = w.as_dict()
    assert view["circuit"] == "open" and view["sources"] == ["admin", "static"]
    assert view["load"] == {"waiting": 2.0, "running": 3.0, "kv_usage": 0.5} and view["block_size"] == 16
    assert worker().as_dict()["load"] is None
