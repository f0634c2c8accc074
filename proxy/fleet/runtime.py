"""Everything of the pools one proxy app runs: ``PoolRuntime`` owns the pools, admission, the pair
preflight and the retry policies, and runs their background tasks between ``start`` and ``stop``."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Callable, Coroutine, Iterable, Iterator, Mapping, Sequence
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from proxy.fleet.admin import admin_app
from proxy.fleet.health import (
    HealthChecker,
    LoadScraper,
    Preflight,
    PreflightFn,
    http_fetch,
    http_probe,
    repeat,
)
from proxy.fleet.journal import POLL_INTERVAL, make_journal
from proxy.fleet.kv_events import KvEventsHub, kv_sources
from proxy.fleet.kv_metrics import KvEventsMetrics
from proxy.fleet.membership import ConfigFileSource, Pools
from proxy.fleet.retry import RetryPolicy
from proxy.pools.admission import DEADLINE_HEADER, Admission, Deadline
from proxy.pools.blocks import (
    MODELS_BODY_LIMIT,
    MODELS_PATH,
    BlockSizeLearner,
    BlockSizes,
    ModelLenLearner,
    ModelLens,
    WorkerLearner,
)
from proxy.pools.breaker import BreakerConfig
from proxy.pools.options import PoolSettings
from proxy.pools.policies import PickContext, PickNote, Policy, make_policy
from proxy.pools.pool import LoadWeights, Pool, normalize_url
from proxy.pools.worker import Worker

SESSION_HEADER = "X-Session-ID"
BYPASS_HEADER = "X-PD-Decode-Only"


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
    """The pools' metrics on the app's registry."""

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


def _waker(learner: WorkerLearner) -> Callable[[Pool], None]:
    return lambda _: learner.wake()



class PoolRuntime:
    def __init__(self, settings: PoolSettings, prefill_urls: Iterable[str], decode_urls: Iterable[str],
                 *, block_size: int | None = None, max_model_len: int | None = None,
                 registry: CollectorRegistry | None = None,
                 metrics_with_health: bool = True,
                 clock: Callable[[], float] = time.monotonic, rng: random.Random | None = None) -> None:
        """``block_size``, ``max_model_len``: overrides for every worker (None: each worker's own)."""
        self.settings = s = settings
        self.blocks = BlockSizes(block_size)
        self.learner: BlockSizeLearner | None = None
        self.model_lens = ModelLens(max_model_len)
        self.learners: list[WorkerLearner] = []
        self.clock = clock
        self.rng = rng or random.Random()
        breaker = BreakerConfig(failure_threshold=s.breaker_failures, open_seconds=s.breaker_open_seconds,
                                max_open_seconds=max(s.breaker_max_open_seconds, s.breaker_open_seconds))
        weights = LoadWeights(use_scraped=s.use_scraped_load, max_age=max(10.0, 5 * s.scrape_interval))
        prefill_urls = [normalize_url(u) for u in prefill_urls]
        self.kv_metrics = KvEventsMetrics(registry) if registry is not None else None
        self.kv_events: KvEventsHub | None = None
        """The prefill workers' KV-cache events (``--kv-events``), for the ``kv_events`` policy."""
        if s.kv_events:
            self.kv_events = KvEventsHub(
                kv_sources(s.kv_events, prefill_urls), max_blocks=s.kv_events_max_blocks,
                stale_after=s.kv_events_stale_seconds, clock=clock, metrics=self.kv_metrics)

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
        self._tasks: list[asyncio.Task[None]] = []
        self._closers: list[Callable[[], Any]] = []

    def make_policy(self, name: str) -> Policy:
        s = self.settings
        return make_policy(name, block_size=self.blocks.override or self.key_block_size,
                           prefix_blocks=s.prefix_blocks,
                           imbalance_ratio=s.imbalance_ratio, imbalance_slack=s.imbalance_slack, rng=self.rng,
                           kv=self.kv_events, kv_alpha=s.kv_events_alpha)

    def key_block_size(self) -> int:
        """The smallest block any member reported: not who can take a request, so every replica
        with the same workers keys alike."""
        learned = [w.block_size for pool in self.pools for w in pool if w.block_size]
        return min(learned, default=self.blocks.fallback)

    def pick_context(self, token_ids: Sequence[int], headers: Mapping[str, str],
                     tokens: int = 0) -> PickContext:
        return PickContext(token_ids=token_ids, session_id=headers.get(SESSION_HEADER) or None,
                           tokens=tokens)

    def kv_outcome(self, note: PickNote, reply: dict[str, Any]) -> None:
        """A prefill routed by ``kv_events`` (``note`` filled in) was answered with ``reply``."""
        if note.rule and self.kv_metrics is not None:
            self.kv_metrics.outcome(note.cached, note.prompt_tokens, reply)

    def deadline(self, headers: Mapping[str, str]) -> Deadline | None:
        s = self.settings
        return Deadline.from_header(headers.get(DEADLINE_HEADER), default_ms=s.deadline_default_ms,
                                    clock=self.clock, max_ms=s.deadline_max_ms)

    def bypass_reason(self, prompt_tokens: int) -> str | None:
        """Why this request should skip the prefill hop (None: it should not)."""
        threshold = self.settings.bypass_prompt_tokens
        if threshold is not None:
            if prompt_tokens < threshold:
                return "short_prompt"
        elif prompt_tokens < self.blocks.smallest(self.prefill.admissible() or self.prefill.workers):
            return "short_prompt"
        if self.settings.bypass_when_prefill_unavailable and not self.prefill.candidates():
            return "prefill_unavailable"
        return None

    def one_token_left(self, prompt_tokens: int) -> bool:
        """Whether the prompt leaves room for one generated token only on every decode worker."""
        return self.model_lens.one_token_left(prompt_tokens, self.decode)

    def prefill_too_short(self, prompt_tokens: int) -> list[Worker]:
        """Prefill workers a prompt fills no block of, left out of its pick (no explicit bypass
        threshold)."""
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

    async def start(self, session: aiohttp.ClientSession, preflight_check: PreflightFn | None = None,
                    *, upstream_headers: Mapping[str, str] | None = None) -> None:
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
        self._start_learners(loop, session, upstream_headers)
        if self.kv_events is not None:
            for url in self.kv_events.feeds:
                self._tasks.append(loop.create_task(self.kv_events.follow(url), name=f"pool-kv-events-{url}"))
            self._closers.append(self.kv_events.close)
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
            from proxy.fleet.k8s import (  # noqa: PLC0415  (optional extra)
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

    def _start_learners(self, loop: asyncio.AbstractEventLoop, session: aiohttp.ClientSession,
                        upstream_headers: Mapping[str, str] | None) -> None:
        timeout = self.settings.health_timeout
        if self.blocks.learning:
            self.learner = BlockSizeLearner(list(self.pools), http_fetch(session, timeout))
            self.learners.append(self.learner)
        if self.model_lens.learning:
            self.learners.append(ModelLenLearner(list(self.pools), http_fetch(
                session, timeout, MODELS_PATH, headers=upstream_headers, limit=MODELS_BODY_LIMIT)))
        for learner in self.learners:
            for pool in self.pools:
                pool.on_change.append(_waker(learner))
            self._tasks.append(loop.create_task(learner.run(self.settings.health_interval),
                                                name=f"pool-learn-{type(learner).__name__}"))

    def spawn(self, work: Coroutine[Any, Any, None], name: str) -> None:
        """Run ``work`` as a background task of the pools, cancelled by ``stop``."""
        self._tasks.append(asyncio.get_running_loop().create_task(work, name=name))

    def _health_changed(self, worker: Worker) -> None:
        if not worker.healthy and self.kv_events is not None:
            self.kv_events.forget(worker)
        if not worker.healthy:
            for learner in self.learners:
                learner.forget(worker)  # it may come back with another configuration

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
