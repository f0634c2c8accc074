"""A tiny aiohttp server that answers /inference/v1/generate from a script (for client tests)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from multidict import CIMultiDict


@dataclass
class Script:
    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    # (seconds to sleep, bytes to write) in order; for a stream
    steps: list[tuple[float, bytes]] = field(default_factory=list)
    json_body: dict[str, Any] | None = None  # a non-stream answer
    raw_body: bytes | None = None  # a non-stream answer as recorded bytes
    content_type: str = "text/event-stream"
    honour_abort: bool = True  # an abort naming this request ends the stream as vLLM does


@dataclass
class Seen:
    bodies: list[dict[str, Any]] = field(default_factory=list)
    headers: list[CIMultiDict[str]] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0
    disconnects: int = 0
    first_write: asyncio.Event = field(default_factory=asyncio.Event)
    disconnected: asyncio.Event = field(default_factory=asyncio.Event)
    aborts: list[dict[str, Any]] = field(default_factory=list)
    aborted: set[str] = field(default_factory=set)
    abort_event: asyncio.Event = field(default_factory=asyncio.Event)


ScriptFn = Callable[[dict[str, Any]], Script]
SCRIPT: web.AppKey[ScriptFn] = web.AppKey("script")
SEEN = web.AppKey("seen", Seen)


def chunk(
    rid: str,
    token_ids: list[int],
    finish: str | None = None,
    mode: str | None = "tokens",
    text: str | None = None,
) -> bytes:
    choice: dict[str, Any] = {
        "index": 0,
        "finish_reason": finish,
        "stop_reason": None,
        "token_ids": token_ids,
    }
    if text is not None:
        choice["text"] = text
    obj: dict[str, Any] = {"request_id": f"generate-tokens-{rid}", "usage": None, "choices": [choice]}
    if mode is not None:
        obj["output_mode"] = mode
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"


def stream_of(
    rid: str, sizes: list[int], gap_s: float = 0.0, mode: str = "tokens"
) -> list[tuple[float, bytes]]:
    """Token chunks of the given sizes, the last with finish_reason length, then [DONE]."""
    steps: list[tuple[float, bytes]] = []
    tok = 3
    for i, n in enumerate(sizes):
        ids = list(range(tok, tok + n))
        tok += n
        fin = "length" if i == len(sizes) - 1 else None
        steps.append((gap_s, chunk(rid, ids, fin, mode, text="x" * n if mode == "text" else None)))
    steps.append((0.0, DONE))
    return steps


def echo_stream(body: dict[str, Any]) -> Script:
    """A well-behaved server: one token per chunk, exactly max_tokens of them."""
    rid = str(body.get("request_id"))
    n = int(body["sampling_params"]["max_tokens"])
    return Script(steps=stream_of(rid, [1] * n, mode=str(body.get("output_mode", "tokens"))))


async def generate(request: web.Request) -> web.StreamResponse:
    seen = request.app[SEEN]
    body = await request.json()
    seen.bodies.append(body)
    seen.headers.append(request.headers.copy())
    script = request.app[SCRIPT](body)
    seen.in_flight += 1
    seen.max_in_flight = max(seen.max_in_flight, seen.in_flight)
    try:
        if script.raw_body is not None:
            return web.Response(
                body=script.raw_body,
                status=script.status,
                headers=script.headers,
                content_type=script.content_type,
            )
        if script.status != 200 or script.json_body is not None:
            return web.json_response(
                script.json_body
                or {"error": {"message": "bad", "type": "BadRequestError", "param": None, "code": 400}},
                status=script.status,
                headers=script.headers,
            )
        resp = web.StreamResponse(status=200, headers=script.headers)
        resp.content_type = script.content_type
        await resp.prepare(request)
        engine_id = f"generate-tokens-{body.get('request_id')}"
        for delay, data in script.steps:
            if delay:
                await _sleep_or_abort(seen, engine_id, delay if script.honour_abort else None, delay)
            if script.honour_abort and engine_id in seen.aborted:
                await resp.write(chunk(str(body.get("request_id")), [], "abort"))
                await resp.write(DONE)
                return resp
            await resp.write(data)
            seen.first_write.set()
        return resp
    except (ConnectionResetError, asyncio.CancelledError):
        seen.disconnects += 1
        seen.disconnected.set()
        raise
    finally:
        seen.in_flight -= 1


async def _sleep_or_abort(seen: Seen, engine_id: str, abortable: float | None, delay: float) -> None:
    """Sleep ``delay``; an abort of ``engine_id`` cuts an abortable sleep short."""
    if abortable is None:
        await asyncio.sleep(delay)
        return
    loop = asyncio.get_running_loop()
    end = loop.time() + delay
    while engine_id not in seen.aborted and (left := end - loop.time()) > 0:
        seen.abort_event.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(seen.abort_event.wait(), left)


async def abort(request: web.Request) -> web.Response:
    seen = request.app[SEEN]
    body = await request.json()
    seen.aborts.append(body)
    seen.aborted.update(body.get("request_ids") or [])
    seen.abort_event.set()
    return web.Response(status=200)


def make_app(script: ScriptFn) -> web.Application:
    app = web.Application()
    app[SCRIPT] = script
    app[SEEN] = Seen()
    app.router.add_post("/inference/v1/generate", generate)
    app.router.add_post("/inference/v1/abort_requests", abort)
    return app
