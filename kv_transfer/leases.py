"""Requests' KV leases: the one place a lease opens or closes. A request keeps P's
``kv_transfer_params`` exactly while its lease is open (``valid``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from kv_transfer.handoff import remote_blocks
from kv_transfer.ledger import CloseReason, KVLeaseLedger, Lease


class Holder(Protocol):
    """A request as the leases see it (``proxy.observe.state.RequestRecord``)."""

    @property
    def engine_id(self) -> str: ...
    kv_params: dict[str, Any] | None
    lease: Lease | None


class LeaseObserver(Protocol):
    def lease_opened(self, lease: Lease, open_count: int) -> None: ...
    def lease_closed(self, lease: Lease, open_count: int) -> None: ...


class RequestLeases:
    def __init__(self, *, lease_duration: float, keep_closed: int, clock: Callable[[], float],
                 observer: LeaseObserver) -> None:
        self.clock = clock
        self._observer = observer
        self.ledger = KVLeaseLedger(lease_duration=lease_duration, keep_closed=keep_closed,
                                    on_close=self._closed)

    def hold(self, holder: Holder, worker_url: str, params: dict[str, Any], *,
             sent: float | None = None) -> int:
        """Open the lease of ``holder``'s KV on P, expiring ``lease_duration`` after ``sent`` (None:
        now), closed as ``expired`` at once if already run out. Returns the blocks held."""
        blocks = remote_blocks(params)
        now = self.clock()
        expires = None if sent is None else min(now, sent) + self.ledger.lease_duration
        holder.kv_params = params
        holder.lease = lease = self.ledger.open(holder.engine_id, worker_url, now, blocks=blocks,
                                                expires_at=expires)
        self._observer.lease_opened(lease, self.ledger.open_count)
        if lease.expires <= now and self.ledger.close(lease, "expired", now):
            holder.kv_params = None
        return blocks

    def close(self, holder: Holder, reason: CloseReason) -> bool:
        """Close ``holder``'s lease (the first reason wins) and forget its params."""
        lease = holder.lease
        if lease is None or not self.ledger.close(lease, reason, self.clock()):
            return False
        holder.kv_params = None
        return True

    def decoding(self, holder: Holder, limit: float) -> None:
        """A decode hop with ``holder``'s KV is sent: the clock does not expire its lease for up to
        ``limit`` seconds (a queued decode keeps P's lease alive), the hop's outcome closes it."""
        lease = holder.lease
        if lease is not None and lease.end is None and holder.kv_params is not None:
            lease.decode_until = self.clock() + limit

    def decode_refused(self, holder: Holder) -> None:
        """A decode worker refused the hop: params dropped, the lease ends by the clock."""
        holder.kv_params = None
        if holder.lease is not None:
            holder.lease.decode_until = None

    def valid(self, holder: Holder) -> bool:
        """``holder``'s KV may still be pulled: params kept and P's lease not run out."""
        lease = holder.lease
        return (holder.kv_params is not None and lease is not None and lease.end is None
                and lease.expires > self.clock())

    def ran_out(self, holder: Holder) -> bool:
        """Whether ``holder``'s lease ended by the clock (then P freed the KV: params forgotten)."""
        lease = holder.lease
        if lease is None:
            return False
        if lease.end is None and not self.ledger.expire_lease(lease, self.clock()):
            return False
        if lease.reason != "expired":
            return False
        holder.kv_params = None
        return True

    def expire(self) -> int:
        """Close every lease whose worker-side lease has run out."""
        return self.ledger.expire(self.clock())

    @property
    def open_count(self) -> int:
        return self.ledger.open_count

    def snapshot(self) -> dict[str, Any]:
        return self.ledger.snapshot(self.clock())

    def _closed(self, lease: Lease) -> None:
        self._observer.lease_closed(lease, self.ledger.open_count)


__all__ = ["Holder", "LeaseObserver", "RequestLeases"]
