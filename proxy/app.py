"""The aiohttp application: routes, typed app state, start-up and shutdown.

Routes (``/inference/*`` and ``/debug/*`` behind ``--api-key`` when set, as vLLM guards its
``/inference`` prefix):

* ``POST /inference/v1/generate``         the P/D walk (``proxy.serving``)
* ``POST /inference/v1/abort_requests``   vLLM's abort contract, routed by request state
* ``POST /abort_requests``                legacy alias (key required unless mirroring vLLM)
* ``GET  /health``                        the proxy and its pools
* ``GET  /metrics``                       Prometheus text (no key)
* ``GET  /debug/kv-leases``               the KV-lease ledger (open + recent closed)
* ``GET  /debug/requests``                the request table (state and holders of each request)
* ``GET  /debug/runtime``                 pending tasks, upstream connections, RSS (``proxy.diagnostics``)
* ``/admin/workers``                      pool membership and draining, behind ``--admin-key``
                                          (``proxy.pools.admin``; only when that key is set)
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING

import aiohttp
from aiohttp import web
from aiohttp.typedefs import Middleware

from proxy.diagnostics import runtime_snapshot
from proxy.errors import ProxyError, Unauthorized, error_middleware, json_response
from proxy.hop import HopClient
from proxy.limits import body_middleware
from proxy.logs import ACCESS_LOG, log_access
from proxy.metrics import CONTENT_TYPE, ProxyMetrics
from proxy.protocol import JSONBodyError, error_body, loads_bounded
from proxy.serving import Serving
from proxy.settings import ProxySettings
from proxy.tls import upstream_context
from proxy.tracing import Tracing
from proxy.upstream import Upstream

if TYPE_CHECKING:
    from opentelemetry.trace import TracerProvider

SETTINGS = web.AppKey("settings", ProxySettings)
METRICS = web.AppKey("metrics", ProxyMetrics)
SERVING = web.AppKey("serving", Serving)
DRAINING = web.AppKey("draining", asyncio.Event)

GUARDED_PREFIXES = ("/v1", "/v2", "/inference", "/cohere", "/debug")
LEGACY_ABORT_PATH = "/abort_requests"
GENERATE_PATH = "/inference/v1/generate"
ABORT_PATH = "/inference/v1/abort_requests"

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _key_ok(request: web.Request, key_hash: bytes) -> bool:
    value = request.headers.get("Authorization")
    if not value:
        return False
    scheme, _, param = value.partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(hashlib.sha256(param.encode()).digest(), key_hash)


def _auth_middleware(settings: ProxySettings) -> Middleware:
    assert settings.api_key is not None
    key_hash = hashlib.sha256(settings.api_key.encode()).digest()

    @web.middleware
    async def auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.method != "OPTIONS":
            path = request.path
            guarded = path.startswith(GUARDED_PREFIXES) or (
                path == LEGACY_ABORT_PATH and not settings.legacy_abort_mirror_vllm)
            if guarded and not _key_ok(request, key_hash):
                return Unauthorized("Unauthorized").to_response()
        return await handler(request)

    return auth


async def generate(request: web.Request) -> web.StreamResponse:
    app = request.app
    if app[DRAINING].is_set():
        app[METRICS].requests.labels(outcome="rejected").inc()
        if ACCESS_LOG.isEnabledFor(logging.INFO):
            log_access({"request_id": request.headers.get("X-Request-Id"), "outcome": "rejected",
                         "status": 503}, app[SETTINGS].log_format)
        return json_response(
            error_body("the proxy is shutting down", "ServiceUnavailableError", 503), status=503)
    return await app[SERVING].generate(request)


async def abort_requests(request: web.Request) -> web.Response:
    body = await request.read()
    try:
        obj = loads_bounded(body)  # deep nesting or huge ints are a 400, not a 500
    except JSONBodyError as e:
        return json_response(error_body(f"JSON decode error: {e.detail}", "Bad Request", 400), status=400)
    ids = obj.get("request_ids") if isinstance(obj, dict) else None
    if ids is None:
        return json_response(
            error_body("Missing 'request_ids' in request body", "Bad Request", 400), status=400)
    if isinstance(ids, str):
        ids = [ids]
    if isinstance(ids, list):
        request.app[SERVING].abort_ids([i for i in ids if isinstance(i, str)])
    return web.Response(status=200)


async def health(request: web.Request) -> web.Response:
    serving = request.app[SERVING]
    settings = request.app[SETTINGS]
    workers = [*serving.prefill_pool, *serving.decode_pool]
    results = await asyncio.gather(*(serving.upstream.health(w.url, limit=min(2.0, settings.control_timeout))
                                     for w in workers))
    reachable = {(w.pool, w.url): ok for w, ok in zip(workers, results, strict=True)}
    if not serving.pools.settings.active_health:
        # No active probes: this probe is the only health signal the pools get.
        for w, ok in zip(workers, results, strict=True):
            w.healthy = ok
    # "healthy" is this probe's answer; "admitted" is whether the pool routes to the worker now
    # (active probes with thresholds, circuit breaker, draining: proxy.pools).
    pools = {
        pool.name: [{"url": w.url, "healthy": reachable.get((w.pool, w.url), False),
                     "admitted": w.available, "circuit": w.circuit.name.lower().replace("_", "-"),
                     "draining": w.draining, "inflight": w.inflight} for w in pool]
        for pool in (serving.prefill_pool, serving.decode_pool)
    }
    ready = all(any(reachable.get((w.pool, w.url), False) for w in pool)
                for pool in (serving.prefill_pool, serving.decode_pool))
    draining = request.app[DRAINING].is_set()
    body = {
        "status": "draining" if draining else ("ok" if ready else "degraded"),
        "pools": pools,
        "requests_in_flight": len(serving.table),
        "kv_leases_open": serving.ledger.open_count,
    }
    return json_response(body, status=200 if ready and not draining else 503)


async def metrics_handler(request: web.Request) -> web.Response:
    request.app[SERVING].expire_leases()
    resp = web.Response(body=request.app[METRICS].render())
    resp.headers["Content-Type"] = CONTENT_TYPE
    return resp


async def kv_leases(request: web.Request) -> web.Response:
    serving = request.app[SERVING]
    serving.expire_leases()
    return json_response(serving.ledger.snapshot(serving.clock()))


async def requests_table(request: web.Request) -> web.Response:
    serving = request.app[SERVING]
    return json_response({
        "requests": [r.as_dict() for r in serving.table.all()],
        "background_tasks": len(serving.tracker),
    })


async def runtime(request: web.Request) -> web.Response:
    serving = request.app[SERVING]
    return json_response(runtime_snapshot(
        connector=serving.upstream.session.connector, hops=serving.upstream.hops,
        requests=len(serving.table),
        background=len(serving.tracker), leases_open=serving.ledger.open_count))


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    settings = app[SETTINGS]
    serving = app[SERVING]
    tls = upstream_context(settings.upstream_ca_file, settings.upstream_cert_file,
                           settings.upstream_key_file)
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0,
                                     keepalive_timeout=settings.upstream_keepalive_timeout,
                                     enable_cleanup_closed=True, ssl=tls if tls is not None else True)
    session = aiohttp.ClientSession(connector=connector, auto_decompress=False,
                                    json_serialize=json.dumps)
    hops = HopClient(connect_timeout=settings.connect_timeout,
                     keepalive=settings.upstream_keepalive_timeout, ssl_context=tls)
    serving.attach(Upstream(session, api_key=settings.upstream_api_key,
                            connect_timeout=settings.connect_timeout, hops=hops,
                            inject=serving.tracing.hop_header_injector()))

    async def sweep() -> None:
        while True:
            await asyncio.sleep(1.0)
            serving.expire_leases()
            hops.sweep()

    sweeper = asyncio.get_running_loop().create_task(sweep())
    await serving.start_pools()
    try:
        yield
    finally:
        app[DRAINING].set()
        # Handlers are drained by the runner (shutdown_timeout); what is left are clean-ups.
        for record in serving.table.all():
            serving.abort_record(record, "shutdown")
        await serving.tracker.wait(settings.drain_timeout)
        serving.tracker.cancel_all()
        await serving.tracker.wait(1.0)
        sweeper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sweeper
        await serving.pools.stop()
        await hops.close()
        await session.close()
        serving.tracing.shutdown()


async def _on_shutdown(app: web.Application) -> None:
    app[DRAINING].set()
    app[SERVING].draining = True


def build_app(settings: ProxySettings, *, tracer_provider: TracerProvider | None = None) -> web.Application:
    """``tracer_provider``: the OpenTelemetry provider for ``settings.otel`` (default: the global
    one, or one built from the ``OTEL_*`` variables; see ``proxy.tracing``)."""
    # Errors outermost (every error in vLLM's shape), then the key, then the body limits (a
    # client without the key never gets its body read).
    middlewares = [error_middleware, *([_auth_middleware(settings)] if settings.api_key else []),
                   body_middleware(settings.max_body_bytes, settings.body_timeout,
                                   (GENERATE_PATH, ABORT_PATH, LEGACY_ABORT_PATH))]
    app = web.Application(middlewares=middlewares, client_max_size=settings.max_body_bytes)
    metrics = ProxyMetrics()
    app[SETTINGS] = settings
    app[METRICS] = metrics
    app[SERVING] = serving = Serving(settings, metrics,
                                     tracing=Tracing.create(settings.otel, tracer_provider))
    app[DRAINING] = asyncio.Event()
    app.cleanup_ctx.append(_lifecycle)
    app.on_shutdown.append(_on_shutdown)
    app.router.add_post("/inference/v1/generate", generate)
    app.router.add_post("/inference/v1/abort_requests", abort_requests)
    app.router.add_post(LEGACY_ABORT_PATH, abort_requests)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics_handler)
    app.router.add_get("/debug/kv-leases", kv_leases)
    app.router.add_get("/debug/requests", requests_table)
    app.router.add_get("/debug/runtime", runtime)
    admin = serving.pools.admin_app()
    if admin is not None:
        app.add_subapp("/admin", admin)  # its own key (--admin-key), not the client API key
    return app


__all__ = ["METRICS", "SERVING", "SETTINGS", "ProxyError", "build_app"]
