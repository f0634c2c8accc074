"""``GET /debug/runtime``: what a long run watches for leaks in this proxy process (with
``--workers N``, the serving process's own). ``?collect=1`` runs a full collection first, so that
``python_objects`` counts only what is still reachable."""

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
    """Connections in use and idle; aiohttp has no public counters, so this reads its internals."""
    if connector is None:
        return {"in_use": 0, "idle": 0}
    acquired = getattr(connector, "_acquired", ())
    conns = getattr(connector, "_conns", {})
    return {"in_use": len(acquired), "idle": sum(len(v) for v in conns.values())}


def collector_state() -> dict[str, Any]:
    stats = gc.get_stats()
    return {"collections": [s["collections"] for s in stats],
            "uncollectable": sum(s["uncollectable"] for s in stats),
            "frozen": gc.get_freeze_count()}


def runtime_snapshot(*, connector: aiohttp.BaseConnector | None, hops: HopClient, requests: int,
                     background: int, leases_open: int, collect: bool = False) -> dict[str, Any]:
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
