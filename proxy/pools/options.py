"""The pools' settings (``PoolSettings``) and their command-line flags (``add_pool_arguments``,
``pool_settings_from_args``; the admin key from a file or the environment, never the command line).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from proxy.pools.kv_index import kv_sources
from proxy.pools.policies import POLICY_NAMES


@dataclass(frozen=True, slots=True)
class K8sSelector:
    pool: str
    namespace: str
    label_selector: str
    port: str | int


@dataclass(frozen=True, slots=True)
class PoolSettings:
    prefill_policy: str = "least_loaded"
    decode_policy: str = "least_tokens"
    prefix_blocks: int = 4
    imbalance_ratio: float = 1.5
    imbalance_slack: float = 4.0
    use_scraped_load: bool = False
    scrape_interval: float = 2.0
    kv_events: tuple[str, ...] = ()
    """Each ``--prefill`` worker's KV-event endpoints, ``ENDPOINT[,REPLAY]``, in the same order."""
    kv_events_alpha: float = 0.5
    kv_events_stale_seconds: float = 30.0
    kv_events_max_blocks: int = 100_000
    max_inflight: int | None = 1024
    """Requests in flight through the whole proxy, per process (None: no limit); beyond it they
    wait in the queue (``max_queue``, ``queue_timeout``), beyond that a 429 with Retry-After."""
    max_inflight_per_worker: int | None = None
    max_queue: int = 256
    queue_timeout: float = 10.0
    retry_after: float = 1.0
    breaker_failures: int = 5
    breaker_open_seconds: float = 5.0
    breaker_max_open_seconds: float = 60.0
    health_interval: float = 2.0
    health_timeout: float = 5.0
    """A loaded vLLM CPU worker can take seconds to answer /health; nothing waits on a probe."""
    health_fail_threshold: int = 3
    health_recover_threshold: int = 2
    active_health: bool = True
    panic_when_all_unhealthy: bool = True
    """A pool whose every worker failed its probes routes as if they had not (breakers still
    apply): decode always, prefill only without the bypass (which then takes those requests)."""
    prefill_attempts: int = 3
    decode_attempts: int = 2
    retry_base_delay: float = 0.02
    retry_max_delay: float = 0.5
    migrate: bool = True
    max_migrations: int = 2
    migrate_prefill_tokens: int = 256
    """A continuation whose prompt (prompt + tokens generated) is at least this long is prefilled
    through the prefill pool first (0: always; shorter ones: the decode worker computes it)."""
    deadline_default_ms: float | None = None
    deadline_max_ms: float | None = None
    deadline_prefill_share: float = 0.5
    """The prefill hop may use at most this share of what remains of a deadline."""
    bypass_prompt_tokens: int | None = None
    """Prompts shorter than this skip the prefill hop (None: one KV block of the prefill worker
    that would take it, ``proxy.pools.blocks``; 0: never)."""
    bypass_when_prefill_unavailable: bool = True
    preflight: bool = False
    preflight_timeout: float = 30.0
    preflight_retry_after: float = 30.0
    config_file: Path | None = None
    config_poll_interval: float = 2.0
    admin_key: str | None = None
    """Turns the admin API on (``PD_PROXY_ADMIN_KEY`` or ``--admin-key-file``)."""
    admin_host: str = "127.0.0.1"
    admin_port: int | None = None
    """Serve the admin API on its own listener (``admin_host``:``admin_port``) instead of the main
    port, which then answers 404 for ``/admin/*``. None: on the main port."""
    admin_journal: Path | None = None
    """``--workers N``: the run's shared journal of admin changes (``proxy.fleet.journal``), made
    by ``proxy.http.multiproc``; None: changes stay in this process."""
    k8s: tuple[K8sSelector, ...] = ()
    kubeconfig: str | None = None

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


# ------------------------------------------------------------------------------ CLI


def _k8s_selector(value: str) -> K8sSelector:
    """``POOL:NAMESPACE:SELECTOR:PORT`` (PORT a name or a number)."""
    parts = value.split(":")
    if len(parts) != 4 or not all(parts):
        raise argparse.ArgumentTypeError("expected POOL:NAMESPACE:LABEL_SELECTOR:PORT")
    pool, namespace, selector, port = parts
    return K8sSelector(pool, namespace, selector, int(port) if port.isdigit() else port)


def _add_routing(g: argparse._ArgumentGroup, d: PoolSettings) -> None:
    """How a worker is chosen."""
    g.add_argument("--prefill-policy", choices=POLICY_NAMES, default=d.prefill_policy,
                   help="how a prefill worker is chosen (proxy/pools/README.md)")
    g.add_argument("--decode-policy", choices=POLICY_NAMES, default=d.decode_policy,
                   help="how a decode worker is chosen")
    g.add_argument("--prefix-blocks", type=int, default=d.prefix_blocks,
                   help="prefix policy: KV blocks of the prompt's start that choose the worker")
    g.add_argument("--use-scraped-load", action="store_true",
                   help="let workers' own queue and KV usage (/metrics) feed the choice")
    g.add_argument("--kv-events", nargs="+", action="extend", default=[], metavar="ENDPOINT[,REPLAY]",
                   help="each --prefill worker's KV-event PUB endpoint (vLLM's --kv-events-config), "
                        "optionally a comma and its replay endpoint, in --prefill's order "
                        "(for --prefill-policy kv_events)")
    g.add_argument("--kv-events-alpha", type=float, default=d.kv_events_alpha,
                   help="kv_events: a request in flight on a worker costs alpha x the prompt's tokens")
    g.add_argument("--kv-events-stale-seconds", type=float, default=d.kv_events_stale_seconds,
                   help="kv_events: a worker sent new blocks that announced none for this long is "
                        "routed as unknown")
    g.add_argument("--kv-events-max-blocks", type=int, default=d.kv_events_max_blocks,
                   help="kv_events: the most blocks indexed per prefill worker (least recent dropped)")


def _add_admission(g: argparse._ArgumentGroup, d: PoolSettings) -> None:
    """What is admitted, and how long the rest may wait."""
    g.add_argument("--max-inflight", type=int, default=d.max_inflight,
                   help="requests in flight through the proxy, PER PROCESS (--workers N admits N times it); "
                        "more wait in the queue, then 429 (0: no limit)")
    g.add_argument("--max-inflight-per-worker", type=int, default=None,
                   help="requests in flight on one worker, PER PROCESS (--workers N: up to N times it); "
                        "more wait in the queue")
    g.add_argument("--max-queue", type=int, default=d.max_queue,
                   help="bounded wait queue length, PER PROCESS (and per pool)")
    g.add_argument("--queue-timeout", type=float, default=d.queue_timeout,
                   help="seconds a request may wait in the queue (then 503 with Retry-After)")


def _add_health(g: argparse._ArgumentGroup, d: PoolSettings) -> None:
    """Circuit breakers and the active health probes."""
    g.add_argument("--breaker-failures", type=int, default=d.breaker_failures,
                   help="consecutive failures that open a worker's circuit")
    g.add_argument("--breaker-open-seconds", type=float, default=d.breaker_open_seconds,
                   help="seconds an open circuit stays open before a trial request (doubles up to 60)")
    g.add_argument("--health-interval", type=float, default=d.health_interval,
                   help="seconds between active /health probes of each worker")
    g.add_argument("--no-active-health", action="store_true",
                   help="no active probes: breakers and draining only")
    g.add_argument("--no-health-panic", action="store_true",
                   help="refuse requests (503) when every worker of a pool failed its probes, instead "
                        "of routing to them anyway")


def _add_recovery(g: argparse._ArgumentGroup, d: PoolSettings) -> None:
    """Retries, migration, deadlines, the decode-only bypass, the preflight."""
    g.add_argument("--prefill-attempts", type=int, default=d.prefill_attempts,
                   help="prefill hops tried per request (on other workers after a failure)")
    g.add_argument("--decode-attempts", type=int, default=d.decode_attempts,
                   help="decode hops tried per request before its first byte")
    g.add_argument("--no-migrate", action="store_true", help="do not migrate streams mid-way")
    g.add_argument("--migrate-prefill-tokens", type=int, default=d.migrate_prefill_tokens,
                   help="continuations at least this long are prefilled through the prefill pool")
    g.add_argument("--deadline-default-ms", type=float, default=None,
                   help="deadline of requests without X-PD-Deadline-Ms")
    g.add_argument("--bypass-prompt-tokens", type=int, default=None,
                   help="prompts shorter than this skip prefill (default: one KV block)")
    g.add_argument("--no-bypass-when-prefill-unavailable", action="store_true",
                   help="with no prefill worker available, answer 503 instead of running decode-only")
    g.add_argument("--preflight", action="store_true",
                   help="send one tiny P->D hand-off through each new pair before using it")


def _add_membership(g: argparse._ArgumentGroup, d: PoolSettings) -> None:
    """Where the members come from besides the flags: a file, the admin API, Kubernetes."""
    g.add_argument("--workers-file", type=Path, default=None, help="TOML pool membership, reloaded")
    g.add_argument("--admin-key-file", type=Path, default=None, metavar="PATH",
                   help="the admin key (one line): turns /admin/workers on behind it; or set "
                        f"{ADMIN_KEY_ENV} (one source, not both)")
    g.add_argument("--admin-key", default=None, help=argparse.SUPPRESS)  # refused: ps shows it
    g.add_argument("--admin-host", default=None, metavar="HOST",
                   help=f"with --admin-port: the admin API's own address (default {d.admin_host})")
    g.add_argument("--admin-port", type=int, default=None, metavar="PORT",
                   help="serve the admin API on its own listener on this port; the main port then "
                        "answers 404 for /admin/*")
    g.add_argument("--k8s-endpointslices", type=_k8s_selector, action="append", default=[],
                   metavar="POOL:NS:SELECTOR:PORT",
                   help="pool members from the EndpointSlices in namespace NS matching the label "
                        "SELECTOR (e.g. decode:serving:pd-proxy.io/pool=decode:http), on the named or "
                        "numbered PORT; repeat per pool (needs the k8s extra)")
    g.add_argument("--kubeconfig", default=None,
                   help="outside a pod: the kubeconfig for --k8s-endpointslices (default ~/.kube/config)")


def add_pool_arguments(parser: argparse.ArgumentParser) -> None:
    """The pools' flags, in their own ``--help`` group, each defaulting to ``PoolSettings()``'s."""
    g = parser.add_argument_group("pools")
    d = PoolSettings()
    # In --help's order.
    _add_routing(g, d)
    _add_admission(g, d)
    _add_health(g, d)
    _add_recovery(g, d)
    _add_membership(g, d)


ADMIN_KEY_ENV = "PD_PROXY_ADMIN_KEY"


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


def pool_settings_from_args(a: argparse.Namespace, env: Mapping[str, str] | None = None) -> PoolSettings:
    """``env``: where ``PD_PROXY_ADMIN_KEY`` is read (default ``os.environ``)."""
    d = PoolSettings()
    kv_sources(a.kv_events, getattr(a, "prefill", []))  # one per --prefill worker, each well formed
    return PoolSettings(
        prefill_policy=a.prefill_policy, decode_policy=a.decode_policy,
        prefix_blocks=a.prefix_blocks, use_scraped_load=a.use_scraped_load,
        kv_events=tuple(a.kv_events), kv_events_alpha=a.kv_events_alpha,
        kv_events_stale_seconds=a.kv_events_stale_seconds, kv_events_max_blocks=a.kv_events_max_blocks,
        max_inflight=a.max_inflight or None, max_inflight_per_worker=a.max_inflight_per_worker,
        max_queue=a.max_queue,
        queue_timeout=a.queue_timeout, breaker_failures=a.breaker_failures,
        breaker_open_seconds=a.breaker_open_seconds, health_interval=a.health_interval,
        active_health=not a.no_active_health, panic_when_all_unhealthy=not a.no_health_panic,
        prefill_attempts=a.prefill_attempts,
        decode_attempts=a.decode_attempts, migrate=not a.no_migrate,
        migrate_prefill_tokens=a.migrate_prefill_tokens,
        deadline_default_ms=a.deadline_default_ms, bypass_prompt_tokens=a.bypass_prompt_tokens,
        bypass_when_prefill_unavailable=not a.no_bypass_when_prefill_unavailable,
        preflight=a.preflight, config_file=a.workers_file,
        admin_key=admin_key_from(a, os.environ if env is None else env),
        admin_host=a.admin_host or d.admin_host, admin_port=a.admin_port,
        k8s=tuple(a.k8s_endpointslices), kubeconfig=a.kubeconfig,
    )


__all__ = ["K8sSelector", "PoolSettings", "add_pool_arguments", "admin_key_from", "pool_settings_from_args"]
