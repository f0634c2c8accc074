"""Multi-turn conversations against a generate endpoint: turn k+1 of a conversation is sent only
after turn k answered, with that answer's token ids in its prompt; conversations run side by side.

Every loop is bounded: a conversation has a fixed number of turns, a failed turn ends its
conversation (the later turns are recorded as not sent), and each request has a timeout.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from benchmarks.datasets import Conversation, next_turn_prompt


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
    e2e_s: float | None = None
    order: int = -1
    """Position among all turns in the order they finished."""


async def _one_turn(session: aiohttp.ClientSession, url: str, prompt: list[int], output_len: int,
                    request_id: str) -> list[int]:
    body: dict[str, Any] = {
        "request_id": request_id,
        "token_ids": prompt,
        "sampling_params": {"max_tokens": output_len, "temperature": 0.0, "ignore_eos": True},
        "stream": False,
    }
    async with session.post(url, json=body) as resp:
        data = await resp.json(content_type=None)
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {data}")
    ids = data["choices"][0]["token_ids"]
    if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
        raise RuntimeError("answer without token_ids")
    return ids


async def run_conversations(
    session: aiohttp.ClientSession,
    url: str,
    conversations: Sequence[Conversation],
    max_concurrency: int = 8,
    request_timeout_s: float = 60.0,
) -> list[TurnRecord]:
    """Run every conversation; the records come back by conversation, then turn."""
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
                        _one_turn(session, url, prompt, conv.output_len, f"conv{conv.index}-turn{turn}"),
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
