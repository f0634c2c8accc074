"""Requests' KV leases: the one place a lease opens or closes.

A request holds KV on a prefill worker from the moment the proxy accepts P's
``kv_transfer_params`` until it knows the blocks were freed (``kv_transfer.ledger`` says how each
lease ends). P's own lease may have started as soon as P had the request: the expiry counts from
when the prefill hop was sent, however late its answer arrived. ``RequestLeases`` opens the lease
with the params, closes it with the reason, and tells an observer (the proxy's metrics) of both;
the request itself (anything with ``engine_id``, ``kv_params`` and ``lease``) keeps the params
exactly while its lease is open, so "may this request's KV still be pulled" is one question
(``valid``).

Imports nothing of the proxy.
"""

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
        """P at ``worker_url`` holds ``holder``'s KV, as ``params`` (checked) say: open the
        lease, recorded from now, expiring ``lease_duration`` after ``sent`` (when the hop that
        P answered went out: the earliest P can have finished and started its own lease; None:
        now). A lease already run out by then is closed at once as ``expired`` and its params
        are not kept (``valid`` is False). Returns the blocks held."""
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
        """The proxy knows how ``holder``'s KV ended: close its lease (the first reason wins)
        and forget the params (no hop may pull with them any more)."""
        lease = holder.lease
        if lease is None or not self.ledger.close(lease, reason, self.clock()):
            return False
        holder.kv_params = None
        return True

    def decoding(self, holder: Holder, limit: float) -> None:
        """A decode hop with ``holder``'s KV is sent: its lease is not expired by the clock for
        up to ``limit`` seconds (the hop's own bound) but closed by what the hop tells. A decode
        worker that queues the request keeps P's lease alive meanwhile (vLLM's heartbeats):
        an expiry inferred from the clock alone would be false, and its first reason final."""
        lease = holder.lease
        if lease is not None and lease.end is None and holder.kv_params is not None:
            lease.decode_until = self.clock() + limit

    def decode_refused(self, holder: Holder) -> None:
        """A decode worker refused the hop with ``holder``'s KV (it registered nothing): the
        params are dropped, and the lease ends at P's own lease's end, by the clock."""
        holder.kv_params = None
        if holder.lease is not None:
            holder.lease.decode_until = None

    def valid(self, holder: Holder) -> bool:
        """``holder``'s KV may still be pulled: params kept and P's lease not run out."""
        lease = holder.lease
        return (holder.kv_params is not None and lease is not None and lease.end is None
                and lease.expires > self.clock())

    def ran_out(self, holder: Holder) -> bool:
        """Whether ``holder``'s lease ended by the clock: closed ``expired`` (now, when it is due
        and still open, as ``expire`` would close it, or earlier). P's own timer has then freed
        the KV: the params are forgotten, and no hop (a decode or a release) may pull with them."""
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
