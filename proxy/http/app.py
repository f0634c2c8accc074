"""The aiohttp application: routes, typed app state, start-up and shutdown.

``/inference/*`` is behind the client keys when set (each key a tenant), ``/debug/*`` behind the
admin key; ``/metrics``, ``/health``, ``/livez`` and ``/readyz`` are open. The generate and abort
calls take the lean front (``proxy.http.lean``): the same checks as the middlewares. The OpenAI
routes (``proxy.openai``) run the same walk after a render on a tokenizer worker."""

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

from proxy.config.logs import ACCESS_LOG, log_access
from proxy.config.settings import ProxySettings
from proxy.config.tenants import OPEN, Tenant, Tenants
from proxy.http.lean import LeanApplication
from proxy.http.limits import BodyLimit, body_middleware
from proxy.http.serving import Serving
from proxy.http.sockets import LISTEN_BACKLOG, reuseport_socket
from proxy.http.tls import server_context, upstream_context
from proxy.observe.diagnostics import runtime_snapshot
from proxy.observe.metrics import CONTENT_TYPE, ProxyMetrics
from proxy.observe.tracing import Tracing
from proxy.openai.routes import CHAT_PATH, COMPLETIONS_PATH, PASS_THROUGH, POST_PATHS, OpenAIRoutes
from proxy.upstream.client import Upstream
from proxy.upstream.hop import AnswerLimits, HopClient
from proxy.walk.aborts import abort_request_ids
from proxy.wire.errors import (
    ON_ERROR,
    BadRequest,
    Forbidden,
    ProxyError,
    ShuttingDown,
    Unauthorized,
    error_middleware,
    json_response,
)

if TYPE_CHECKING:
    from opentelemetry.trace import TracerProvider

SETTINGS = web.AppKey("settings", ProxySettings)
METRICS = web.AppKey("metrics", ProxyMetrics)
SERVING = web.AppKey("serving", Serving)
DRAINING = web.AppKey("draining", asyncio.Event)
ADMIN_KEYS = web.AppKey("admin_keys", Tenants)
OPENAI = web.AppKey("openai", OpenAIRoutes)
log = logging.getLogger("pd_proxy")

GUARDED_PREFIXES = ("/v1", "/v2", "/inference", "/cohere", "/debug")
LEGACY_ABORT_PATH = "/abort_requests"
GENERATE_PATH = "/inference/v1/generate"
ABORT_PATH = "/inference/v1/abort_requests"

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


TENANT = web.RequestKey("tenant", Tenant)
"""The tenant whose key the request carried (``OPEN`` without keys)."""
ADMIN_PREFIXES = ("/debug",)


def _admin_key_ok(request: web.Request, admin: Tenants) -> bool:
    return admin.identify(request.headers.get("Authorization")) is not None


class _Auth:
    """Client keys on the inference routes; ``/debug/*`` (every tenant's requests) on the admin key,
    or without one on the single client key; with several tenants and no admin key it stays shut."""

    def __init__(self, settings: ProxySettings, tenants: Tenants, admin: Tenants) -> None:
        self.settings, self.tenants, self.admin = settings, tenants, admin

    def admin_gate(self, request: web.Request) -> bool:
        if self.admin.enabled:
            if not _admin_key_ok(request, self.admin):
                raise Unauthorized("Unauthorized")
            return True
        if self.tenants.namespaced:
            raise Forbidden("/debug shows every tenant's requests: it needs the admin key "
                            "(PD_PROXY_ADMIN_KEY or --admin-key-file)")
        return False

    def tenant_of(self, request: web.Request) -> Tenant | None:
        """The caller's tenant on a guarded route (raises without a valid key); None on open routes."""
        path = request.path
        if not self.tenants.enabled:
            return OPEN
        legacy = path == LEGACY_ABORT_PATH
        if path.startswith(GUARDED_PREFIXES) or (legacy and not self.settings.legacy_abort_mirror_vllm):
            tenant = self.tenants.identify(request.headers.get("Authorization"))
            if tenant is None:
                raise Unauthorized("Unauthorized")
            return tenant
        if legacy and self.tenants.namespaced:
            # The keyless legacy abort would reach every tenant's requests.
            raise Unauthorized("Unauthorized")
        return OPEN if legacy else None

    def admit(self, request: web.Request) -> None:
        tenant = self.tenant_of(request)
        if tenant is not None:
            request[TENANT] = tenant

    async def __call__(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.method == "OPTIONS":
            return await handler(request)
        if request.path.startswith(ADMIN_PREFIXES) and self.admin_gate(request):
            return await handler(request)
        self.admit(request)
        return await handler(request)


def _auth_middleware(gate: _Auth) -> Middleware:
    @web.middleware
    async def auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        return await gate(request, handler)

    return auth


async def generate(request: web.Request) -> web.StreamResponse:
    app = request.app
    if app[DRAINING].is_set():
        if ACCESS_LOG.isEnabledFor(logging.INFO):
            log_access({"request_id": request.headers.get("X-Request-Id"), "outcome": "rejected",
                         "status": 503}, app[SETTINGS].log_format)
        raise ShuttingDown
    return await app[SERVING].generate(request, request.get(TENANT, OPEN))


async def openai_chat(request: web.Request) -> web.StreamResponse:
    return await _openai(request, chat=True)


async def openai_completions(request: web.Request) -> web.StreamResponse:
    return await _openai(request, chat=False)


async def _openai(request: web.Request, *, chat: bool) -> web.StreamResponse:
    if request.app[DRAINING].is_set():
        raise ShuttingDown
    return await request.app[OPENAI].serve(request, request.get(TENANT, OPEN), chat=chat)


async def openai_pass_through(request: web.Request) -> web.Response:
    return await request.app[OPENAI].pass_through(request)


async def openai_models(request: web.Request) -> web.Response:
    return await request.app[OPENAI].models(request)


async def abort_requests(request: web.Request) -> web.Response:
    ids = abort_request_ids(await request.read(), limit=request.app[SETTINGS].max_abort_ids)
    request.app[SERVING].abort_ids(request.get(TENANT, OPEN), ids)
    return web.Response(status=200)


async def health(request: web.Request) -> web.Response:
    """From the pools' last known state: no worker is called per request. Worker URLs only for the
    admin key."""
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
        body["kv_leases_open"] = serving.leases.open_count
    return json_response(body, status=200 if ready and not draining else 503)


async def livez(request: web.Request) -> web.Response:
    """Liveness, 200 even while draining. Never depends on the workers: a failed liveness probe
    would restart the proxy and drop every live stream."""
    draining = request.app[DRAINING].is_set()
    return json_response({"status": "draining" if draining else "ok"})


def can_route(serving: Serving) -> bool:
    """A decode worker may take a request now, and a prefill worker or the decode-only bypass may.
    Workers at their in-flight cap count; a pool in panic does not."""
    if not any(w.admissible for w in serving.decode_pool):
        return False
    return any(w.admissible for w in serving.prefill_pool) or \
        serving.pools.settings.bypass_when_prefill_unavailable


async def readyz(request: web.Request) -> web.Response:
    """Readiness: 503 when no request can be routed now or while draining."""
    if request.app[DRAINING].is_set():
        return json_response({"status": "draining"}, status=503)
    if not can_route(request.app[SERVING]):
        return json_response({"status": "unavailable"}, status=503)
    return json_response({"status": "ok"})


async def metrics_handler(request: web.Request) -> web.Response:
    request.app[SERVING].expire_leases()
    resp = web.Response(body=request.app[METRICS].render())
    resp.headers["Content-Type"] = CONTENT_TYPE
    return resp


async def kv_leases(request: web.Request) -> web.Response:
    serving = request.app[SERVING]
    serving.expire_leases()
    return json_response(serving.leases.snapshot())


async def requests_table(request: web.Request) -> web.Response:
    serving = request.app[SERVING]
    return json_response({
        "requests": [r.as_dict() for r in serving.table.all()],
        "background_tasks": len(serving.tracker),
    })


async def runtime(request: web.Request) -> web.Response:
    collect = request.query.get("collect", "0")
    if collect not in ("0", "1"):
        raise BadRequest("'collect' must be 0 or 1", param="collect")
    serving = request.app[SERVING]
    return json_response(runtime_snapshot(
        connector=serving.upstream.session.connector, hops=serving.upstream.hops,
        requests=len(serving.table),
        background=len(serving.tracker), leases_open=serving.leases.open_count, collect=collect == "1"))


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    settings = app[SETTINGS]
    serving = app[SERVING]
    tls = upstream_context(settings.upstream_ca_file, settings.upstream_cert_file,
                           settings.upstream_key_file)
    cap = settings.upstream_max_connections_per_host
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=cap,
                                     keepalive_timeout=settings.upstream_keepalive_timeout,
                                     enable_cleanup_closed=True, ssl=tls if tls is not None else True)
    session = aiohttp.ClientSession(connector=connector, auto_decompress=False,
                                    json_serialize=json.dumps)
    hops = HopClient(connect_timeout=settings.connect_timeout,
                     keepalive=settings.upstream_keepalive_timeout, ssl_context=tls, max_per_host=cap,
                     limits=AnswerLimits(head=settings.max_upstream_header_bytes,
                                         body=settings.max_upstream_body_bytes,
                                         error=settings.max_upstream_error_bytes))
    metrics = app[METRICS]

    def count_resend(hop: str, result: str) -> None:
        metrics.child(metrics.upstream_resends, hop, result).inc()

    serving.attach(Upstream(session, api_key=settings.upstream_api_key,
                            connect_timeout=settings.connect_timeout, hops=hops,
                            inject=serving.tracing.hop_header_injector(),
                            abort_limit=settings.control_timeout, count_resend=count_resend))

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
        for flight in serving.table.all_entries():
            serving.abort(flight, "shutdown")
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


class AdminListener:
    """The admin API on its own address (``--admin-port``), up while the app is."""

    def __init__(self, app: web.Application, settings: ProxySettings) -> None:
        self.app = app
        self.settings = settings
        self.runner: web.AppRunner | None = None
        self.address: tuple[str, int] | None = None

    async def start(self) -> None:
        s = self.settings
        port = s.pools.admin_port
        if port is None:
            raise RuntimeError("no --admin-port")
        tls = server_context(s.tls_cert_file, s.tls_key_file) if s.tls_cert_file else None
        self.runner = runner = web.AppRunner(self.app, access_log=None, handle_signals=False,
                                                  shutdown_timeout=1.0)
        await runner.setup()
        site: web.BaseSite
        if s.workers > 1:

            sock = reuseport_socket(s.pools.admin_host, port)
            sock.listen(LISTEN_BACKLOG)
            site = web.SockSite(runner, sock, ssl_context=tls)
        else:
            site = web.TCPSite(runner, s.pools.admin_host, port, ssl_context=tls)
        try:
            await site.start()
        except BaseException:
            await runner.cleanup()
            self.runner = None
            raise
        host, bound = runner.addresses[0][:2]
        self.address = (str(host), int(bound))
        log.info("pd-proxy admin API on %s://%s:%d/admin/workers", "https" if tls else "http",
                 s.pools.admin_host, self.address[1])

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None


ADMIN_LISTENER = web.AppKey("admin_listener", AdminListener)


async def _admin_listener(app: web.Application) -> AsyncIterator[None]:
    listener = app[ADMIN_LISTENER]
    await listener.start()
    try:
        yield
    finally:
        await listener.stop()


def _count_error(request: web.Request, e: ProxyError) -> None:
    if request.path == GENERATE_PATH:
        metrics = request.app[METRICS]
        metrics.child(metrics.requests, e.outcome).inc()


async def _on_shutdown(app: web.Application) -> None:
    app[DRAINING].set()
    app[SERVING].draining = True


READ_BODY_PATHS = (GENERATE_PATH, ABORT_PATH, LEGACY_ABORT_PATH)
LARGE_BODY_PATHS = (GENERATE_PATH,)


def build_app(settings: ProxySettings, *, tracer_provider: TracerProvider | None = None) -> web.Application:
    # Errors outermost (every error in vLLM's shape), then the key, then the body limits (a
    # client without the key never gets its body read).
    tenants = Tenants(settings.client_keys())
    admin_keys = Tenants([(None, settings.pools.admin_key)] if settings.pools.admin_key else [])
    gate = _Auth(settings, tenants, admin_keys) if tenants.enabled or admin_keys.enabled else None
    limit = BodyLimit(settings.max_body_bytes, settings.body_timeout)
    middlewares = [error_middleware, *([_auth_middleware(gate)] if gate is not None else []),
                   body_middleware(limit, READ_BODY_PATHS + POST_PATHS, large_paths=LARGE_BODY_PATHS)]
    app = LeanApplication(limit=limit, middlewares=middlewares, client_max_size=settings.max_body_bytes)
    if gate is not None:
        app.set_guard(gate.admit)
    # a lease stays open at most P's lease, or a decode hop's bound while one holds it (Core.decoding)
    longest_lease = max(settings.lease_duration, settings.longest_decode_hop())
    metrics = ProxyMetrics(longest=settings.longest_request(), lease_duration=longest_lease)
    app[SETTINGS] = settings
    app[METRICS] = metrics
    app[SERVING] = serving = Serving(settings, metrics,
                                     tracing=Tracing.create(settings.otel, tracer_provider))
    app[DRAINING] = asyncio.Event()
    app[ADMIN_KEYS] = admin_keys
    app[ON_ERROR] = _count_error
    app.cleanup_ctx.append(_lifecycle)
    app.on_shutdown.append(_on_shutdown)
    for path, handler in zip(READ_BODY_PATHS, (generate, abort_requests, abort_requests), strict=True):
        app.add_lean_post(path, handler, large=path in LARGE_BODY_PATHS)
    app[OPENAI] = OpenAIRoutes(serving.core, serving.generate_body, serving.abort)
    app.router.add_post(CHAT_PATH, openai_chat)
    app.router.add_post(COMPLETIONS_PATH, openai_completions)
    for path in PASS_THROUGH:
        app.router.add_post(path, openai_pass_through)
    app.router.add_get("/v1/models", openai_models)
    app.router.add_get("/health", health)
    app.router.add_get("/livez", livez)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics_handler)
    app.router.add_get("/debug/kv-leases", kv_leases)
    app.router.add_get("/debug/requests", requests_table)
    app.router.add_get("/debug/runtime", runtime)
    admin = serving.pools.admin_app()
    if admin is not None and settings.pools.admin_port is None:
        app.add_subapp("/admin", admin)  # its own key (the admin key), not the client API keys
    elif admin is not None:
        root = web.Application(middlewares=[error_middleware])  # 404s too in vLLM's shape
        root.add_subapp("/admin", admin)
        app[ADMIN_LISTENER] = AdminListener(root, settings)
        app.cleanup_ctx.append(_admin_listener)  # after the pools start, stopped before they stop
    return app


__all__ = ["ADMIN_LISTENER", "METRICS", "SERVING", "SETTINGS", "AdminListener", "ProxyError", "build_app"]
