"""The admin API (``GET/POST/DELETE /admin/workers``, ``POST /admin/workers/drain``): membership
and draining of workers, behind its own key, of which the app keeps only the SHA-256 digest. Worker
URLs with user info, a query or a fragment are a 400 that shows the URL redacted. With
``--workers N`` every change goes through the run's journal and reaches every process."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from proxy.fleet.journal import Journal, change
from proxy.fleet.membership import Pools
from proxy.pools.pool import Pool, normalize_url
from proxy.wire.errors import ClientError, ProxyError, Unauthorized

POOLS_KEY = web.AppKey("pools", Pools)
ADMIN_KEY_DIGEST = web.AppKey("admin_key_digest", bytes)
JOURNAL_KEY = web.AppKey("journal", Journal)


def key_digest(key: str) -> bytes:
    """A header's bytes that are not UTF-8 (lone surrogates from aiohttp) hash as those bytes."""
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()


def key_matches(authorization: str | None, digest: bytes) -> bool:
    """The bearer key's SHA-256 is ``digest``: one constant-time compare of two 32-byte digests,
    whatever the header holds, so the time tells nothing of the key."""
    scheme, _, token = (authorization or "").partition(" ")
    given = token.strip() if scheme.lower() == "bearer" else ""
    return hmac.compare_digest(key_digest(given), digest) and bool(given)


class AdminBadRequest(ClientError):
    err_type = "BadRequestError"


class AdminNotFound(ProxyError):
    status = 404
    err_type = "NotFoundError"


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def _auth_and_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    if not key_matches(request.headers.get("Authorization"), request.app[ADMIN_KEY_DIGEST]):
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
    """``process``: the pid that answered (its view of the pools)."""
    return web.json_response({"pools": request.app[POOLS_KEY].snapshot(), "process": os.getpid()})


async def add_worker(request: web.Request) -> web.Response:
    pool, url, _ = await _target(request)
    with request.app[JOURNAL_KEY].changing() as record:
        existed = pool.get(url) is not None
        record(change("add", pool.name, url))
        worker = pool.get(url)
    assert worker is not None
    return web.json_response({"worker": worker.as_dict()}, status=200 if existed else 201)


async def delete_worker(request: web.Request) -> web.Response:
    pool, url, _ = await _target(request)
    with request.app[JOURNAL_KEY].changing() as record:
        if pool.get(url) is None:
            raise AdminNotFound(f"no worker {url} in pool {pool.name}")
        record(change("remove", pool.name, url))
    return web.json_response({"removed": {"pool": pool.name, "url": url}})


async def drain_worker(request: web.Request) -> web.Response:
    pool, url, data = await _target(request)
    drain = data.get("drain", True)
    if isinstance(drain, str):
        drain = drain.lower() in ("1", "true", "yes")
    if not isinstance(drain, bool):
        raise AdminBadRequest("'drain' must be a boolean", param="drain")
    with request.app[JOURNAL_KEY].changing() as record:
        worker = pool.get(url)
        if worker is None:
            raise AdminNotFound(f"no worker {url} in pool {pool.name}")
        record(change("drain", pool.name, url, drain))
    return web.json_response({"worker": worker.as_dict()})


def admin_app(pools: Pools, admin_key: str, journal: Journal | None = None) -> web.Application:
    """The admin API; ``journal``: where changes go (default: this process only)."""
    if not admin_key:
        raise ValueError("the admin API needs a non-empty admin key")
    app = web.Application(middlewares=[_auth_and_errors])
    app[POOLS_KEY] = pools
    app[ADMIN_KEY_DIGEST] = key_digest(admin_key)
    app[JOURNAL_KEY] = journal if journal is not None else Journal(pools)
    app.router.add_get("/workers", list_workers)
    app.router.add_post("/workers", add_worker)
    app.router.add_delete("/workers", delete_worker)
    app.router.add_post("/workers/drain", drain_worker)
    return app
