"""A scripted stand-in for a vLLM worker: records what it receives, answers what it is told.

Used where pd-sim cannot play the part (text mode, logprobs, recorded-trace replays, a server
that predates ``output_mode``) and to see the exact bodies of the proxy's hops.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web

Reply = Callable[[dict[str, Any], web.Request], Any]

KV_PARAMS = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[1]],
             "remote_engine_id": "eng", "remote_request_id": "rr", "remote_host": "localhost",
             "remote_port": 5600, "tp_size": 1, "remote_prefill_cached_tokens": 0}


def prefill_reply(body: dict[str, Any], kv: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    rid = "generate-tokens-" + str(body.get("request_id"))
    out = {"request_id": rid, "model": "tiny-llama", "created": 1,
           "usage": {"prompt_tokens": len(body["token_ids"]),
                     "total_tokens": len(body["token_ids"]) + 1, "completion_tokens": 1,
                     "prompt_tokens_details": None, "completion_tokens_details": None},
           "prompt_logprobs": None, "prompt_token_id_logprobs": None, "prompt_token_ids": None,
           "mm_placeholders": None, "metrics": None, "kv_transfer_params": dict(kv or KV_PARAMS),
           "ec_transfer_params": None, "output_mode": "tokens",
           "choices": [{"index": 0, "finish_reason": "length", "stop_reason": None, "token_ids": [7],
                        "routed_experts": None, "sampling_mask": None, "weight_versions": None,
                        "logprobs": None}]}
    out.update(extra)
    return out


@dataclass
class Scripted:
    url: str
    received: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    aborts: list[Any] = field(default_factory=list)
    reply: Reply | None = None


class SSEBytes:
    """Answer a stream: write each given piece separately (every split the test wants)."""

    def __init__(self, pieces: list[bytes], delay: float = 0.0) -> None:
        self.pieces = pieces
        self.delay = delay


async def _serve(worker: Scripted, request: web.Request) -> web.StreamResponse:
    body = await request.json()
    worker.received.append(body)
    worker.headers.append({k.lower(): v for k, v in request.headers.items()})
    assert worker.reply is not None
    out = worker.reply(body, request)
    if asyncio.iscoroutine(out):
        out = await out
    if isinstance(out, web.StreamResponse):
        return out
    if isinstance(out, SSEBytes):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await resp.prepare(request)
        for piece in out.pieces:
            await resp.write(piece)
            if out.delay:
                await asyncio.sleep(out.delay)
        await resp.write_eof()
        return resp
    return web.json_response(out)


ScriptedFactory = Callable[..., Any]


@pytest.fixture
async def scripted_factory(aiohttp_server: Any) -> AsyncIterator[ScriptedFactory]:
    async def make(reply: Reply) -> Scripted:
        worker = Scripted(url="")
        worker.reply = reply
        app = web.Application()

        async def generate(request: web.Request) -> web.StreamResponse:
            return await _serve(worker, request)

        async def abort(request: web.Request) -> web.Response:
            worker.aborts.append(json.loads(await request.read()))
            return web.Response()

        async def health(request: web.Request) -> web.Response:
            return web.Response()

        app.router.add_post("/inference/v1/generate", generate)
        app.router.add_post("/inference/v1/abort_requests", abort)
        app.router.add_get("/health", health)
        server = await aiohttp_server(app, host="127.0.0.1")
        worker.url = str(server.make_url("")).rstrip("/")
        return worker

    yield make
