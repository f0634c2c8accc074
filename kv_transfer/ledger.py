"""The KV-lease ledger: every interval during which a prefill worker holds KV for a request, from
usable ``kv_transfer_params`` until the proxy knows the blocks were freed (``pulled``,
``aborted``, ``expired``, ``unknown``). No I/O and no clock of its own: callers pass ``now``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

CloseReason = Literal["pulled", "aborted", "expired", "unknown"]
CLOSE_REASONS: tuple[CloseReason, ...] = ("pulled", "aborted", "expired", "unknown")


@dataclass(slots=True)
class Lease:
    lease_id: int
    request_id: str
    worker: str
    start: float
    expires: float
    blocks: int
    end: float | None = None
    reason: CloseReason | None = None
    decode_until: float | None = None
    """While a decode hop with this KV runs, not expired before this time (the hop's outcome tells)."""

    @property
    def duration(self) -> float | None:
        return None if self.end is None else self.end - self.start

    def as_dict(self, now: float) -> dict[str, Any]:
        return {
            "lease_id": self.lease_id,
            "request_id": self.request_id,
            "worker": self.worker,
            "start": self.start,
            "end": self.end,
            "age_s": (self.end if self.end is not None else now) - self.start,
            "expires_in_s": None if self.end is not None else max(0.0, _ends(self) - now),
            "blocks": self.blocks,
            "reason": self.reason,
        }


def _ends(lease: Lease) -> float:
    """When an open lease expires, if nothing closes it first."""
    return lease.expires if lease.decode_until is None else max(lease.expires, lease.decode_until)


class KVLeaseLedger:
    def __init__(self, *, lease_duration: float, keep_closed: int = 512,
                 on_close: Callable[[Lease], None] | None = None) -> None:
        self.lease_duration = lease_duration
        self._open: dict[int, Lease] = {}
        self._closed: deque[Lease] = deque(maxlen=keep_closed)
        self._next_id = 1
        self._on_close = on_close

    def open(self, request_id: str, worker: str, now: float, *, blocks: int = 0,
             expires_at: float | None = None) -> Lease:
        lease = Lease(self._next_id, request_id, worker, now,
                      expires_at if expires_at is not None else now + self.lease_duration, blocks)
        self._next_id += 1
        self._open[lease.lease_id] = lease
        return lease

    def close(self, lease: Lease, reason: CloseReason, now: float) -> bool:
        """Close ``lease``; False when it was already closed (the first reason wins)."""
        if self._open.pop(lease.lease_id, None) is None:
            return False
        lease.end = now
        lease.reason = reason
        self._closed.append(lease)
        if self._on_close is not None:
            self._on_close(lease)
        return True

    def expire(self, now: float) -> int:
        """Close every open lease whose worker-side lease has run out (``_ends``)."""
        due = [lease for lease in self._open.values() if _ends(lease) <= now]
        for lease in due:
            self.expire_lease(lease, now)
        return len(due)

    def expire_lease(self, lease: Lease, now: float) -> bool:
        """Close ``lease`` as ``expired``, ended when it ran out, if it is open and due by ``now``."""
        if lease.lease_id not in self._open or _ends(lease) > now:
            return False
        return self.close(lease, "expired", max(lease.start, _ends(lease)))  # never before it opened

    @property
    def open_count(self) -> int:
        return len(self._open)

    def open_leases(self) -> list[Lease]:
        return sorted(self._open.values(), key=lambda lease: lease.start)

    def recent_closed(self) -> list[Lease]:
        return list(self._closed)

    def snapshot(self, now: float) -> dict[str, Any]:
        return {
            "open": [lease.as_dict(now) for lease in self.open_leases()],
            "closed": [lease.as_dict(now) for lease in reversed(self._closed)],
            "lease_duration_s": self.lease_duration,
        }
