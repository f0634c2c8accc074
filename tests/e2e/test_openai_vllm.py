"""Real vLLM 0.32 (CPU, tiny model): greedy /v1/chat/completions and /v1/completions through
pd-proxy's P/D split answer what the decode worker alone answers on the same paths (text, finish
and stop reason, usage), stream and not, fast path and derender path, and the KV crossed (D took
the prompt's whole blocks from P)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest

from tests.e2e.proxy_stack import run_proxy
from tests.fixtures_vllm import metric_value, scrape_metrics
from tests.proxy.test_openai import summary
from workers.launcher import Cluster

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]

PULLED = ("vllm:prompt_tokens_by_source_total", {"source": "external_kv_transfer"})
"""Prompt tokens D took from P's KV (whole 128-token blocks on the CPU build)."""
STORY = " ".join(["The river ran past the old mill, and the miller counted his sacks of grain."] * 8)
"""About 200 tokens: a prompt under one KV block (128 tokens here) skips the prefill hop."""
MSGS = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": STORY + " Tell me about the river."}]
PROMPT = STORY + " The quick brown fox"
BODIES = [
    ("/v1/chat/completions", {"messages": MSGS, "max_tokens": 16, "temperature": 0}),  # 16: render omits it
    ("/v1/chat/completions", {"messages": MSGS, "max_tokens": 24, "temperature": 0, "stop": ["e"]}),
    ("/v1/chat/completions", {"messages": MSGS, "max_tokens": 4, "temperature": 0, "logprobs": True,
                              "top_logprobs": 2}),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 16, "temperature": 0}),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 24, "temperature": 0, "stop": "r"}),
]


async def _post(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> bytes:
    async with session.post(url, json=body) as r:
        raw = await r.read()
        assert r.status == 200, raw
        return raw


@pytest.mark.parametrize("derender", ["auto", "always"])
async def test_openai_through_the_split_is_the_decode_workers_answer(vllm_cluster: Cluster,
                                                                     derender: str) -> None:
    decode = vllm_cluster.decode_urls[0]
    async with run_proxy(vllm_cluster, openai_derender=derender) as (url, _app), aiohttp.ClientSession() as s:
        for n, (path, base) in enumerate(BODIES):
            for stream in (False, True):
                usage = {"stream_options": {"include_usage": True}} if stream else {}
                body = {**base, "stream": stream, **usage}
                # A salt of each request's own: D's prefix cache (filled by the same prompt sent to D
                # alone) must not spare the pull through the proxy.
                salt = f"{derender}-{n}-{stream}"
                before = metric_value(await asyncio.to_thread(scrape_metrics, decode), *PULLED) or 0.0
                got = await _post(s, url + path, {**body, "cache_salt": "proxy-" + salt})
                after = metric_value(await asyncio.to_thread(scrape_metrics, decode), *PULLED) or 0.0
                want = await _post(s, decode + path, {**body, "cache_salt": "alone-" + salt})
                chat = path.endswith("chat/completions")
                assert summary(got, stream=stream, chat=chat) == summary(want, stream=stream, chat=chat), \
                    (path, body)
                assert after - before >= 128, (path, stream, before, after)  # D pulled P's KV blocks
                if not stream and "logprobs" in body:
                    got_lp, want_lp = (json.loads(x)["choices"][0]["logprobs"] for x in (got, want))
                    assert got_lp == want_lp
