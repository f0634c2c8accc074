"""The pools' settings (``PoolSettings``), each flag of pd-proxy declared on its field with
``setting(...)`` (``proxy.pools.setting``); the admin key from a file or the environment, never the
command line (``admin_key_from``).
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from proxy.pools.policies import POLICY_NAMES
from proxy.pools.setting import setting


@dataclass(frozen=True, slots=True)
class K8sSelector:
    pool: str
    namespace: str
    label_selector: str
    port: str | int


ADMIN_KEY_ENV = "PD_PROXY_ADMIN_KEY"
ADMIN_HOST = "127.0.0.1"


def _k8s_selector(value: str) -> K8sSelector:
    """``POOL:NAMESPACE:SELECTOR:PORT`` (PORT a name or a number)."""
    parts = value.split(":")
    if len(parts) != 4 or not all(parts):
        raise argparse.ArgumentTypeError("expected POOL:NAMESPACE:LABEL_SELECTOR:PORT")
    pool, namespace, selector, port = parts
    return K8sSelector(pool, namespace, selector, int(port) if port.isdigit() else port)


def admin_key_from(a: argparse.Namespace, env: Mapping[str, str]) -> str | None:
    """The admin key, from ``PD_PROXY_ADMIN_KEY`` or ``--admin-key-file`` (one source). ``ValueError``
    for the key on the command line (``--admin-key``: ``ps`` and shell histories show it), both
    sources, an empty or unreadable file, or a key with whitespace inside."""
    if a.admin_key is not None:
        raise ValueError(f"--admin-key would show the admin key in ps: set {ADMIN_KEY_ENV} or "
                         "--admin-key-file instead")
    from_env = env.get(ADMIN_KEY_ENV, "").strip()
    if from_env and a.admin_key_file is not None:
        raise ValueError(f"the admin key comes from {ADMIN_KEY_ENV} or --admin-key-file, not both")
    key = from_env
    if a.admin_key_file is not None:
        try:
            key = a.admin_key_file.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--admin-key-file {a.admin_key_file}: cannot read it "
                             f"({type(e).__name__})") from None
        if not key:
            raise ValueError(f"--admin-key-file {a.admin_key_file} is empty")
    if any(c.isspace() for c in key):
        raise ValueError("the admin key must be one word (whitespace inside it)")
    if (a.admin_port is not None or a.admin_host is not None) and not key:
        raise ValueError(f"--admin-port/--admin-host serve the admin API, which needs an admin key "
                         f"({ADMIN_KEY_ENV} or --admin-key-file)")
    if a.admin_host is not None and a.admin_port is None:
        raise ValueError("--admin-host needs --admin-port")
    if a.admin_port is not None and not 0 <= a.admin_port <= 65535:
        raise ValueError(f"--admin-port must be 0..65535, got {a.admin_port}")
    return key or None


def _admin_host(a: argparse.Namespace, env: Mapping[str, str]) -> str:
    """``--admin-host`` (its flag's default is None, so that ``admin_key_from`` sees it given)."""
    return str(a.admin_host or ADMIN_HOST)


def _zero_is_none(n: int) -> int | None:
    return n or None


@dataclass(frozen=True, slots=True)
class PoolSettings:
    """The pools' settings; a field declared with ``setting(...)`` is a flag of ``pd-proxy`` in the
    ``pools`` group of ``--help``, in this order (``proxy.config.table``)."""

    prefill_policy: str = setting("least_loaded", "how a prefill worker is chosen (proxy/pools/README.md)",
                                  choices=POLICY_NAMES)
    decode_policy: str = setting("least_tokens", "how a decode worker is chosen", choices=POLICY_NAMES)
    prefix_blocks: int = setting(4, "prefix policy: KV blocks of the prompt's start that choose the worker")
    imbalance_ratio: float = 1.5
    imbalance_slack: float = 4.0
    use_scraped_load: bool = setting(False, "let workers' own queue and KV usage (/metrics) feed the choice")
    scrape_interval: float = 2.0
    kv_events: tuple[str, ...] = setting(
        (), "each --prefill worker's KV-event PUB endpoint (vLLM's --kv-events-config), optionally a comma "
            "and its replay endpoint, in --prefill's order (for --prefill-policy kv_events)",
        nargs="+", metavar="ENDPOINT[,REPLAY]")
    kv_events_alpha: float = setting(
        0.5, "kv_events: a request in flight on a worker costs alpha x the prompt's tokens")
    kv_events_stale_seconds: float = setting(
        30.0, "kv_events: a worker sent new blocks that announced none for this long is routed as unknown")
    kv_events_max_blocks: int = setting(
        100_000, "kv_events: the most blocks indexed per prefill worker (least recent dropped)")
    max_inflight: int | None = setting(
        1024, "requests in flight through the proxy, PER PROCESS (--workers N admits N times it); more "
              "wait in the queue, then 429 (0: no limit)", convert=_zero_is_none)
    """Requests in flight through the whole proxy, per process (None: no limit); beyond it they
    wait in the queue (``max_queue``, ``queue_timeout``), beyond that a 429 with Retry-After."""
    max_inflight_per_worker: int | None = setting(
        None, "requests in flight on one worker, PER PROCESS (--workers N: up to N times it); more wait in "
              "the queue")
    max_queue: int = setting(256, "bounded wait queue length, PER PROCESS (and per pool)")
    queue_timeout: float = setting(
        10.0, "seconds a request may wait in the queue (then 503 with Retry-After)")
    retry_after: float = 1.0
    breaker_failures: int = setting(5, "consecutive failures that open a worker's circuit")
    breaker_open_seconds: float = setting(
        5.0, "seconds an open circuit stays open before a trial request (doubles up to 60)")
    breaker_max_open_seconds: float = 60.0
    health_interval: float = setting(2.0, "seconds between active /health probes of each worker")
    health_timeout: float = 5.0
    """A loaded vLLM CPU worker can take seconds to answer /health; nothing waits on a probe."""
    health_fail_threshold: int = 3
    health_recover_threshold: int = 2
    active_health: bool = setting(
        True, "no active probes: breakers and draining only", flag="--no-active-health")
    panic_when_all_unhealthy: bool = setting(
        True, "refuse requests (503) when every worker of a pool failed its probes, instead of routing to "
              "them anyway", flag="--no-health-panic")
    """A pool whose every worker failed its probes routes as if they had not (breakers still
    apply): decode always, prefill only without the bypass (which then takes those requests)."""
    prefill_attempts: int = setting(3, "prefill hops tried per request (on other workers after a failure)")
    decode_attempts: int = setting(2, "decode hops tried per request before its first byte")
    retry_base_delay: float = 0.02
    retry_max_delay: float = 0.5
    migrate: bool = setting(True, "do not migrate streams mid-way", flag="--no-migrate")
    max_migrations: int = 2
    migrate_prefill_tokens: int = setting(
        256, "continuations at least this long are prefilled through the prefill pool")
    """A continuation whose prompt (prompt + tokens generated) is at least this long is prefilled
    through the prefill pool first (0: always; shorter ones: the decode worker computes it)."""
    deadline_default_ms: float | None = setting(None, "deadline of requests without X-PD-Deadline-Ms")
    deadline_max_ms: float | None = None
    deadline_prefill_share: float = 0.5
    """The prefill hop may use at most this share of what remains of a deadline."""
    bypass_prompt_tokens: int | None = setting(
        None, "prompts shorter than this skip prefill (default: one KV block)")
    """Prompts shorter than this skip the prefill hop (None: one KV block of the prefill worker
    that would take it, ``proxy.pools.blocks``; 0: never)."""
    bypass_when_prefill_unavailable: bool = setting(
        True, "with no prefill worker available, answer 503 instead of running decode-only",
        flag="--no-bypass-when-prefill-unavailable")
    preflight: bool = setting(False, "send one tiny P->D hand-off through each new pair before using it")
    preflight_timeout: float = 30.0
    preflight_retry_after: float = 30.0
    config_file: Path | None = setting(None, "TOML pool membership, reloaded", flag="--workers-file")
    config_poll_interval: float = 2.0
    admin_key: str | None = setting(
        None, argparse.SUPPRESS, env=(ADMIN_KEY_ENV,), secret=True, resolve=admin_key_from,
        key_file=("--admin-key-file", "the admin key (one line): turns /admin/workers on behind it; or set "
                                      f"{ADMIN_KEY_ENV} (one source, not both)"))
    """Turns the admin API on (``PD_PROXY_ADMIN_KEY`` or ``--admin-key-file``; ``--admin-key`` is
    refused: ``ps`` would show it)."""
    admin_host: str = setting(ADMIN_HOST, f"with --admin-port: the admin API's own address (default "
                                          f"{ADMIN_HOST})", metavar="HOST", resolve=_admin_host)
    admin_port: int | None = setting(
        None, "serve the admin API on its own listener on this port; the main port then answers 404 for "
              "/admin/*", metavar="PORT")
    """Serve the admin API on its own listener (``admin_host``:``admin_port``) instead of the main
    port, which then answers 404 for ``/admin/*``. None: on the main port."""
    admin_journal: Path | None = None
    """``--workers N``: the run's shared journal of admin changes (``proxy.fleet.journal``), made
    by ``proxy.http.multiproc``; None: changes stay in this process."""
    k8s: tuple[K8sSelector, ...] = setting(
        (), "pool members from the EndpointSlices in namespace NS matching the label SELECTOR (e.g. "
            "decode:serving:pd-proxy.io/pool=decode:http), on the named or numbered PORT; repeat per pool "
            "(needs the k8s extra)", flag="--k8s-endpointslices", metavar="POOL:NS:SELECTOR:PORT",
        parse=_k8s_selector)
    kubeconfig: str | None = setting(
        None, "outside a pod: the kubeconfig for --k8s-endpointslices (default ~/.kube/config)")

    @classmethod
    def plain(cls, **overrides: Any) -> PoolSettings:
        """The walk without the pools' recovery features: no retries, migration, bypass, active
        probes or ejection (least-loaded picks only). For tests of the bare P/D walk."""
        values: dict[str, Any] = {
            "prefill_policy": "least_loaded", "decode_policy": "least_loaded", "prefill_attempts": 1,
            "decode_attempts": 1, "migrate": False, "bypass_prompt_tokens": 0,
            "bypass_when_prefill_unavailable": False, "active_health": False,
            "breaker_failures": 2**31, **overrides}
        return cls(**values)


__all__ = ["ADMIN_KEY_ENV", "K8sSelector", "PoolSettings", "admin_key_from"]
