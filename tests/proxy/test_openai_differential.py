"""The OpenAI routes' fast path (text-mode hops framed in the proxy) answers what the derender
path answers (tokens-mode hops, each chunk or the whole answer derendered on a worker), for any
chat or completions request: the same text, finish and stop reason, usage. Both run on one pd-sim
pair through the whole walk (``--openai-derender auto`` against ``always``)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.config.settings import ProxySettings
from proxy.http.app import build_app
from proxy.pools import PoolSettings
from tests.proxy.test_openai import CHAT, CMPL, MSGS, summary
from workers.sim import SimSettings
from workers.sim import build_app as sim_app

HYPO = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                       HealthCheck.function_scoped_fixture])


async def _serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = next(int(a[1]) for a in runner.addresses if isinstance(a, tuple))
    return runner, f"http://127.0.0.1:{port}"


@asynccontextmanager
async def pair_and_proxies() -> AsyncIterator[tuple[str, str]]:
    """One pd-sim pair, and two proxies in front of it: ``auto`` (text mode) and ``always``."""
    runners = []
    try:
        p_run, p = await _serve(sim_app(SimSettings(role="prefill", zero_latency=True)))
        d_run, d = await _serve(sim_app(SimSettings(role="decode", zero_latency=True)))
        runners += [p_run, d_run]
        urls = []
        for mode in ("auto", "always"):
            s = ProxySettings(prefill_urls=(p,), decode_urls=(d,), pools=PoolSettings.plain(),
                              openai_derender=mode)
            run, url = await _serve(build_app(s))
            runners.append(run)
            urls.append(url)
        yield urls[0], urls[1]
    finally:
        for run in reversed(runners):
            await run.cleanup()


stops = st.lists(st.text(alphabet="aeiou r>", min_size=1, max_size=3), max_size=2)
cases = st.fixed_dictionaries({
    "chat": st.booleans(), "stream": st.booleans(), "max_tokens": st.integers(1, 24), "stop": stops,
    "usage": st.booleans(), "sampled": st.booleans(), "seed": st.integers(0, 1000),
    "logprobs": st.booleans(), "words": st.text(alphabet="abcdé😀 ,?", min_size=1, max_size=20),
})


def _body(c: dict[str, Any]) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "tiny-llama", "max_tokens": c["max_tokens"], "stop": c["stop"],
                            "temperature": 0.8 if c["sampled"] else 0, "seed": c["seed"]}
    if c["chat"]:
        body["messages"] = [*MSGS, {"role": "user", "content": c["words"]}]
        if c["logprobs"]:
            body.update(logprobs=True, top_logprobs=2)
    else:
        body["prompt"] = c["words"]
    if c["stream"]:
        body.update(stream=True, stream_options={"include_usage": c["usage"]})
    return body


def test_fast_path_answers_what_derender_answers() -> None:
    loop = asyncio.new_event_loop()
    try:
        stack = pair_and_proxies()
        fast, slow = loop.run_until_complete(stack.__aenter__())
        session = aiohttp.ClientSession(loop=loop)

        async def ask(url: str, path: str, body: dict[str, Any]) -> bytes:
            async with session.post(url + path, json=body) as r:
                raw = await r.read()
                assert r.status == 200, raw
                return raw

        @HYPO
        @given(c=cases)
        def check(c: dict[str, Any]) -> None:
            path, body = (CHAT if c["chat"] else CMPL), _body(c)
            got = loop.run_until_complete(ask(fast, path, body))
            want = loop.run_until_complete(ask(slow, path, body))
            assert summary(got, stream=c["stream"], chat=c["chat"]) == \
                summary(want, stream=c["stream"], chat=c["chat"])

        try:
            check()
        finally:
            loop.run_until_complete(session.close())
            loop.run_until_complete(stack.__aexit__(None, None, None))
    finally:
        loop.close()
