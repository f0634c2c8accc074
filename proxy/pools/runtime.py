"""Everything of the pools one proxy app runs: settings, CLI flags, metrics, background tasks.

``PoolRuntime`` owns the prefill and decode pools, the overall admission gate, the pair
preflight and the retry policies, and runs (between ``start`` and ``stop``, so from the app's
``cleanup_ctx``) the active health probes, the optional load scraper, the config-file watcher
and the EndpointSlice watchers. The serving layer asks it for picks, deadlines and bypass
decisions, and counts retries, migrations and rejections through ``PoolMetrics``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from proxy.pools.admin import admin_app
from proxy.pools.admission import DEADLINE_HEADER, Admission, Deadline
from proxy.pools.blocks import BlockSizeLearner, BlockSizes
from proxy.pools.breaker import BreakerConfig
from proxy.pools.health import (
    HealthChecker,
    LoadScraper,
    Preflight,
    PreflightFn,
    http_fetch,
    http_probe,
    repeat,
)
from proxy.pools.journal import POLL_INTERVAL, make_journal
from proxy.pools.membership import ConfigFileSource, Pools
from proxy.pools.policies import POLICY_NAMES, PickContext, Policy, make_policy
from proxy.pools.pool import LoadWeights, Pool
from proxy.pools.retry import RetryPolicy
from proxy.pools.worker import Worker

SESSION_HEADER = "X-Session-ID"
BYPASS_HEADER = "X-PD-Decode-Only"


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
    """``--workers N``: the run's shared journal of admin changes (``proxy.pools.journal``), made
    by ``proxy.multiproc``; None: changes stay in this process."""
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
    return PoolSettings(
        prefill_policy=a.prefill_policy, decode_policy=a.decode_policy,
        prefix_blocks=a.prefix_blocks, use_scraped_load=a.use_scraped_load,
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


# ------------------------------------------------------------------------------ metrics


class _PoolStateCollector(Collector):
    def __init__(self, pools: Pools, with_health: bool) -> None:
        self.pools = pools
        self.with_health = with_health

    def collect(self) -> Iterator[GaugeMetricFamily]:
        circuit = GaugeMetricFamily("pd_proxy_circuit_state",
                                    "Circuit breaker per worker (0 closed, 1 half-open, 2 open)",
                                    labels=["pool", "worker"])
        healthy = GaugeMetricFamily("pd_proxy_worker_healthy", "Worker health (1 ok)",
                                    labels=["pool", "worker"])
        for pool in self.pools:
            for w in pool:
                circuit.add_metric([pool.name, w.url], float(int(w.circuit)))
                healthy.add_metric([pool.name, w.url], 1.0 if w.healthy else 0.0)
        yield circuit
        if self.with_health:
            yield healthy


class PoolMetrics:
    """The pools' metrics on the app's registry. ``with_health``: also export
    ``pd_proxy_worker_healthy`` from the pools (when the app does not keep its own gauge)."""

    def __init__(self, registry: CollectorRegistry, pools: Pools, *, with_health: bool = True) -> None:
        self.retries = Counter("pd_proxy_retries", "Hops retried on another worker", ["hop"],
                               registry=registry)
        self.migrations = Counter("pd_proxy_migrations", "Streams continued on another decode worker",
                                  registry=registry)
        self.queue_rejections = Counter("pd_proxy_queue_rejections",
                                        "Requests refused by admission (queue full or wait timed out)",
                                        registry=registry)
        for hop in ("prefill", "decode"):
            self.retries.labels(hop=hop)
        registry.register(_PoolStateCollector(pools, with_health))


# ------------------------------------------------------------------------------ runtime


class PoolRuntime:
    def __init__(self, settings: PoolSettings, prefill_urls: Iterable[str], decode_urls: Iterable[str],
                 *, block_size: int | None = None, registry: CollectorRegistry | None = None,
                 metrics_with_health: bool = True,
                 clock: Callable[[], float] = time.monotonic, rng: random.Random | None = None) -> None:
        """``block_size``: the workers' KV block size for all of them (``--kv-block-size``); None:
        each worker's own, read from its ``/metrics`` (``proxy.pools.blocks``)."""
        self.settings = s = settings
        self.blocks = BlockSizes(block_size)
        """Per worker KV block sizes: prefix hashing, the short-prompt bypass, preflight, the
        suspect-no-transfer counter."""
        self.learner: BlockSizeLearner | None = None
        self.clock = clock
        self.rng = rng or random.Random()
        breaker = BreakerConfig(failure_threshold=s.breaker_failures, open_seconds=s.breaker_open_seconds,
                                max_open_seconds=max(s.breaker_max_open_seconds, s.breaker_open_seconds))
        weights = LoadWeights(use_scraped=s.use_scraped_load, max_age=max(10.0, 5 * s.scrape_interval))

        def pool(name: str, urls: Iterable[str], policy: str, panic: bool) -> Pool:
            return Pool(name, urls, policy=self.make_policy(policy), breaker=breaker, clock=clock,
                        max_inflight_per_worker=s.max_inflight_per_worker, max_waiters=s.max_queue,
                        retry_after=s.retry_after, weights=weights, panic=panic)

        panic = s.panic_when_all_unhealthy
        self.prefill = pool("prefill", prefill_urls, s.prefill_policy,
                            panic and not s.bypass_when_prefill_unavailable)
        self.decode = pool("decode", decode_urls, s.decode_policy, panic)
        self.pools = Pools([self.prefill, self.decode], policy_factory=self.make_policy)
        self.admission = Admission(s.max_inflight, max_queue=s.max_queue, queue_timeout=s.queue_timeout,
                                   retry_after=s.retry_after)
        self.preflight = Preflight(None, timeout=s.preflight_timeout, retry_after=s.preflight_retry_after,
                                   clock=clock)
        self.prefill_retry = RetryPolicy(attempts=s.prefill_attempts, base_delay=s.retry_base_delay,
                                         max_delay=max(s.retry_max_delay, s.retry_base_delay))
        self.decode_retry = RetryPolicy(attempts=s.decode_attempts, base_delay=s.retry_base_delay,
                                        max_delay=max(s.retry_max_delay, s.retry_base_delay))
        self.metrics = (PoolMetrics(registry, self.pools, with_health=metrics_with_health)
                        if registry is not None else None)
        self.health: HealthChecker | None = None
        self.config_source = (ConfigFileSource(s.config_file, self.pools)
                              if s.config_file is not None else None)
        self.journal = make_journal(s.admin_journal, self.pools)
        """Admin changes: this process only, or (``--workers N``) every process of the run."""
        self._tasks: list[asyncio.Task[None]] = []
        self._closers: list[Callable[[], Any]] = []

    def make_policy(self, name: str) -> Policy:
        s = self.settings
        return make_policy(name, block_size=self.blocks.override or self.key_block_size,
                           prefix_blocks=s.prefix_blocks,
                           imbalance_ratio=s.imbalance_ratio, imbalance_slack=s.imbalance_slack, rng=self.rng)

    def key_block_size(self) -> int:
        """The prefix policy's key block: the smallest block any worker reported (16 until one
        did). From the membership, not from who can take a request, so it does not change with
        a worker's load or health, and every replica with the same workers keys alike."""
        learned = [w.block_size for pool in self.pools for w in pool if w.block_size]
        return min(learned, default=self.blocks.fallback)

    # -------------------------------------------------------------- per request

    def pick_context(self, token_ids: Sequence[int], headers: Mapping[str, str],
                     tokens: int = 0) -> PickContext:
        return PickContext(token_ids=token_ids, session_id=headers.get(SESSION_HEADER) or None,
                           tokens=tokens)

    def deadline(self, headers: Mapping[str, str]) -> Deadline | None:
        s = self.settings
        return Deadline.from_header(headers.get(DEADLINE_HEADER), default_ms=s.deadline_default_ms,
                                    clock=self.clock, max_ms=s.deadline_max_ms)

    def bypass_reason(self, prompt_tokens: int) -> str | None:
        """Why this request should skip the prefill hop (None: it should not). ``short_prompt``:
        shorter than ``--bypass-prompt-tokens``, or by default than one block of every prefill
        worker that could take it (``prefill_too_short`` leaves out those it is too short for)."""
        threshold = self.settings.bypass_prompt_tokens
        if threshold is not None:
            if prompt_tokens < threshold:
                return "short_prompt"
        elif prompt_tokens < self.blocks.smallest(self.prefill.admissible() or self.prefill.workers):
            return "short_prompt"
        if self.settings.bypass_when_prefill_unavailable and not self.prefill.candidates():
            return "prefill_unavailable"
        return None

    def prefill_too_short(self, prompt_tokens: int) -> list[Worker]:
        """Prefill workers a prompt fills no block of (by default, ``--bypass-prompt-tokens`` unset):
        left out of its prefill pick, so the bypass threshold is that of the worker chosen."""
        if self.settings.bypass_prompt_tokens is not None:
            return []
        return [w for w in self.prefill if prompt_tokens < self.blocks.of(w)]

    def admin_app(self) -> web.Application | None:
        key = self.settings.admin_key
        return admin_app(self.pools, key, self.journal) if key else None

    def count_retry(self, hop: str) -> None:
        if self.metrics is not None:
            self.metrics.retries.labels(hop=hop).inc()

    def count_migration(self) -> None:
        if self.metrics is not None:
            self.metrics.migrations.inc()

    def count_rejection(self) -> None:
        if self.metrics is not None:
            self.metrics.queue_rejections.inc()

    # -------------------------------------------------------------- lifecycle

    async def start(self, session: aiohttp.ClientSession, preflight_check: PreflightFn | None = None) -> None:
        s = self.settings
        loop = asyncio.get_running_loop()
        if s.preflight and preflight_check is not None:
            self.preflight.check = preflight_check

            def prune(_: Pool) -> None:
                self.preflight.prune([w.url for w in self.prefill], [w.url for w in self.decode])
                self.preflight.start_all(self.prefill, self.decode)

            self.prefill.on_change.append(prune)
            self.decode.on_change.append(prune)
            self.preflight.start_all(self.prefill, self.decode)
        if self.blocks.learning:
            learner = self.learner = BlockSizeLearner(list(self.pools), http_fetch(session, s.health_timeout))
            for pool in self.pools:
                pool.on_change.append(lambda _: learner.wake())
            self._tasks.append(loop.create_task(learner.run(s.health_interval), name="pool-block-sizes"))
        if s.active_health:
            self.health = HealthChecker(list(self.pools), http_probe(session, s.health_timeout),
                                        fail_threshold=s.health_fail_threshold,
                                        recover_threshold=s.health_recover_threshold,
                                        on_change=self._health_changed)
            self._tasks.append(loop.create_task(self.health.run(s.health_interval), name="pool-health"))
        if s.use_scraped_load:
            scraper = LoadScraper(list(self.pools), http_fetch(session, s.health_timeout), self.clock)
            self._tasks.append(loop.create_task(scraper.run(s.scrape_interval), name="pool-scrape"))
        if s.admin_journal is not None:
            journal = self.journal
            journal.catch_up()  # what other processes already changed; then poll

            async def look() -> None:
                journal.catch_up(chunks=1)

            self._tasks.append(loop.create_task(repeat(POLL_INTERVAL, look), name="pool-admin-journal"))
        if self.config_source is not None:
            self.config_source.check()  # apply at once; then poll
            self._tasks.append(loop.create_task(self.config_source.run(s.config_poll_interval),
                                                name="pool-config-file"))
        if s.k8s:
            from proxy.pools.k8s import (  # noqa: PLC0415  (optional extra)
                EndpointSliceSource,
                SliceSelector,
                api_client_from_environment,
            )

            api_client = await api_client_from_environment(s.kubeconfig)
            self._closers.append(api_client.close)
            for sel in s.k8s:
                source = EndpointSliceSource(self.pools, SliceSelector(sel.pool, sel.namespace,
                                                                       sel.label_selector, sel.port),
                                             api_client)
                self._tasks.append(loop.create_task(source.run(), name=f"pool-k8s-{sel.pool}"))

    def _health_changed(self, worker: Worker) -> None:
        if not worker.healthy and self.learner is not None:
            self.learner.forget(worker)  # it may come back with another configuration

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        await self.preflight.close()
        self.journal.close()
        for close in self._closers:
            await close()
        self._closers.clear()
