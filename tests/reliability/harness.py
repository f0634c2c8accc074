"""A whole P/D world on loopback for the reliability suite: pd-sim workers and pd-proxy, each
served by its own ``AppRunner`` (``handler_cancellation=True``, as in production), a client
session, and the invariants every test checks once the dust settles.

Invariants (``World.assert_clean``):

* no KV held, nothing in flight, no hung request and no KV block used on any pd-sim worker;
* the proxy's request table, background tasks, KV-lease ledger and per-worker in-flight counts
  are empty;
* the proxy's upstream connector has no connection checked out (only idle keep-alive ones);
* no asyncio task is pending beyond those running once the world was up (the proxy's sweeper
  and health probes), except the handler tasks of idle keep-alive server connections (none of
  them mid-request);
* after ``close()``: no task at all is left beyond the baseline.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from proxy.config.settings import ProxySettings
from proxy.http.app import SERVING, build_app
from proxy.http.serving import Serving
from tests.sse import datas
from workers.sim import Faults, SimSettings
from workers.sim import build_app as build_sim_app

GENERATE = "/inference/v1/generate"
ABORT = "/inference/v1/abort_requests"


def _port(runner: web.AppRunner) -> int:
    return next(int(a[1]) for a in runner.addresses if isinstance(a, tuple))


async def serve(app: web.Application, **kwargs: Any) -> tuple[web.AppRunner, str]:
    """Serve ``app`` on 127.0.0.1 with an OS-chosen port (or on ``sock=``, a bound socket);
    other keyword arguments go to the ``AppRunner`` (e.g. ``keepalive_timeout``)."""
    site_kwargs = {k: kwargs.pop(k) for k in ("ssl_context",) if k in kwargs}
    sock: socket.socket | None = kwargs.pop("sock", None)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                           shutdown_timeout=kwargs.pop("shutdown_timeout", 1.0), **kwargs)
    await runner.setup()
    site: web.BaseSite = web.SockSite(runner, sock, **site_kwargs) if sock is not None else \
        web.TCPSite(runner, "127.0.0.1", 0, **site_kwargs)
    await site.start()
    scheme = "https" if site_kwargs.get("ssl_context") is not None else "http"
    return runner, f"{scheme}://127.0.0.1:{_port(runner)}"


@dataclass
class Sim:
    url: str
    runner: web.AppRunner
    settings: SimSettings
    session: aiohttp.ClientSession

    async def state(self) -> dict[str, Any]:
        async with self.session.get(self.url + "/sim/state") as r:
            data: dict[str, Any] = await r.json()
            return data

    async def set_faults(self, **faults: Any) -> None:
        async with self.session.post(self.url + "/sim/faults", json=faults) as r:
            assert r.status == 200, await r.text()

    async def close(self) -> None:
        await self.runner.cleanup()


async def start_sim(session: aiohttp.ClientSession, **kwargs: Any) -> Sim:
    faults = kwargs.pop("faults", None)
    if isinstance(faults, dict):
        faults = Faults(**faults)
    settings = SimSettings(**kwargs) if faults is None else SimSettings(faults=faults, **kwargs)
    # A short shutdown: the proxy's idle keep-alive connections would hold it for the whole timeout.
    runner, url = await serve(build_sim_app(settings), shutdown_timeout=0.2)
    return Sim(url, runner, settings, session)


def connection_tasks(runners: Sequence[web.AppRunner]) -> tuple[set[asyncio.Task[Any]], list[str]]:
    """The handler tasks of the servers' open connections, and those that are mid-request."""
    tasks: set[asyncio.Task[Any]] = set()
    busy: list[str] = []
    for runner in runners:
        server = runner.server
        if server is None:
            continue
        for handler in server.connections:
            task = handler._task_handler
            if task is not None:
                tasks.add(task)
            if handler._current_request is not None:
                busy.append(f"{handler._current_request.method} {handler._current_request.path}")
    return tasks, busy


def describe(tasks: set[asyncio.Task[Any]]) -> list[str]:
    return sorted(f"{t.get_name()}:{t.get_coro()!r}" for t in tasks)


@dataclass
class World:
    prefill: list[Sim]
    decode: list[Sim]
    app: web.Application
    runner: web.AppRunner
    url: str
    session: aiohttp.ClientSession
    baseline: set[asyncio.Task[Any]]
    """Tasks pending before the world started (nothing may be left beyond them after close)."""
    steady: set[asyncio.Task[Any]] = field(default_factory=set)
    """Tasks pending once the world is up (the proxy's sweeper and health probes)."""
    extra_runners: list[web.AppRunner] = field(default_factory=list)
    closed: bool = False

    @property
    def serving(self) -> Serving:
        return self.app[SERVING]

    @property
    def p(self) -> Sim:
        return self.prefill[0]

    @property
    def d(self) -> Sim:
        return self.decode[0]

    @property
    def sims(self) -> list[Sim]:
        return [*self.prefill, *self.decode]

    async def post(self, body: dict[str, Any] | bytes, *, path: str = GENERATE,
                   headers: dict[str, str] | None = None) -> tuple[int, bytes]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        hdrs = {"Content-Type": "application/json", **(headers or {})}
        async with self.session.post(self.url + path, data=data, headers=hdrs) as r:
            return r.status, await r.read()

    async def abort(self, *ids: str) -> int:
        async with self.session.post(self.url + ABORT, json={"request_ids": list(ids)}) as r:
            await r.read()
            return r.status

    # ------------------------------------------------------------------ invariants

    async def proxy_state(self) -> dict[str, Any]:
        s = self.serving
        s.expire_leases()
        connector = s.upstream.session.connector
        acquired = len(connector._acquired) if connector is not None else 0
        acquired += s.upstream.hops.counts()["in_use"]
        return {
            "table": [r.as_dict() for r in s.table.all()],
            "tracker": len(s.tracker),
            "leases_open": s.leases.open_count,
            "inflight": {w.url: w.inflight for w in (*s.prefill_pool, *s.decode_pool) if w.inflight},
            "acquired": acquired,
        }

    async def sim_states(self) -> list[dict[str, Any]]:
        return [await sim.state() for sim in self.sims]

    @staticmethod
    def _sim_busy(st: dict[str, Any]) -> bool:
        return bool(st["kv_held"] or st["inflight"] or st["kv_blocks_used"] or st["hung_before_headers"])

    def _stray_tasks(self) -> tuple[set[asyncio.Task[Any]], list[str]]:
        idle, busy = connection_tasks([self.runner, *(s.runner for s in self.sims), *self.extra_runners])
        current = asyncio.current_task()
        stray = {t for t in asyncio.all_tasks() if not t.done()} - self.steady - idle - {current}
        return stray, busy

    async def wait_clean(self, limit: float = 5.0) -> None:
        """Wait (bounded) until every invariant holds, then return; else fail naming what is left."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + limit
        while True:
            started = loop.time()  # a stalled loop must not fail a check that began in time
            ps = await self.proxy_state()
            ss = await self.sim_states()
            stray, busy = self._stray_tasks()
            proxy_busy = bool(ps["table"] or ps["tracker"] or ps["leases_open"] or ps["inflight"]
                              or ps["acquired"])
            if not proxy_busy and not any(self._sim_busy(s) for s in ss) and not stray and not busy:
                return
            if started > deadline:
                keys = ("role", "kv_held", "inflight", "kv_blocks_used", "hung_before_headers")
                sims = [{k: s[k] for k in keys} for s in ss]
                raise AssertionError(f"not clean after {limit} s: proxy={ps} sims={sims} "
                                     f"busy_handlers={busy} stray_tasks={describe(stray)}")
            await asyncio.sleep(0.02)

    async def releases(self) -> dict[str, int]:
        """KV releases on the prefill workers, summed by reason (pulled / aborted / expired)."""
        out: dict[str, int] = {}
        for sim in self.prefill:
            for reason, n in (await sim.state())["releases"].items():
                out[reason] = out.get(reason, 0) + int(n)
        return out

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        await self.runner.cleanup()
        for runner in self.extra_runners:
            await runner.cleanup()
        for sim in self.sims:
            await sim.close()
        await self.session.close()

    async def assert_no_tasks_after_close(self) -> None:
        """After ``close()``: nothing of this world may still be pending (bounded settle)."""
        assert self.closed
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 2.0
        current = asyncio.current_task()
        while True:
            stray = {t for t in asyncio.all_tasks() if not t.done()} - self.baseline - {current}
            if not stray:
                return
            if loop.time() > deadline:
                raise AssertionError(f"tasks left after shutdown: {describe(stray)}")
            await asyncio.sleep(0.02)


FAST_TIMEOUTS: dict[str, Any] = {
    # Generous hop timeouts (a loaded machine must not time out a healthy hop); tests of hangs
    # shorten the one they exercise.
    "prefill_timeout": 5.0, "decode_timeout": 10.0, "stream_idle_timeout": 5.0,
    "control_timeout": 1.0, "abort_grace": 0.2, "connect_timeout": 1.0, "drain_timeout": 1.0,
    "kv_block_size": 16,  # pd-sim's block
}


async def start_world(*, prefill: Sequence[dict[str, Any]] = ({},), decode: Sequence[dict[str, Any]] = ({},),
                      server_kwargs: dict[str, Any] | None = None, extra_decode_urls: Sequence[str] = (),
                      **settings: Any) -> World:
    """Start sims (``zero_latency`` unless a dict says otherwise) and the proxy in front
    (``extra_decode_urls``: decode workers run elsewhere, e.g. pd-sim processes)."""
    baseline = {t for t in asyncio.all_tasks() if not t.done()}
    session = aiohttp.ClientSession()
    ps = [await start_sim(session, role="prefill", **{"zero_latency": True, **kw}) for kw in prefill]
    ds = [await start_sim(session, role="decode", **{"zero_latency": True, **kw}) for kw in decode]
    lease = min((s.settings.lease_seconds for s in ps), default=30.0)
    s = ProxySettings(prefill_urls=tuple(p.url for p in ps),
                      decode_urls=(*(d.url for d in ds), *extra_decode_urls),
                      **{"lease_duration": lease, **FAST_TIMEOUTS, **settings})
    app = build_app(s)
    runner, url = await serve(app, **(server_kwargs or {}))
    w = World(ps, ds, app, runner, url, session, baseline)
    await asyncio.sleep(0)
    w.steady = {t for t in asyncio.all_tasks() if not t.done()}
    return w


@contextlib.asynccontextmanager
async def world(**kwargs: Any) -> Any:
    w = await start_world(**kwargs)
    try:
        yield w
    finally:
        await w.close()


def sse_events(raw: bytes) -> list[Any]:
    """The data events of an SSE body ("[DONE]" kept as a string); comments dropped."""
    return datas(raw, comments=True)
