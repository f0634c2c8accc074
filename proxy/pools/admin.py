"""The admin API: membership and draining of workers, behind its own key.

Mounted by the app as a sub-application (``app.add_subapp("/admin", admin_app(pools, key))``):

==========================  ==================================================================
``GET /admin/workers``      every pool's workers with load, health, circuit, sources
``POST /admin/workers``     ``{"pool", "url"}``: add (201; 200 if already a member)
``DELETE /admin/workers``   ``{"pool", "url"}`` (body or query): remove, whatever declared it
``POST /admin/workers/drain`` ``{"pool", "url", "drain": true|false}``: stop/resume new traffic
==========================  ==================================================================

``Authorization: Bearer <admin key>``, compared in constant time (``hmac.compare_digest``).
The admin key is separate from the client API key; with no admin key the API is not mounted.
Errors use vLLM's error JSON.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from proxy.errors import ClientError, ProxyError, Unauthorized
from proxy.pools.membership import ADMIN_SOURCE, Pools
from proxy.pools.pool import Pool, normalize_url

POOLS_KEY = web.AppKey("pools", Pools)
ADMIN_KEY = web.AppKey("admin_key", bytes)


class AdminBadRequest(ClientError):
    err_type = "BadRequestError"


class AdminNotFound(ProxyError):
    status = 404
    err_type = "NotFoundError"


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def _auth_and_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    given = token.strip().encode() if scheme.lower() == "bearer" else b""
    # compare_digest always runs (no early return on a missing header)
    if not hmac.compare_digest(given, request.app[ADMIN_KEY]) or not given:
        return Unauthorized("admin key required").to_response()
    try:
        return await handler(request)
    except ProxyError as e:
        return e.to_response()


async def _target(request: web.Request) -> tuple[Pool, str, dict[str, Any]]:
    data: dict[str, Any] = dict(request.query)
    if request.can_read_body:
        try:
            body = json.loads(await request.read())
        except ValueError:
            raise AdminBadRequest("the body is not valid JSON") from None
        if not isinstance(body, dict):
            raise AdminBadRequest("the body must be a JSON object")
        data.update(body)
    pools = request.app[POOLS_KEY]
    name, url = data.get("pool"), data.get("url")
    if not isinstance(name, str) or name not in pools:
        raise AdminBadRequest(f"'pool' must be one of: {', '.join(pools.names)}", param="pool")
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise AdminBadRequest("'url' must be an http:// or https:// URL", param="url")
    try:
        url = normalize_url(url)
    except ValueError as e:
        raise AdminBadRequest(f"'url': {e}", param="url") from None
    return pools[name], url, data


async def list_workers(request: web.Request) -> web.Response:
    return web.json_response({"pools": request.app[POOLS_KEY].snapshot()})


async def add_worker(request: web.Request) -> web.Response:
    pool, url, _ = await _target(request)
    existed = pool.get(url) is not None
    worker = pool.add(url, ADMIN_SOURCE)
    return web.json_response({"worker": worker.as_dict()}, status=200 if existed else 201)


async def delete_worker(request: web.Request) -> web.Response:
    pool, url, _ = await _target(request)
    if not pool.remove(url):
        raise AdminNotFound(f"no worker {url} in pool {pool.name}")
    return web.json_response({"removed": {"pool": pool.name, "url": url.rstrip("/")}})


async def drain_worker(request: web.Request) -> web.Response:
    pool, url, data = await _target(request)
    drain = data.get("drain", True)
    if isinstance(drain, str):
        drain = drain.lower() in ("1", "true", "yes")
    if not isinstance(drain, bool):
        raise AdminBadRequest("'drain' must be a boolean", param="drain")
    worker = pool.get(url)
    if worker is None:
        raise AdminNotFound(f"no worker {url} in pool {pool.name}")
    worker.draining = drain
    if not drain:
        pool.queue.wake()
    return web.json_response({"worker": worker.as_dict()})


def admin_app(pools: Pools, admin_key: str) -> web.Application:
    if not admin_key:
        raise ValueError("the admin API needs a non-empty admin key")
    app = web.Application(middlewares=[_auth_and_errors])
    app[POOLS_KEY] = pools
    app[ADMIN_KEY] = admin_key.encode()
    app.router.add_get("/workers", list_workers)
    app.router.add_post("/workers", add_worker)
    app.router.add_delete("/workers", delete_worker)
    app.router.add_post("/workers/drain", drain_worker)
    return app
