"""Pools over time: membership (static, file, Kubernetes), health checks, the hand-off preflight,
the admin API, retries, and the runtime that owns them."""

from proxy.fleet.preflight import handoff_check
from proxy.fleet.retry import is_transient
from proxy.fleet.runtime import BYPASS_HEADER, PoolRuntime

__all__ = ["BYPASS_HEADER", "PoolRuntime", "handoff_check", "is_transient"]
