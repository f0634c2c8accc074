"""The pd-sim aiohttp application: vLLM 0.32's generate/abort/health/metrics/models surface
(``serving.py``) plus the simulator's own ``/sim/*`` endpoints (``admin.py``)."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from .admin import kv_free, kv_heartbeat, kv_pull, sim_faults, sim_state
from .engine import KvPool, LeaseTable, Scheduler
from .errors import InternalError, SimError
from .kv_events import SimKvEventPublisher
from .metrics import SimMetrics
from .openai import (
    chat_completions,
    chat_derender,
    chat_render,
    completions,
    completions_derender,
    completions_render,
)
from .serving import abort_requests, generate
from .settings import SimSettings
from .state import SIM, SimState, error_response, json_response, request_id_header
from .tokenizer import ByteTokenizer

log = logging.getLogger("pd_sim")

GUARDED_PREFIX = ("/v1", "/v2", "/inference", "/cohere")
KV_EVENTS = web.AppKey("pd_sim_kv_events", SimKvEventPublisher)


def _api_key_ok(request: web.Request, api_key: str) -> bool:
    value = request.headers.get("Authorization")
    if not value:
        return False
    scheme, _, param = value.partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(param.encode(), api_key.encode())


@web.middleware
async def _middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    st = request.app[SIM]
    key = st.settings.api_key
    if (
        key is not None
        and request.method != "OPTIONS"
        and request.path.startswith(GUARDED_PREFIX)
        and not _api_key_ok(request, key)
    ):
        return json_response({"error": "Unauthorized"}, 401)
    try:
        return await handler(request)
    except SimError as e:
        return error_response(e, request_id_header(request))
    except web.HTTPNotFound:
        return json_response({"detail": "Not Found"}, 404)
    except web.HTTPMethodNotAllowed:
        return json_response({"detail": "Method Not Allowed"}, 405)
    except web.HTTPException:
        raise
    except Exception:
        # vLLM answers an unexpected failure with its generic 500 error object
        log.exception("pd-sim: unexpected error in %s %s", request.method, request.path)
        return error_response(InternalError(), request_id_header(request))


async def health(request: web.Request) -> web.Response:
    return web.Response(status=200)


async def metrics(request: web.Request) -> web.Response:
    st = request.app[SIM]
    st.metrics.kv_usage.set(st.pool.usage)
    data = generate_latest(st.metrics.registry)
    return web.Response(body=data, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def models(request: web.Request) -> web.Response:
    st = request.app[SIM]
    s = st.settings
    return json_response(
        {
            "object": "list",
            "data": [
                {
                    "id": s.model_name,
                    "object": "model",
                    "created": int(time.time()),
                    "owned_by": "vllm",
                    "root": s.model_name,
                    "parent": None,
                    "max_model_len": s.max_model_len,
                    "permission": [
                        {
                            "id": f"modelperm-{uuid.uuid4().hex[:16]}",
                            "object": "model_permission",
                            "created": int(time.time()),
                            "allow_create_engine": False,
                            "allow_sampling": True,
                            "allow_logprobs": True,
                            "allow_search_indices": False,
                            "allow_view": True,
                            "allow_fine_tuning": False,
                            "organization": "*",
                            "group": None,
                            "is_blocking": False,
                        }
                    ],
                }
            ],
        }
    )


async def reset_prefix_cache(request: web.Request) -> web.Response:
    """vLLM's ``POST /reset_prefix_cache``: 200 once the cache is empty, 400 while blocks are in use."""
    if not request.app[SIM].pool.reset():
        return json_response({"error": "prefix cache not reset: blocks are in use"}, 400)
    return web.Response(status=200)


async def _kv_events(app: web.Application) -> AsyncIterator[None]:
    """The KV-event publisher (``--kv-events-config``), open while the app runs."""
    st = app[SIM]
    config = st.settings.kv_events
    if config is None or not config.publishes:
        yield
        return
    publisher = SimKvEventPublisher(config)
    publisher.start()
    app[KV_EVENTS] = publisher
    st.pool.on_events = publisher.publish
    try:
        yield
    finally:
        st.pool.on_events = None
        await publisher.aclose()


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    """Nothing to start; at shutdown: stop lease timers and background notifications, close the
    side-channel client session."""
    yield
    st = app[SIM]
    st.leases.close()
    for task in list(st.background):
        task.cancel()
    if st.background:
        await asyncio.gather(*st.background, return_exceptions=True)
    if st.session is not None:
        await st.session.close()


def build_app(settings: SimSettings | None = None) -> web.Application:
    """The pd-sim application. Run it with ``handler_cancellation=True`` (as ``pd-sim`` and the test
    fixtures do) so that a client disconnect aborts a non-streaming request at once; without it the
    disconnect is noticed at the next token."""
    settings = settings or SimSettings()
    metrics_ = SimMetrics(settings.model_name, block_size=settings.block_size,
                          num_blocks=settings.num_kv_blocks)
    pool = KvPool(settings.num_kv_blocks, settings.block_size, metrics_.kv_usage.set)
    st = SimState(
        settings=settings,
        engine_id=settings.engine_id or str(uuid.uuid4()),
        metrics=metrics_,
        pool=pool,
        leases=LeaseTable(pool, metrics_),
        scheduler=Scheduler(settings.max_running, pool, metrics_),
        tokenizer=ByteTokenizer(settings.vocab_size) if settings.has_tokenizer else None,
    )
    st.leases.on_release = st.scheduler.wake
    app = web.Application(middlewares=[_middleware], client_max_size=64 * 1024 * 1024)
    app[SIM] = st
    app.router.add_post("/inference/v1/generate", generate)
    app.router.add_post("/inference/v1/abort_requests", abort_requests)
    if settings.tokens_only:
        app.router.add_post("/abort_requests", abort_requests)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions/render", chat_render)
    app.router.add_post("/v1/completions/render", completions_render)
    app.router.add_post("/v1/chat/completions/derender", chat_derender)
    app.router.add_post("/v1/completions/derender", completions_derender)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/sim/state", sim_state)
    app.router.add_get("/sim/faults", sim_faults)
    app.router.add_post("/sim/faults", sim_faults)
    app.router.add_post("/sim/kv/pull", kv_pull)
    app.router.add_post("/sim/kv/free", kv_free)
    app.router.add_post("/sim/kv/heartbeat", kv_heartbeat)
    app.router.add_post("/reset_prefix_cache", reset_prefix_cache)
    app.cleanup_ctx.append(_lifecycle)
    app.cleanup_ctx.append(_kv_events)
    return app
