"""pd-proxy's per-request work without its shells: a yardstick for issue 20, not a product.

    python benchmarks/internals/flat_proxy.py --port P --prefill URL --decode URL [--hop-client bare|pd-proxy]

``bare_proxy``'s shells (a bare ``asyncio.Protocol`` server, no aiohttp on the client's side, one
task per request) around the components pd-proxy calls for one non-stream generate request, in
the walk's order and called the way its parts call them: the body parsed and checked
(``Validation.validate``), the request id, the admission gate, the request's record and ``Flight``
in the request table, the pools' pick context and bypass check, the prefill pick and release
(``Pool.acquire``, its breaker and in-flight count), the prefill body
(``kv_transfer.handoff.prefill_body``), the hop's abort timer, P's reply parsed and checked, the KV
lease held (``Prefill.accept_reply``), the decode pick and release, the decode body with P's
params, D's reply parsed, the lease closed as pulled, the usage noted, P's cached tokens spliced
into D's bytes (``FullDecode.merge_prefill_info``), the per-request metrics (stage histograms,
in-flight gauges, upstream and request counters, TTFT, TPOT, end-to-end), ``Server-Timing`` and
``X-Request-Id`` on the reply. Left out: aiohttp's server, ``web.Request`` and ``web.Response``,
the middleware's checks (auth, limits, error answers), the hops' own tasks (``state.outlive``,
``asyncio.shield``), tracing's no-op spans, and error handling: a failure leaves the request
unanswered. With ``--hop-client bare`` (the default) the hops go through ``bare_proxy``'s
kept-alive connections; with ``--hop-client pd-proxy``, through pd-proxy's own client
(``proxy.upstream.client.Upstream``: ``HopClient``, its stale check, deadlines and parsing).

A stream request is relayed as ``bare_proxy`` relays it (the pick, the bodies and the lease as
above, D's bytes as they come; no first token from P): enough for ``compare_routers``' readiness
check, not a stream's costs.

``aiohttp_app`` puts the same walk behind aiohttp's server (a ``web.Application`` with the generate
route alone, non-stream only). ``benchmarks/internals/shells.py`` serves it beside pd-proxy and
``bare_proxy`` in one process and alternates them; ``compare_routers --pd-proxy-cmd`` runs it in
pd-proxy's slot (benchmarks/README.md gives the commands and the numbers).
"""

from __future__ import annotations

import argparse
import asyncio
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
from aiohttp import web

from benchmarks.internals.bare_proxy import _Client, _Pool, _post
from kv_transfer.handoff import check_prefill_params, decode_body, prefill_body
from proxy.cli import parse_args
from proxy.config.tenants import OPEN
from proxy.http.serving import Serving
from proxy.observe.metrics import ProxyMetrics
from proxy.observe.state import RequestRecord
from proxy.pools import Outcome
from proxy.upstream.client import Upstream, encode_body
from proxy.walk.flight import Flight, Timing
from proxy.wire.ids import Rewrite, client_request_id, upstream_id
from proxy.wire.protocol import engine_request_id, parse_worker_json

HOP_CLIENTS = ("bare", "pd-proxy")
Hop = Callable[[str, str, dict[str, Any], str], Awaitable[tuple[dict[str, Any], bytes]]]
"""``(role, worker URL, body, request id) -> (reply, its bytes)``."""
Relay = Callable[[str, dict[str, Any]], Awaitable[None]]
"""``(decode worker URL, decode body)``: a stream's bytes relayed to the client."""

_HOP_LIMIT = 30.0
_PICK_LIMIT = 1.0


class FlatProxy:
    """The components of one pd-proxy (``Serving``, its pools, leases and metrics) and the hop
    client the requests use."""

    def __init__(self, serving: Serving, hop: Hop, prefill: _Pool, decode: _Pool) -> None:
        self.serving = serving
        self.hop = hop
        self.prefill = prefill
        self.decode = decode

    def protocol(self) -> _Client:
        return _FlatClient(self)

    async def serve(self, client: _FlatClient, raw: bytes) -> None:
        """One request on the bare server: the walk, then the answer written in one go."""
        answer = await self.walk(raw, lambda url, body: self._relay(client, url, body))
        if answer is not None:
            out, client_id, timing = answer
            client.answer(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nX-Request-Id: "
                          + client_id.encode() + b"\r\nServer-Timing: " + timing.encode()
                          + b"\r\nContent-Length: " + str(len(out)).encode() + b"\r\n\r\n" + out)

    async def handle(self, request: web.BaseRequest) -> web.Response:
        """One request on aiohttp's server (``aiohttp_app``); non-stream only."""
        answer = await self.walk(await request.read(), None)
        if answer is None:
            raise web.HTTPBadRequest(text="the aiohttp shell serves non-stream requests only")
        out, client_id, timing = answer
        return web.Response(body=out, content_type="application/json",
                            headers={"X-Request-Id": client_id, "Server-Timing": timing})

    async def walk(self, raw: bytes, relay: Relay | None) -> tuple[bytes, str, str] | None:
        """The components of one request: D's answer with P's cached tokens spliced in, the
        client's id and ``Server-Timing``; None for a stream (relayed by ``relay``, or refused
        before any pick without one)."""
        s = self.serving
        core, m, clock, pools = s.core, s.metrics, s.clock, s.pools
        t0 = clock()
        req, data = s.validation.validate(raw, "application/json")
        if req.is_stream and relay is None:
            return None
        client_id = client_request_id(None, req.request_id) or uuid.uuid4().hex
        await pools.admission.acquire(None)
        try:
            base_id = upstream_id(OPEN.tag, client_id)
            record = RequestRecord(base_id, engine_request_id(base_id), stream=req.is_stream)
            f = Flight(record, req, data, Timing(t0), client_id=client_id,
                       rewrite=Rewrite.for_ids(base_id, client_id), tenant=OPEN)
            f.headers["X-Request-Id"] = client_id
            s.table.add(f)
            max_tokens = req.sampling_params.get("max_tokens")
            f.ctx = pools.pick_context(req.token_ids, {},
                                       tokens=max_tokens if isinstance(max_tokens, int) else 0)
            loop = asyncio.get_running_loop()
            f.timing.prefill_start = prefill_start = clock()
            pools.bypass_reason(len(req.token_ids))
            p = await s.prefill_pool.acquire(f.ctx, exclude=pools.prefill_too_short(len(req.token_ids)),
                                             limit=_PICK_LIMIT)
            record.prefill_worker = p
            body = prefill_body(f.data, base_id, stream=req.is_stream, keep_stop=True, first_token=False)
            m.child(m.inflight, p.pool).inc()
            m.child(m.upstream_requests, p.pool, p.url).inc()
            late = loop.call_later(_HOP_LIMIT, lambda: None)  # the prefill hop's abort timer
            reply, _ = await self.hop("prefill", p.url, body, base_id)
            late.cancel()
            m.child(m.inflight, p.pool).dec()
            check_prefill_params(reply.get("kv_transfer_params"))
            s.prefill_pool.release(p, Outcome.NEUTRAL)
            f.timing.prefill_end = prefill_end = clock()
            m.child(m.stage, "queue").observe(prefill_start - t0)
            m.child(m.stage, "prefill").observe(prefill_end - prefill_start)
            kv_params, _ = s.prefill.accept_reply(f, p, reply)
            d = await s.decode_pool.acquire(f.ctx, exclude=[], limit=_PICK_LIMIT)
            f.to_decoding(d)
            f.timing.decode_start = decode_start = clock()
            m.child(m.stage, "handoff").observe(decode_start - prefill_end)
            dbody = decode_body(f.data, base_id, kv_params)
            if relay is not None and req.is_stream:
                await relay(d.url, dbody)
                s.decode_pool.release(d, Outcome.SUCCESS, f.ctx.tokens)
                core.close_lease(f, "pulled")
                core.set_done(f)
                s.cleanup.forget(f)
                return None
            m.child(m.inflight, d.pool).inc()
            m.child(m.upstream_requests, d.pool, d.url).inc()
            late = loop.call_later(_HOP_LIMIT, lambda: None)
            answer, raw_answer = await self.hop("decode", d.url, dbody, base_id)
            late.cancel()
            m.child(m.inflight, d.pool).dec()
            s.decode_pool.release(d, Outcome.SUCCESS, f.ctx.tokens)
            f.timing.first_token = first = clock()
            core.close_lease(f, "pulled")
            core.set_done(f)
            m.child(m.stage, "decode_first_token").observe(first - decode_start)
            core.note_usage(f, answer.get("usage"))
            if f.completion_tokens:
                m.tpot.observe((first - decode_start) / f.completion_tokens)
            done: asyncio.Future[dict[str, Any]] = loop.create_future()
            done.set_result(reply)
            f.prefill_task = done  # a finished hop, as merge_prefill_info reads it
            out = s.full.merge_prefill_info(f, answer, raw_answer)
            if f.rewrite is not None:
                out = f.rewrite.apply(out)
            now = clock()
            m.ttft.observe(now - t0)
            timing = f.timing.header(now)
            m.e2e.observe(clock() - t0)
            m.child(m.requests, "ok").inc()
            s.cleanup.forget(f)
        finally:
            pools.admission.release()
        return out, client_id, timing

    async def _relay(self, client: _FlatClient, url: str, body: dict[str, Any]) -> None:
        client.answer(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                      b"Transfer-Encoding: chunked\r\n\r\n")
        conn = await self.decode.get()
        await conn.begin(_post(self.decode.host, encode_body(body)), client.answer)
        self.decode.put(conn)


class _FlatClient(_Client):
    def __init__(self, proxy: FlatProxy) -> None:
        super().__init__(proxy.prefill, proxy.decode)
        self.proxy = proxy

    async def serve(self, raw: bytes) -> None:
        await self.proxy.serve(self, raw)

    def answer(self, data: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)


def bare_hops(prefill: _Pool, decode: _Pool) -> Hop:
    """Hops over ``bare_proxy``'s kept-alive connections (one worker of each role)."""

    async def hop(role: str, url: str, body: dict[str, Any], request_id: str) -> tuple[dict[str, Any], bytes]:
        pool = prefill if role == "prefill" else decode
        conn = await pool.get()
        raw = await conn.begin(_post(pool.host, encode_body(body)))
        pool.put(conn)
        return parse_worker_json(raw), raw

    return hop


def pd_proxy_hops(upstream: Upstream) -> Hop:
    """Hops through pd-proxy's own client, as its walk sends them (``post_generate[_raw]``)."""

    async def hop(role: str, url: str, body: dict[str, Any], request_id: str) -> tuple[dict[str, Any], bytes]:
        if role == "prefill":
            return await upstream.post_generate(role, url, body, request_id=request_id, total=_HOP_LIMIT), b""
        return await upstream.post_generate_raw(role, url, body, request_id=request_id, total=_HOP_LIMIT)

    return hop


def build(prefill: str, decode: str, hop_client: str = "bare") -> tuple[FlatProxy, aiohttp.ClientSession]:
    """A flat proxy in front of one prefill and one decode worker, pd-proxy's default settings;
    the session (for pd-proxy's hop client) is the caller's to close."""
    settings = parse_args(["--prefill", prefill, "--decode", decode, "--log-level", "warning"])
    serving = Serving(settings, ProxyMetrics(longest=settings.longest_request(),
                                             lease_duration=settings.lease_duration))
    session = aiohttp.ClientSession()
    upstream = Upstream(session, api_key=None, connect_timeout=settings.connect_timeout)
    serving.attach(upstream)
    p, d = _Pool(prefill), _Pool(decode)
    hop = pd_proxy_hops(upstream) if hop_client == "pd-proxy" else bare_hops(p, d)
    return FlatProxy(serving, hop, p, d), session


def aiohttp_app(proxy: FlatProxy) -> web.Application:
    """The flat walk behind aiohttp's server: a ``web.Application`` with the generate route alone
    (no middleware), the shell pd-proxy's own server is built on."""
    app = web.Application()
    app.router.add_post("/inference/v1/generate", proxy.handle)
    return app


async def start(port: int, prefill: str, decode: str,
                hop_client: str = "bare") -> tuple[asyncio.Server, FlatProxy, aiohttp.ClientSession]:
    """Serve on 127.0.0.1:``port`` (0: any free port)."""
    proxy, session = build(prefill, decode, hop_client)
    server = await asyncio.get_running_loop().create_server(proxy.protocol, "127.0.0.1", port)
    return server, proxy, session


async def _main(port: int, prefill: str, decode: str, hop_client: str) -> None:
    server, _, session = await start(port, prefill, decode, hop_client)
    print(f"flat proxy on http://127.0.0.1:{port} (hop client: {hop_client})", flush=True)
    try:
        async with server:
            await server.serve_forever()
    finally:
        await session.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--prefill", required=True)
    ap.add_argument("--decode", required=True)
    ap.add_argument("--hop-client", choices=HOP_CLIENTS, default="bare")
    a, _ = ap.parse_known_args()
    try:
        import uvloop  # noqa: PLC0415
        uvloop.run(_main(a.port, a.prefill, a.decode, a.hop_client))
    except ImportError:
        asyncio.run(_main(a.port, a.prefill, a.decode, a.hop_client))


if __name__ == "__main__":
    main()
