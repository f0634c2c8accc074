"""OpenAI's ``/v1/chat/completions`` and ``/v1/completions`` through the P/D split: rendered on a
tokenizer worker, walked as ``/inference/v1/generate`` under render's id, answered in OpenAI's shape."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from aiohttp import web

from proxy.config.tenants import OPEN, Tenant
from proxy.openai.frames import Answer, Framer, full_answer
from proxy.openai.outputs import Derendering, DerenderStream, TextStream, derender_full
from proxy.openai.workers import Reply, TokenizerWorkers
from proxy.sse.relay import STREAM_OUTPUT
from proxy.walk.core import Core
from proxy.walk.flight import Flight
from proxy.wire.errors import BadRequest
from proxy.wire.ids import client_request_id, upstream_id
from proxy.wire.protocol import compact_json, engine_request_id

log = logging.getLogger("pd_proxy")

CHAT_PATH, COMPLETIONS_PATH = "/v1/chat/completions", "/v1/completions"
RENDER_DEFAULT_MAX_TOKENS = 16
"""vLLM's ``SamplingParams`` default ``max_tokens``, which render's answer leaves out."""
PASS_THROUGH = ("/v1/chat/completions/render", "/v1/completions/render", "/v1/chat/completions/derender",
                "/v1/completions/derender", "/v1/messages/render", "/v1/responses/render")
"""Calls forwarded to a tokenizer worker as they are (body, content type, ``X-Request-Id``)."""
POST_PATHS = (CHAT_PATH, COMPLETIONS_PATH, *PASS_THROUGH)


class Walk(Protocol):

    def __call__(self, request: web.Request, body: bytes | bytearray, content_type: str, t0: float, *,
                 tenant: Tenant = OPEN, client_id: str | None = None) -> Awaitable[web.StreamResponse]: ...


def derender_reason(core: Core, client: dict[str, Any], rendered: dict[str, Any], *,
                    chat: bool) -> str | None:
    """Why this request's answer must be derendered (None: text-mode hops give it exactly)."""
    s = core.settings
    sp = rendered.get("sampling_params") or {}
    if s.openai_derender == "always":
        return "always"
    if s.decode_tokens_only or s.prefill_tokens_only:
        return "tokens_only"  # no text mode on the hops
    if chat and client.get("tools") and client.get("tool_choice") != "none":
        return "tools"
    if sp.get("prompt_logprobs") is not None:
        return "prompt_logprobs"
    if not chat and (sp.get("logprobs") is not None or client.get("echo")):
        return "completions_logprobs_or_echo"  # offsets into the text, the prompt's text
    return None


def _passed(reply: Reply) -> web.Response:
    resp = web.Response(status=reply.status, body=reply.body)
    resp.content_type = reply.content_type.split(";")[0].strip() or "application/json"
    return resp


def _client_headers(request: web.Request) -> list[tuple[str, str]]:
    rid = request.headers.get("X-Request-Id")
    return [("X-Request-Id", rid)] if rid is not None else []


class OpenAIRoutes:

    def __init__(self, core: Core, walk: Walk, abort: Callable[[Flight, str], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.core, self.walk, self.abort, self.clock = core, walk, abort, clock
        self.workers = TokenizerWorkers(core)

    async def pass_through(self, request: web.Request) -> web.Response:
        body = await request.read()
        reply = await self.workers.call("POST", request.path, body,
                                        content_type=request.headers.get("Content-Type"),
                                        headers=_client_headers(request))
        return _passed(reply)

    async def models(self, request: web.Request) -> web.Response:
        return _passed(await self.workers.call("GET", "/v1/models"))

    async def serve(self, request: web.Request, tenant: Tenant, *, chat: bool) -> web.StreamResponse:
        """One chat or completions request: render, the walk, the answer in OpenAI's shape."""
        t0 = self.clock()
        body = await request.read()
        reply = await self.workers.call("POST", f"{request.path}/render", body,
                                        content_type=request.headers.get("Content-Type"),
                                        headers=_client_headers(request))
        if reply.status != 200:
            return _passed(reply)  # vLLM's own answer: a bad body, an unknown model, too long...
        rendered = reply.json()
        if not chat:
            if not isinstance(rendered, list) or len(rendered) != 1:
                raise BadRequest("pd-proxy serves one prompt per /v1/completions request "
                                 f"(got {len(rendered) if isinstance(rendered, list) else 0})",
                                 param="prompt")
            rendered = rendered[0]
        client = json.loads(body)  # render took it: a JSON object
        if not isinstance(rendered, dict) or not isinstance(client, dict):
            raise BadRequest("the request could not be rendered")
        sp = rendered.get("sampling_params")
        if isinstance(sp, dict) and "max_tokens" not in sp:
            # Render's sparse dump leaves out a max_tokens equal to SamplingParams' default (16);
            # generate would read its absence as "up to the model's length".
            sp["max_tokens"] = RENDER_DEFAULT_MAX_TOKENS
        rid = rendered.get("request_id")
        client_id = client_request_id(None, rid if isinstance(rid, str) else None)
        if client_id is None:
            raise BadRequest("render gave no request id", param="request_id")
        a = await self._answer(reply.worker, rendered, client, client_id, chat=chat)
        why = derender_reason(self.core, client, rendered, chat=chat)
        d = None
        if why is None:
            rendered["output_mode"] = "text"
        else:
            d = Derendering(self.workers, reply.worker, a, prompt=list(rendered.get("token_ids") or []),
                            client_body=client, sampling=rendered.get("sampling_params") or {})
        if rendered.get("stream"):
            request[STREAM_OUTPUT] = TextStream(Framer(a)) if d is None else DerenderStream(
                d, on_failure=lambda: self._abort(tenant, client_id, t0))
        resp = await self.walk(request, compact_json(rendered), "application/json", t0, tenant=tenant,
                               client_id=client_id)
        if isinstance(resp, web.Response) and resp.status == 200 and resp.body is not None:
            gen = json.loads(bytes(resp.body))  # type: ignore[arg-type]  # the walk's bytes
            resp.body = compact_json(full_answer(a, gen) if d is None else await derender_full(d, gen))
        return resp

    def _abort(self, tenant: Tenant, client_id: str, t0: float) -> None:
        """Abort this request as the walk aborts any (``Aborts.abort``: P or D told, P's KV
        released by the walk or its clean-up). Its flight is the one received at ``t0``: other
        requests under the same id go on."""
        for f in self.core.table.entries(engine_request_id(upstream_id(tenant.tag, client_id))):
            if f.timing.received == t0:
                self.abort(f, "derender")

    async def _answer(self, worker: str, rendered: dict[str, Any], client: dict[str, Any], rid: str, *,
                      chat: bool) -> Answer:
        sp = rendered.get("sampling_params") or {}
        model = client.get("model")
        if not isinstance(model, str) or not model:
            model = await self.workers.served_model(worker)
        opts = rendered.get("stream_options") or {}
        return Answer(rid=rid, model=model, chat=chat, n=int(sp.get("n") or 1),
                      include_usage=bool(opts.get("include_usage")),
                      return_token_ids=client.get("return_token_ids") is True)


__all__ = ["CHAT_PATH", "COMPLETIONS_PATH", "PASS_THROUGH", "POST_PATHS", "OpenAIRoutes", "Walk",
           "derender_reason"]
