"""``GET /debug/runtime``: what a long run watches for leaks in this proxy process.

Pending asyncio tasks, upstream connections (checked out / idle in the keep-alive pools of the
generate hops and of the control calls, summed), the request table, background clean-ups, open
KV leases, the process's resident memory, and the Python objects the cyclic collector tracks
(``python_objects``: containers, the objects a leak piles up; what ``gc.freeze`` moved out at
start-up is ``gc.frozen``, apart) with the collections run per generation. ``?collect=1`` runs a
full collection first (a pause of milliseconds to tens of milliseconds, as the heap goes), so that
``python_objects`` counts only what is still reachable: a count that grows from one quiet moment
to the next is a leak, memory that grows while it does not is the allocator's. The soak benchmark
(``benchmarks/soak.py``) samples it; it sits behind the API key like ``/debug/*``. With
``--workers N`` each answer is the serving process's own.
"""

from __future__ import annotations

import asyncio
import gc
import os
from typing import Any

import aiohttp

from proxy.upstream.hop import HopClient

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes() -> int | None:
    """Resident set size of this process (Linux ``/proc``; None elsewhere)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None


def connector_counts(connector: aiohttp.BaseConnector | None) -> dict[str, int]:
    """Connections checked out (a request is using them) and idle in the keep-alive pool.
    aiohttp has no public counters: this reads its bookkeeping (``_acquired``, ``_conns``)."""
    if connector is None:
        return {"in_use": 0, "idle": 0}
    acquired = getattr(connector, "_acquired", ())
    conns = getattr(connector, "_conns", {})
    return {"in_use": len(acquired), "idle": sum(len(v) for v in conns.values())}


def collector_state() -> dict[str, Any]:
    """The cyclic collector: collections run per generation, objects it found uncollectable, and
    those ``gc.freeze`` took out of its scans."""
    stats = gc.get_stats()
    return {"collections": [s["collections"] for s in stats],
            "uncollectable": sum(s["uncollectable"] for s in stats),
            "frozen": gc.get_freeze_count()}


def runtime_snapshot(*, connector: aiohttp.BaseConnector | None, hops: HopClient, requests: int,
                     background: int, leases_open: int, collect: bool = False) -> dict[str, Any]:
    """``collect``: a full collection first (``python_objects`` then counts only what is reachable)."""
    if collect:
        gc.collect()
    control = connector_counts(connector)
    generate = hops.counts()
    return {
        "pid": os.getpid(),
        "tasks": sum(1 for t in asyncio.all_tasks() if not t.done()),
        "upstream_connections": {k: control[k] + generate[k] for k in ("in_use", "idle")},
        "requests_in_flight": requests,
        "background_tasks": background,
        "kv_leases_open": leases_open,
        "rss_bytes": rss_bytes(),
        "python_objects": len(gc.get_objects()),
        "gc": collector_state(),
    }


__all__ = ["collector_state", "connector_counts", "rss_bytes", "runtime_snapshot"]
