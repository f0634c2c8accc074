"""Live ``/metrics`` scrapes for the dashboard checks: pd-proxy after scripted traffic through it
(successes, a prefill failure, an abort broadcast), and the workers behind it."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp

GEN = "/inference/v1/generate"
# 200 tokens: more than one 128-token KV block, so a real P/D pair moves KV over NIXL.
PROMPT = [3 + (i * 37) % 512 for i in range(200)]


@dataclass(frozen=True)
class Scrapes:
    proxy: str
    workers: tuple[str, ...]


async def _text(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(f"{url}/metrics") as r:
        assert r.status == 200, url
        return await r.text()


async def _generate(session: aiohttp.ClientSession, proxy: str, *, stream: bool, rid: str) -> int:
    body = {
        "token_ids": PROMPT,
        "sampling_params": {"temperature": 0, "max_tokens": 4, "ignore_eos": True},
        "stream": stream,
        "stream_options": {"include_usage": True} if stream else None,
    }
    if not stream:
        del body["stream_options"]
    async with session.post(proxy + GEN, json=body, headers={"X-Request-Id": rid}) as r:
        await r.read()
        return r.status


async def traffic_and_scrape(
    proxy: str, workers: Sequence[str], *, fail_prefill: str | None = None
) -> Scrapes:
    """Send a stream and a non-stream request, an abort for an unknown id (broadcast to every worker)
    and, with ``fail_prefill`` (a pd-sim prefill URL), one request whose first prefill call fails
    with a 503 (an upstream error, then a retry); then scrape."""
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        assert await _generate(s, proxy, stream=True, rid="dash-1") == 200
        assert await _generate(s, proxy, stream=False, rid="dash-2") == 200
        abort = {"request_ids": ["generate-tokens-dash-unknown"]}  # a generate id: only those are broadcast
        async with s.post(proxy + "/inference/v1/abort_requests", json=abort) as r:
            assert r.status == 200
        if fail_prefill is not None:
            async with s.post(fail_prefill + "/sim/faults", json={"fail_next": 1, "fail_status": 503}) as r:
                assert r.status == 200
            assert await _generate(s, proxy, stream=False, rid="dash-3") in (200, 502)
        await asyncio.sleep(0.2)  # the abort broadcast runs in the background
        return Scrapes(await _text(s, proxy), tuple([await _text(s, w) for w in workers]))
