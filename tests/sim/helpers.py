"""Small client helpers shared by the pd-sim tests."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp

from tests.sse import datas

GEN = "/inference/v1/generate"
ABORT = "/inference/v1/abort_requests"


def body(tokens: list[int] | None = None, max_tokens: int | None = 4, **extra: Any) -> dict[str, Any]:
    sp: dict[str, Any] = {"temperature": 0}
    if max_tokens is not None:
        sp["max_tokens"] = max_tokens
    sp.update(extra.pop("sp", {}))
    return {"token_ids": tokens or [300, 301, 302, 303, 304, 305, 306], "sampling_params": sp, **extra}


async def post_json(
    session: aiohttp.ClientSession, url: str, payload: Any, headers: dict[str, str] | None = None
) -> tuple[int, Any]:
    async with session.post(url, json=payload, headers=headers) as r:
        raw = await r.read()
        return r.status, (json.loads(raw) if raw else None)


async def stream_events(
    session: aiohttp.ClientSession, url: str, payload: Any, headers: dict[str, str] | None = None
) -> list[Any]:
    """All SSE data payloads (JSON-decoded; ``[DONE]`` kept as the string)."""
    async with session.post(url, json=payload, headers=headers) as r:
        assert r.status == 200, await r.text()
        return datas(await r.read())


def stream_tokens(events: list[Any], index: int = 0) -> list[int]:
    toks: list[int] = []
    for ev in events:
        if isinstance(ev, dict):
            for c in ev.get("choices", []):
                if c["index"] == index:
                    toks.extend(c["token_ids"])
    return toks


async def eventually(
    check: Callable[[], Awaitable[bool]], *, attempts: int = 200, interval: float = 0.02
) -> bool:
    """Poll ``check`` a bounded number of times (not a timing assertion: it just waits for a state)."""
    for _ in range(attempts):
        if await check():
            return True
        await asyncio.sleep(interval)
    return False
