"""The aiohttp application: routes, typed app state, start-up and shutdown.

Routes (``/inference/*`` behind the client keys when set, as vLLM guards its ``/inference`` prefix,
each key a tenant (``proxy.tenants``); ``/debug/*`` behind ``--admin-key`` when set):

* ``POST /inference/v1/generate``         the P/D walk (``proxy.serving``)
* ``POST /inference/v1/abort_requests``   vLLM's abort contract, routed by request state
* ``POST /abort_requests``                legacy alias (key required unless mirroring vLLM)
* ``GET  /health``                        the proxy and its pools (last known state; URLs for the admin key)
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
from proxy.tenants import OPEN, Tenant, Tenants
from proxy.tls import upstream_context
from proxy.tracing import Tracing
from proxy.upstream import Upstream

if TYPE_CHECKING:
    from opentelemetry.trace import TracerProvider

SETTINGS = web.AppKey("settings", ProxySettings)
METRICS = web.AppKey("metrics", ProxyMetrics)
SERVING = web.AppKey("serving", Serving)
DRAINING = web.AppKey("draining", asyncio.Event)
ADMIN_KEYS = web.AppKey("admin_keys", Tenants)

GUARDED_PREFIXES = ("/v1", "/v2", "/inference", "/cohere", "/debug")
LEGACY_ABORT_PATH = "/abort_requests"
GENERATE_PATH = "/inference/v1/generate"
ABORT_PATH = "/inference/v1/abort_requests"

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


TENANT = web.RequestKey("tenant", Tenant)
"""Request key: the ``proxy.tenants.Tenant`` whose key the request carried (``OPEN`` without keys)."""
ADMIN_PREFIXES = ("/debug",)


def _admin_key_ok(request: web.Request, admin: Tenants) -> bool:
    return admin.identify(request.headers.get("Authorization")) is not None


def _auth_middleware(settings: ProxySettings, tenants: Tenants, admin: Tenants) -> Middleware:
    """Client keys (tenants) on the inference routes; ``/debug/*`` (every tenant's requests) on the
    admin key when one is set. Without an admin key a single client key still opens ``/debug/*``
    (one tenant sees only its own requests); with several tenants it stays shut (403)."""

    @web.middleware
    async def auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.method == "OPTIONS":
            return await handler(request)
        path = request.path
        if path.startswith(ADMIN_PREFIXES):
            if admin.enabled:
                if not _admin_key_ok(request, admin):
                    return Unauthorized("Unauthorized").to_response()
                return await handler(request)
            if tenants.namespaced:
                return json_response(error_body(
                    "/debug shows every tenant's requests: it needs --admin-key", "Forbidden", 403),
                    status=403)
        guarded = path.startswith(GUARDED_PREFIXES) or (
            path == LEGACY_ABORT_PATH and not settings.legacy_abort_mirror_vllm)
        if not tenants.enabled:
            request[TENANT] = OPEN
        elif guarded:
            tenant = tenants.identify(request.headers.get("Authorization"))
            if tenant is None:
                return Unauthorized("Unauthorized").to_response()
            request[TENANT] = tenant
        elif path == LEGACY_ABORT_PATH:
            # vLLM's keyless legacy abort (--legacy-abort-mirror-vllm): it acts as the only
            # tenant; with several tenants it would reach everyone's requests, so it is refused.
            if tenants.namespaced:
                return Unauthorized("Unauthorized").to_response()
            request[TENANT] = OPEN
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
    return await app[SERVING].generate(request, request.get(TENANT, OPEN))


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
        unique = list(dict.fromkeys(i for i in ids if isinstance(i, str)))
        limit = request.app[SETTINGS].max_abort_ids
        if len(unique) > limit:
            return json_response(error_body(
                f"at most {limit} distinct request ids per abort call, got {len(unique)}",
                "Bad Request", 400, "request_ids"), status=400)
        request.app[SERVING].abort_ids(request.get(TENANT, OPEN), unique)
    return web.Response(status=200)


async def health(request: web.Request) -> web.Response:
    """From the pools' last known state (active probes, circuit breakers, draining): no worker is
    called per request, so probing ``/health`` costs the workers nothing. Worker URLs and their
    load only for the admin key; everyone else gets the status and each pool's counts."""
    serving = request.app[SERVING]
    pools = (serving.prefill_pool, serving.decode_pool)
    ready = all(any(w.available for w in pool) for pool in pools)
    draining = request.app[DRAINING].is_set()
    body: dict[str, object] = {
        "status": "draining" if draining else ("ok" if ready else "degraded"),
        "workers": {pool.name: {"total": len(pool), "available": sum(1 for w in pool if w.available)}
                    for pool in pools},
    }
    admin = request.app[ADMIN_KEYS]
    if admin.enabled and _admin_key_ok(request, admin):
        body["pools"] = {
            pool.name: [{"url": w.url, "healthy": w.healthy, "admitted": w.available,
                         "circuit": w.circuit.name.lower().replace("_", "-"),
                         "draining": w.draining, "inflight": w.inflight} for w in pool]
            for pool in pools
        }
        body["requests_in_flight"] = len(serving.table)
        body["kv_leases_open"] = serving.ledger.open_count
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
    tenants = Tenants(settings.client_keys())
    admin_keys = Tenants([(None, settings.pools.admin_key)] if settings.pools.admin_key else [])
    auth = tenants.enabled or admin_keys.enabled
    middlewares = [error_middleware, *([_auth_middleware(settings, tenants, admin_keys)] if auth else []),
                   body_middleware(settings.max_body_bytes, settings.body_timeout,
                                   (GENERATE_PATH, ABORT_PATH, LEGACY_ABORT_PATH),
                                   large_paths=(GENERATE_PATH,))]
    app = web.Application(middlewares=middlewares, client_max_size=settings.max_body_bytes)
    metrics = ProxyMetrics()
    app[SETTINGS] = settings
    app[METRICS] = metrics
    app[SERVING] = serving = Serving(settings, metrics,
                                     tracing=Tracing.create(settings.otel, tracer_provider))
    app[DRAINING] = asyncio.Event()
    app[ADMIN_KEYS] = admin_keys
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
