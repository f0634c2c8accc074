"""proxy.walk.flight: a request's timing (what the access line and ``Server-Timing`` report) and what
each request keeps to itself."""

from __future__ import annotations

import pytest

from proxy.walk.flight import Flight, Timing
from tests.proxy.parts import make_core, make_flight


def test_each_stage_lasts_from_its_point_to_the_next() -> None:
    t = Timing(received=10.0, prefill_start=10.5, prefill_end=12.0, decode_start=12.25, first_token=13.0)
    assert t.durations_ms(now=15.0) == {
        "queue": 500.0, "prefill": 1500.0, "handoff": 250.0, "decode_ttft": 750.0, "total": 5000.0}


def test_a_decode_only_request_queues_until_its_decode_hop() -> None:
    t = Timing(received=10.0, decode_start=10.125, first_token=10.5)
    d = t.durations_ms(now=11.0)
    assert d["queue"] == 125.0 and d["decode_ttft"] == 375.0
    assert d["prefill"] == 0.0 and d["handoff"] == 0.0  # points never reached: zero, not an error


def test_a_request_that_reached_no_hop_has_only_its_total() -> None:
    assert Timing(received=10.0).durations_ms(now=10.25) == {
        "queue": 0.0, "prefill": 0.0, "handoff": 0.0, "decode_ttft": 0.0, "total": 250.0}


def test_a_duration_is_never_negative() -> None:
    # a prefill hop given up (prefill_end) before it was sent, a clock read out of order
    t = Timing(received=10.0, prefill_start=11.0, prefill_end=10.5)
    assert t.durations_ms(now=9.0)["prefill"] == 0.0 and t.durations_ms(now=9.0)["total"] == 0.0


def test_the_server_timing_header_names_every_stage_in_milliseconds() -> None:
    t = Timing(received=1.0, prefill_start=1.001, prefill_end=1.0015, decode_start=1.002, first_token=1.5)
    header = t.header(now=2.0)
    parts = dict(p.split(";dur=") for p in header.split(", "))
    assert list(parts) == ["queue", "prefill", "handoff", "decode_ttft", "total"]
    assert {k: float(v) for k, v in parts.items()} == pytest.approx(
        {"queue": 1.0, "prefill": 0.5, "handoff": 0.5, "decode_ttft": 498.0, "total": 1000.0}, abs=1e-3)
    assert all(len(v.split(".")[1]) == 3 for v in parts.values())  # microsecond resolution


async def test_each_request_keeps_its_own_headers_and_events() -> None:
    core, _, _ = make_core()
    f, g = make_flight(core), make_flight(core, rid="r2")
    f.headers["X-PD-Decode-Only"] = "prefill_error"
    f.settled.set()
    assert g.headers == {} and not g.settled.is_set()
    assert f.ctx is not g.ctx and f.prefill_task is None and f.deadline is None
    assert isinstance(f, Flight)


def test_a_request_is_aborted_once_and_its_waiters_woken_once() -> None:
    f = make_flight(make_core()[0])
    calls: list[str] = []
    f.record.on_abort.append(lambda: calls.append("a"))
    f.record.on_abort.append(lambda: calls.append("b"))
    assert f.abort("client_call")
    assert not f.abort("disconnect")  # the first source stands
    assert f.record.abort_source == "client_call" and f.record.is_aborted
    assert calls == ["a", "b"] and f.record.on_abort == []
