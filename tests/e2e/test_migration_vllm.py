"""Real vLLM on CPU: a decode stream cut mid-way continues on another decode worker with no seam.

The session cluster has one decode worker, so the second "decode worker" is a fault-injecting relay
in front of it: the relay forwards everything, but cuts every stream it carries after ``k`` token
events (the connection is aborted, as when a worker dies; the real worker sees the disconnect and
drops the request). The proxy's decode pool is [relay, real decode worker], so a stream the relay
cuts is continued on the real worker as a continuation (prompt + tokens already sent; long ones
prefilled through the prefill worker, with a NIXL transfer). The client's greedy token ids (and
text) must equal the aggregated worker's, with no error event."""

from __future__ import annotations

import json
import random
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from proxy.config.settings import ProxySettings
from proxy.http.app import SERVING, build_app
from proxy.pools import PoolSettings
from tests import sse
from tests.e2e.proxy_stack import E2E_CONNECT_TIMEOUT
from tests.fixtures_vllm import vllm_connector
from workers.launcher import Cluster

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]

SEED = 977
N_PROMPTS = 6
MAX_TOKENS = 16
GENERATE = "/inference/v1/generate"


def prompts() -> list[list[int]]:
    rng = random.Random(SEED)
    # 128..380 tokens: continuations below and above the 256-token migrate-prefill threshold
    return [[rng.randrange(3, 515) for _ in range(rng.randint(128, 380))] for _ in range(N_PROMPTS)]


class CuttingRelay:
    """HTTP relay to ``target`` that aborts every stream once ``cut_after[request_id]`` tokens passed."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.cut_after: dict[str, int] = {}
        self.cuts: list[str] = []
        """Streams cut before their last token (each must migrate)."""
        self.cuts_after_finish: list[str] = []
        self.session: aiohttp.ClientSession | None = None

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post(GENERATE, self.generate)
        app.router.add_route("*", "/{tail:.*}", self.forward)
        return app

    @property
    def s(self) -> aiohttp.ClientSession:
        assert self.session is not None
        return self.session

    async def forward(self, request: web.Request) -> web.Response:
        async with self.s.request(request.method, self.target + request.path_qs, data=await request.read(),
                                  headers={"Content-Type": request.content_type}) as r:
            return web.Response(status=r.status, body=await r.read(), content_type=r.content_type)

    async def generate(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        body = json.loads(raw)
        if not body.get("stream"):
            return await self.forward_body(raw)
        limit = self.cut_after.get(body.get("request_id", ""), 3)
        async with self.s.post(self.target + GENERATE, data=raw,
                               headers={"Content-Type": "application/json"}) as r:
            if r.status != 200:
                return web.Response(status=r.status, body=await r.read(), content_type=r.content_type)
            resp = web.StreamResponse(headers={"Content-Type": r.headers.get("Content-Type", "")})
            await resp.prepare(request)
            buf, seen, finished = b"", 0, False
            async for chunk in r.content.iter_any():
                buf += chunk
                while b"\n\n" in buf:
                    event, buf = buf.split(b"\n\n", 1)
                    await resp.write(event + b"\n\n")
                    if event.startswith(b"data: {"):
                        choices = json.loads(event[6:]).get("choices") or []
                        seen += sum(len(c.get("token_ids") or []) for c in choices)
                        finished = any(c.get("finish_reason") is not None for c in choices)
                    if seen >= limit:
                        # Under load vLLM merges tokens into fewer events, so the event that
                        # reaches the limit may carry the finish: then the client already has
                        # every token and the proxy only ends the stream (no migration).
                        (self.cuts_after_finish if finished else self.cuts).append(body.get("request_id", ""))
                        assert request.transport is not None
                        request.transport.abort()  # the "worker" dies mid-stream
                        return resp  # leaving the block closes the upstream: vLLM drops it
            return resp

    async def forward_body(self, raw: bytes) -> web.Response:
        async with self.s.post(self.target + GENERATE, data=raw,
                               headers={"Content-Type": "application/json"}) as r:
            return web.Response(status=r.status, body=await r.read(), content_type=r.content_type)


@pytest.fixture
async def migration_stack(vllm_cluster: Cluster) -> AsyncIterator[tuple[str, CuttingRelay, web.Application]]:
    relay = CuttingRelay(vllm_cluster.decode_urls[0])
    runners: list[web.AppRunner] = []

    async def serve(app: web.Application) -> str:
        runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=5)
        await runner.setup()
        runners.append(runner)
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = next(int(a[1]) for a in runner.addresses if isinstance(a, tuple))
        return f"http://127.0.0.1:{port}"

    async with aiohttp.ClientSession(connector=vllm_connector(),
                                     timeout=aiohttp.ClientTimeout(total=300)) as session:
        relay.session = session
        try:
            relay_url = await serve(relay.app())
            pools = PoolSettings(decode_policy="round_robin", breaker_failures=10**6, active_health=False,
                                 decode_attempts=1)
            proxy_app = build_app(ProxySettings(
                prefill_urls=tuple(vllm_cluster.prefill_urls),
                decode_urls=(relay_url, vllm_cluster.decode_urls[0]), pools=pools,
                connect_timeout=E2E_CONNECT_TIMEOUT))
            url = await serve(proxy_app)
            yield url, relay, proxy_app
        finally:
            for runner in reversed(runners):
                await runner.cleanup()


async def stream_call(s: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[list[int], str]:
    async with s.post(url + GENERATE, json=body) as r:
        raw = await r.read()
        assert r.status == 200, raw[:500]
    events = sse.events(raw, comments=True)
    assert events[-1] == b"[DONE]"
    tokens: list[int] = []
    text: list[str] = []
    for ev in events[:-1]:
        obj = json.loads(ev)
        assert "error" not in obj, obj
        for c in obj["choices"]:
            tokens += c["token_ids"]
            text.append(c.get("text") or "")
    return tokens, "".join(text)


@pytest.mark.parametrize("mode", ["tokens", "text"])
async def test_stream_cut_mid_way_continues_with_identical_tokens(
        vllm_cluster: Cluster, migration_stack: tuple[str, CuttingRelay, web.Application], mode: str) -> None:
    url, relay, app = migration_stack
    aggregated = vllm_cluster.aggregated_urls[0]
    serving = app[SERVING]
    async with aiohttp.ClientSession(connector=vllm_connector(),
                                     timeout=aiohttp.ClientTimeout(total=180)) as s:
        for i, prompt in enumerate(prompts()):
            body = {"token_ids": prompt, "output_mode": mode, "stream": True,
                    "sampling_params": {"temperature": 0, "max_tokens": MAX_TOKENS}}
            want = await stream_call(s, aggregated, {**body, "request_id": f"mig-agg-{mode}-{i}"})
            rid = f"mig-px-{mode}-{i}"
            relay.cut_after[rid] = 1 + (i * 5) % (MAX_TOKENS - 2)  # 1..14 tokens before the cut
            got = await stream_call(s, url, {**body, "request_id": rid})
            assert got[0] == want[0], f"prompt {i} ({len(prompt)} tokens): token ids differ"
            if mode == "text":
                assert got[1] == want[1], f"prompt {i}: text differs"
    cut = [r for r in relay.cuts if r.startswith(f"mig-px-{mode}-")]
    late = [r for r in relay.cuts_after_finish if r.startswith(f"mig-px-{mode}-")]
    # round robin: at least every other stream went through the relay (cut after 1..14 tokens)
    assert len(cut) + len(late) >= N_PROMPTS // 2 and cut
    lines = (await serving_metrics(url)).splitlines()
    migrations = next(float(ln.split()[1]) for ln in lines if ln.startswith("pd_proxy_migrations_total "))
    assert migrations >= len(cut)
    assert len(serving.table) == 0 and serving.leases.open_count == 0


async def serving_metrics(url: str) -> str:
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        return await r.text()
