from __future__ import annotations

from kv_transfer.ledger import KVLeaseLedger, Lease


def test_open_close_and_snapshot() -> None:
    closed: list[Lease] = []
    led = KVLeaseLedger(lease_duration=30, keep_closed=2, on_close=closed.append)
    a = led.open("generate-tokens-a", "http://p1", 10.0, blocks=3)
    b = led.open("generate-tokens-b", "http://p1", 11.0)
    assert led.open_count == 2
    assert led.close(a, "pulled", 10.5)
    assert not led.close(a, "aborted", 12.0)  # first reason wins
    assert a.reason == "pulled" and a.duration == 0.5
    snap = led.snapshot(12.0)
    assert [x["request_id"] for x in snap["open"]] == ["generate-tokens-b"]
    assert snap["open"][0]["expires_in_s"] == 29.0
    assert snap["closed"][0]["reason"] == "pulled"
    assert closed == [a]
    assert led.close(b, "aborted", 13.0)
    assert led.open_count == 0


def test_expiry_closes_at_the_lease_end() -> None:
    led = KVLeaseLedger(lease_duration=30)
    a = led.open("r", "w", 0.0)
    assert led.expire(29.9) == 0
    assert led.expire(31.0) == 1
    assert a.reason == "expired" and a.end == 30.0
    assert led.open_count == 0


def test_a_lease_a_decode_hop_holds_expires_only_after_the_hops_bound() -> None:
    """A decode worker that queues the request keeps P's lease alive: the ledger waits for the
    hop to tell (here ``pulled`` at 45), and expires the lease only past the hop's bound."""
    led = KVLeaseLedger(lease_duration=30)
    a, b = led.open("a", "w", 0.0), led.open("b", "w", 0.0)
    a.decode_until = b.decode_until = 60.0
    assert led.snapshot(40.0)["open"][0]["expires_in_s"] == 20.0  # not before the hop's bound
    assert led.expire(45.0) == 0
    assert led.close(a, "pulled", 45.0) and a.reason == "pulled"
    assert led.expire(61.0) == 1 and b.reason == "expired" and b.end == 60.0


def test_recent_closed_is_bounded() -> None:
    led = KVLeaseLedger(lease_duration=1, keep_closed=3)
    for i in range(10):
        led.close(led.open(f"r{i}", "w", float(i)), "pulled", float(i) + 0.1)
    assert [x.request_id for x in led.recent_closed()] == ["r7", "r8", "r9"]
