"""The render pool's workers (render, derender, ``/v1/models``, pass-through), taken in turn; an
unreachable one is skipped (each tried once per call), and every call is bounded."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import aiohttp

from proxy.pools import Worker
from proxy.walk.core import Core
from proxy.wire.errors import UpstreamProtocolError, UpstreamTimeout, UpstreamUnavailable
from proxy.wire.protocol import compact_json


@dataclass(frozen=True, slots=True)
class Reply:
    status: int
    body: bytes
    content_type: str
    worker: str

    def json(self) -> Any:
        try:
            return json.loads(self.body)
        except ValueError:
            raise UpstreamProtocolError("render", self.worker, "answered a body that is not JSON") from None


class TokenizerWorkers:
    """Calls to the render pool's workers."""

    def __init__(self, core: Core) -> None:
        self.core = core
        s = core.settings
        self.pool = core.prefill_pool if s.render_pool == "prefill" else core.decode_pool
        self._turn = 0
        self._models: dict[str, str] = {}
        """A worker's served model name (its ``/v1/models``), for answers to requests without one."""

    def order(self) -> list[Worker]:
        """The pool's available workers (all when none is), starting at the next in turn."""
        workers = [w for w in self.pool if w.available] or list(self.pool)
        if not workers:
            return []
        self._turn = (self._turn + 1) % len(workers)
        return workers[self._turn:] + workers[:self._turn]

    def _headers(self, content_type: str | None, extra: Iterable[tuple[str, str]] = ()) -> dict[str, str]:
        headers = dict(extra)
        if content_type is not None:
            headers["Content-Type"] = content_type
        key = self.core.settings.upstream_api_key
        if key:
            headers["Authorization"] = f"Bearer {key}"
        return headers

    async def call(self, method: str, path: str, body: bytes | None = None, *,
                   content_type: str | None = None, headers: Iterable[tuple[str, str]] = (),
                   worker: str | None = None) -> Reply:
        """``method path`` on ``worker``, else on the pool's workers in turn until one answers; 502 when
        none does, 504 on timeout."""
        urls = [worker] if worker is not None else [w.url for w in self.order()]
        if not urls:
            raise UpstreamUnavailable("render", self.pool.name, "no worker in the pool")
        session = self.core.upstream.session
        timeout = aiohttp.ClientTimeout(total=self.core.settings.prefill_timeout,
                                        connect=self.core.settings.connect_timeout)
        last = "no worker answered"
        for url in urls:
            try:
                async with session.request(method, url + path, data=body, timeout=timeout,
                                           headers=self._headers(content_type, headers)) as r:
                    raw = await r.read()
                    return Reply(r.status, raw, r.headers.get("Content-Type", "application/json"), url)
            except TimeoutError:
                raise UpstreamTimeout("render", url, f"{path} timed out") from None
            except (aiohttp.ClientError, OSError) as e:
                last = f"{path}: {type(e).__name__}"
                if worker is not None:
                    break
        raise UpstreamUnavailable("render", urls[-1], last)

    async def post_json(self, worker: str, path: str, body: dict[str, Any]) -> Reply:
        return await self.call("POST", path, compact_json(body), content_type="application/json",
                               worker=worker)

    async def served_model(self, worker: str) -> str | None:
        """``worker``'s first served model name (``GET /v1/models``), remembered."""
        name = self._models.get(worker)
        if name is None:
            reply = await self.call("GET", "/v1/models", worker=worker)
            answer = reply.json() if reply.status == 200 else None
            data = answer.get("data") if isinstance(answer, dict) else None
            entry = data[0] if isinstance(data, list) and data else None
            first = entry.get("id") if isinstance(entry, dict) else None
            if isinstance(first, str):
                if len(self._models) >= 256:  # workers come and go: bounded
                    self._models.clear()
                self._models[worker] = name = first
        return name


__all__ = ["Reply", "TokenizerWorkers"]
