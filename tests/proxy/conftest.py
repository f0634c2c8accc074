"""Fixtures: pd-proxy in front of pd-sim prefill/decode workers, all on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient

from proxy.config.settings import ProxySettings
from proxy.http.app import SERVING, build_app
from proxy.http.serving import Serving
from proxy.pools import PoolSettings
from tests.fixtures_sim import SimWorker
from tests.proxy.scripted import scripted_factory  # noqa: F401  (fixture)
from tests.sse import datas


@dataclass
class PD:
    client: TestClient[web.Request, web.Application]
    app: web.Application
    prefill: list[SimWorker]
    decode: list[SimWorker]

    @property
    def p(self) -> SimWorker:
        return self.prefill[0]

    @property
    def d(self) -> SimWorker:
        return self.decode[0]

    @property
    def serving(self) -> Serving:
        return self.app[SERVING]

    async def gen(self, body: dict[str, Any], **kw: Any) -> tuple[int, Any, Any]:
        r = await self.client.post("/inference/v1/generate", json=body, **kw)
        raw = await r.read()
        try:
            payload: Any = json.loads(raw)
        except ValueError:
            payload = raw
        return r.status, payload, r.headers

    async def stream(self, body: dict[str, Any], **kw: Any) -> tuple[int, list[Any], bytes]:
        """Returns status, the parsed data events ("[DONE]" kept as a string), raw bytes."""
        r = await self.client.post("/inference/v1/generate", json={**body, "stream": True}, **kw)
        raw = await r.read()
        return r.status, sse_datas(raw), raw

    async def quiet(self, limit: float = 3.0) -> None:
        """Wait until nothing is held or running anywhere (bounded), then assert it."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + limit
        while True:
            states = [await w.state() for w in (*self.prefill, *self.decode)]
            busy = any(s["kv_held"] or s["inflight"] or s["kv_blocks_used"] for s in states)
            table = len(self.serving.table) or len(self.serving.tracker)
            if not busy and not table:
                return
            if loop.time() > deadline:
                raise AssertionError(f"still busy: table={self.serving.table.all()} states={states}")
            await asyncio.sleep(0.02)


PDFactory = Callable[..., Awaitable[PD]]


@pytest.fixture
def pd_factory(sim_factory: Any, aiohttp_client: Any) -> PDFactory:
    async def make(*, prefill: dict[str, Any] | None = None, decode: dict[str, Any] | None = None,
                   n_prefill: int = 1, n_decode: int = 1, server_kwargs: dict[str, Any] | None = None,
                   **settings: Any) -> PD:
        pkw = {"zero_latency": True, **(prefill or {})}
        dkw = {"zero_latency": True, **(decode or {})}
        ps = [await sim_factory(role="prefill", **pkw) for _ in range(n_prefill)]
        ds = [await sim_factory(role="decode", **dkw) for _ in range(n_decode)]
        settings.setdefault("pools", PoolSettings.plain())  # the bare walk (pools: tests/proxy/pools)
        s = ProxySettings(prefill_urls=tuple(w.url for w in ps), decode_urls=tuple(w.url for w in ds),
                          **settings)
        app = build_app(s)
        client = await aiohttp_client(app, server_kwargs={"handler_cancellation": True,
                                                          **(server_kwargs or {})})
        return PD(client, app, ps, ds)

    return make


PROMPT = [260, 262, 264, 265, 267, 300, 301, 302, 303]


def req(**kw: Any) -> dict[str, Any]:
    sp = {"temperature": 0, "max_tokens": 8}
    sp.update(kw.pop("sp", {}))
    return {"token_ids": kw.pop("token_ids", PROMPT), "sampling_params": sp, **kw}


ProxyFactory = Callable[..., Awaitable[tuple[TestClient[web.Request, web.Application], web.Application]]]


@pytest.fixture
def proxy_factory(aiohttp_client: Any) -> ProxyFactory:
    async def make(prefill: list[str], decode: list[str], **settings: Any) -> Any:
        settings.setdefault("pools", PoolSettings.plain())
        app = build_app(ProxySettings(prefill_urls=tuple(prefill), decode_urls=tuple(decode), **settings))
        client = await aiohttp_client(app, server_kwargs={"handler_cancellation": True})
        return client, app

    return make


def sse_datas(raw: bytes) -> list[Any]:
    """The data events of a proxy stream ("[DONE]" kept as a string); keep-alive comments dropped."""
    return datas(raw, comments=True)
