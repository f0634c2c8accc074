"""Multi-turn conversations against a generate endpoint: turn k+1 of a conversation is sent only
after turn k answered, with that answer's token ids in its prompt; conversations run side by side.
Every turn is streamed (tokens mode), so each has its TTFT (send to the first token-bearing event)
and E2E (send to ``data: [DONE]``).

Every loop is bounded: a conversation has a fixed number of turns, a failed turn ends its
conversation (the later turns are recorded as not sent), and each request has a timeout.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from benchmarks.datasets import Conversation, next_turn_prompt
from benchmarks.sse import SSEDecoder

_MAX_ERROR_BODY = 4096


@dataclass
class TurnRecord:
    conversation: int
    turn: int
    prompt: list[int] = field(default_factory=list)
    answer: list[int] = field(default_factory=list)
    sent: bool = False
    success: bool = False
    error: str | None = None
    start_s: float = 0.0
    ttft_s: float | None = None
    e2e_s: float | None = None
    order: int = -1
    """Position among all turns in the order they finished."""


def _answer_ids(data: str, answer: list[int]) -> bool:
    """Add one event's token ids to ``answer``; True when it carried any. An error event raises."""
    obj = json.loads(data)
    if not isinstance(obj, dict) or "error" in obj:
        raise RuntimeError(f"error event: {str(obj)[:200]}")
    ids: list[int] = []
    for choice in obj.get("choices") or []:
        if isinstance(choice, dict) and choice.get("index", 0) == 0:
            got = choice.get("token_ids") or []
            if not isinstance(got, list) or not all(isinstance(t, int) for t in got):
                raise RuntimeError("an event with token_ids that are not integers")
            ids += got
    answer += ids
    return bool(ids)


async def _one_turn(session: aiohttp.ClientSession, url: str, prompt: list[int], output_len: int,
                    request_id: str, *, rec: TurnRecord, headers: dict[str, str]) -> list[int]:
    """Stream one turn; its TTFT goes to ``rec.ttft_s`` (seconds after the send), its answer's token
    ids are returned once ``data: [DONE]`` came."""
    body: dict[str, Any] = {
        "request_id": request_id,
        "token_ids": prompt,
        "sampling_params": {"max_tokens": output_len, "temperature": 0.0, "ignore_eos": True},
        "stream": True,
        "output_mode": "tokens",
    }
    sent = time.perf_counter()
    answer: list[int] = []
    async with session.post(url, json=body, headers={**headers, "X-Request-Id": request_id}) as resp:
        if resp.status != 200:
            raw = await resp.content.read(_MAX_ERROR_BODY)
            raise RuntimeError(f"HTTP {resp.status}: {raw.decode('utf-8', errors='replace')}")
        if "text/event-stream" not in resp.headers.get("Content-Type", ""):
            raise RuntimeError(f"expected an event stream, got {resp.headers.get('Content-Type')!r}")
        decoder = SSEDecoder()
        async for chunk in resp.content.iter_any():
            for ev in decoder.feed(chunk):
                if ev.data is None:
                    continue
                if ev.data.strip() == "[DONE]":
                    return answer
                if _answer_ids(ev.data, answer) and rec.ttft_s is None:
                    rec.ttft_s = time.perf_counter() - sent
    raise RuntimeError("stream ended without data: [DONE]")


async def run_conversations(
    session: aiohttp.ClientSession,
    url: str,
    conversations: Sequence[Conversation],
    *,
    max_concurrency: int = 8,
    request_timeout_s: float = 60.0,
    headers: dict[str, str] | None = None,
) -> list[TurnRecord]:
    """Run every conversation; the records come back by conversation, then turn. ``headers`` go
    with every request (an ``Authorization`` key)."""
    if max_concurrency < 1:
        raise ValueError("max_concurrency must be at least 1")
    sem = asyncio.Semaphore(max_concurrency)
    t0 = time.perf_counter()
    finished = 0
    records = {c.index: [TurnRecord(c.index, t) for t in range(len(c.users))] for c in conversations}

    async def converse(conv: Conversation) -> None:
        nonlocal finished
        prompt: list[int] | None = None
        answer: list[int] = []
        for turn, rec in enumerate(records[conv.index]):
            prompt = next_turn_prompt(prompt, answer, conv, turn)
            rec.prompt = prompt
            async with sem:
                rec.sent = True
                rec.start_s = time.perf_counter() - t0
                try:
                    answer = await asyncio.wait_for(
                        _one_turn(session, url, prompt, conv.output_len, f"conv{conv.index}-turn{turn}",
                                  rec=rec, headers=headers or {}),
                        request_timeout_s,
                    )
                except (aiohttp.ClientError, RuntimeError, TimeoutError, ValueError, KeyError) as exc:
                    rec.error = f"{type(exc).__name__}: {exc}"
                    return
                finally:
                    rec.order = finished
                    finished += 1
                    rec.e2e_s = time.perf_counter() - t0 - rec.start_s
            rec.answer = answer
            rec.success = True

    tasks = [asyncio.create_task(converse(c)) for c in conversations]
    try:
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return [r for c in conversations for r in records[c.index]]
