"""RequestLeases: a request keeps P's params exactly while its lease is open; the observer sees
every open and close."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kv_transfer.leases import RequestLeases
from kv_transfer.ledger import Lease

PARAMS = {"do_remote_prefill": True, "remote_block_ids": [[1, 2, 3], [4]], "remote_engine_id": "e",
          "remote_host": "10.0.0.1", "remote_port": 5600}


@dataclass
class Req:
    engine_id: str
    kv_params: dict[str, Any] | None = None
    lease: Lease | None = None


@dataclass
class Seen:
    events: list[tuple[str, str | None, int]] = field(default_factory=list)

    def lease_opened(self, lease: Lease, open_count: int) -> None:
        self.events.append(("open", lease.request_id, open_count))

    def lease_closed(self, lease: Lease, open_count: int) -> None:
        self.events.append((f"close:{lease.reason}", lease.request_id, open_count))


def leases(now: list[float], seen: Seen) -> RequestLeases:
    return RequestLeases(lease_duration=10.0, keep_closed=8, clock=lambda: now[0], observer=seen)


def test_hold_then_close_keeps_params_exactly_while_open() -> None:
    now, seen = [100.0], Seen()
    ls = leases(now, seen)
    r = Req("generate-tokens-a")
    assert not ls.valid(r)
    assert ls.hold(r, "http://p:1", PARAMS) == 4
    assert r.kv_params is PARAMS and r.lease is not None and r.lease.blocks == 4
    assert ls.valid(r) and ls.open_count == 1
    now[0] = 101.5
    assert ls.close(r, "pulled")
    assert r.kv_params is None and not ls.valid(r)
    assert r.lease.duration == 1.5
    assert not ls.close(r, "aborted")  # the first reason wins
    assert r.lease.reason == "pulled"
    assert seen.events == [("open", "generate-tokens-a", 1), ("close:pulled", "generate-tokens-a", 0)]


def test_a_lease_past_its_end_is_not_valid_and_expires() -> None:
    now, seen = [0.0], Seen()
    ls = leases(now, seen)
    r = Req("b")
    ls.hold(r, "http://p:1", PARAMS)
    now[0] = 10.0
    assert not ls.valid(r)  # P's own timer frees the blocks now: no hop may pull them
    assert ls.expire() == 1 and ls.open_count == 0
    assert seen.events[-1] == ("close:expired", "b", 0)
    assert ls.snapshot()["closed"][0]["reason"] == "expired"


def test_close_without_a_lease_does_nothing() -> None:
    seen = Seen()
    ls = leases([0.0], seen)
    r = Req("c", kv_params=dict(PARAMS))
    assert not ls.close(r, "unknown")
    assert r.kv_params is not None and seen.events == []


def test_the_expiry_counts_from_when_the_hop_was_sent() -> None:
    """P may have finished, and started its own lease, as soon as it had the request: the lease
    is recorded from P's answer but expires ``lease_duration`` after the hop went out."""
    now, seen = [107.0], Seen()
    ls = leases(now, seen)
    r = Req("d")
    ls.hold(r, "http://p:1", PARAMS, sent=100.0)
    assert r.lease is not None and (r.lease.start, r.lease.expires) == (107.0, 110.0)
    now[0] = 109.9
    assert ls.valid(r) and ls.expire() == 0
    now[0] = 110.0
    assert not ls.valid(r)
    assert ls.expire() == 1 and r.lease.end == 110.0 and r.lease.reason == "expired"


def test_an_answer_later_than_the_lease_closes_it_as_expired_at_once() -> None:
    now, seen = [112.0], Seen()
    ls = leases(now, seen)
    r = Req("e")
    assert ls.hold(r, "http://p:1", PARAMS, sent=100.0) == 4
    assert not ls.valid(r) and r.kv_params is None and ls.open_count == 0
    assert r.lease is not None and r.lease.reason == "expired" and r.lease.duration == 0.0
    assert seen.events == [("open", "e", 1), ("close:expired", "e", 0)]
    closed = ls.snapshot()["closed"][0]
    assert closed["reason"] == "expired" and closed["start"] == closed["end"] == 112.0
