"""The non-stream decode: one decode hop (retried through ``proxy.walk.decode``), D's reply sent as
its own bytes with what only P knows spliced in."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from aiohttp import web

from proxy.pools import Outcome, Worker
from proxy.walk.aborts import Aborts
from proxy.walk.cleanup import Cleanup
from proxy.walk.core import Core, Part
from proxy.walk.decode import DecodeAttempts, DecodeEngine
from proxy.walk.flight import Flight
from proxy.wire.errors import (
    UpstreamError,
    UpstreamProtocolError,
    UpstreamStatusError,
)
from proxy.wire.protocol import (
    compact_json,
    splice_null_key,
)

log = logging.getLogger("pd_proxy")


class FullDecode(Part):
    def __init__(self, core: Core, engine: DecodeEngine, aborts: Aborts, cleanup: Cleanup) -> None:
        super().__init__(core)
        self.engine = engine
        self.aborts = aborts
        self.cleanup = cleanup

    async def decode(self, f: Flight, worker: Worker, body: dict[str, Any],
                     request: web.Request) -> web.StreamResponse:
        tries = DecodeAttempts(self.engine, f, worker, body)
        # The hop runs in its own task, which outlives the handler aiohttp cancels.
        task = self.tracker.spawn(self._hops(f, tries))
        f.decode_started(task)
        if not await self.aborts.hop_or_abandon(f, task):
            return await self.aborts.respond_aborted(request, f, done=False)
        try:
            reply, raw = await asyncio.shield(task)
        except UpstreamError as e:
            self.cleanup.after_decode_error(f, e)
            self.core.set_done(f)
            raise
        return self._reply(f, worker, reply, raw)

    async def _hops(self, f: Flight, tries: DecodeAttempts) -> tuple[dict[str, Any], bytes]:
        """The decode hop, retried as ``tries`` allows; D's reply, parsed and as its bytes."""
        try:
            while True:
                w = tries.worker
                outcome = Outcome.NEUTRAL
                try:
                    answer: tuple[dict[str, Any], bytes] = await self.core.call(
                        w, self.upstream.post_generate_raw(
                            "decode", w.url, tries.body, request_id=f.record.base_id,
                            total=self.engine.limit(f)), f.trace.hop("decode", w))
                    outcome = Outcome.SUCCESS
                    tries.answered()
                    return answer
                except UpstreamError as e:
                    passthrough = isinstance(e, UpstreamStatusError) and e.passthrough
                    outcome = tries.failed(e, Outcome.NEUTRAL if passthrough else Outcome.FAILURE)
                    error = e
                finally:
                    self.decode_pool.release(w, outcome, f.ctx.tokens)
                if not await tries.next(error):
                    raise error
        finally:
            f.settled.set()

    def _reply(self, f: Flight, worker: Worker, reply: dict[str, Any], raw: bytes) -> web.StreamResponse:
        """D's bytes go to the client with what only P knows spliced in; then the lease ends (pulled)."""
        f.timing.first_token = self.clock()
        if reply.get("output_mode") != f.request.output_mode:
            self._answered(f)
            self.metrics.child(self.metrics.upstream_errors, worker.pool, worker.url, "protocol").inc()
            raise UpstreamProtocolError(
                "decode", worker.url,
                f"answered output_mode {reply.get('output_mode')!r} for a {f.request.output_mode!r} "
                "request (a server that predates output_mode?)")
        self.core.note_usage(f, reply.get("usage"))  # D's own usage, before P's is merged in
        raw = self.merge_prefill_info(f, reply, raw)
        if f.rewrite is not None:
            raw = f.rewrite.apply(raw)
        now = self.clock()
        headers = dict(f.headers)
        headers["Server-Timing"] = f.timing.header(now)
        response = web.Response(body=raw, content_type="application/json", headers=headers)
        self._answered(f)
        if f.completion_tokens and f.request.sampling_params.n == 1 and f.timing.first_token is not None \
                and f.timing.decode_start is not None:
            # Non-stream: the decode hop (KV pull and first token included) per output token.
            self.metrics.tpot.observe((f.timing.first_token - f.timing.decode_start) / f.completion_tokens)
        self.metrics.ttft.observe(now - f.timing.received)
        return response

    def _answered(self, f: Flight) -> None:
        first_token = f.timing.first_token or 0.0
        self.core.close_lease(f, "aborted" if f.record.is_aborted else "pulled")
        self.core.set_done(f)
        self.metrics.stages["decode_first_token"].observe(
            first_token - (f.timing.decode_start or 0))

    def merge_prefill_info(self, f: Flight, reply: dict[str, Any], raw: bytes) -> bytes:
        """Put what only the prefill hop knows into D's reply; returns D's own bytes when nothing changed."""
        prefill_reply = f.prefill_task.result() if f.prefill_task is not None and \
            f.prefill_task.done() and not f.prefill_task.cancelled() and \
            f.prefill_task.exception() is None else None
        if prefill_reply is None or "X-PD-Decode-Only" in f.headers:
            return raw
        changed = False
        if f.request.sampling_params.get("prompt_logprobs") is not None:
            changed = True
            reply["prompt_logprobs"] = prefill_reply.get("prompt_logprobs")
            if prefill_reply.get("prompt_token_id_logprobs") is not None:
                reply["prompt_token_id_logprobs"] = prefill_reply["prompt_token_id_logprobs"]
        usage = reply.get("usage")
        if self.settings.report_cached_tokens and isinstance(usage, dict) and \
                usage.get("prompt_tokens_details") is None:
            p_usage = prefill_reply.get("usage")
            details = p_usage.get("prompt_tokens_details") if isinstance(p_usage, dict) else None
            if details is None:
                p_params = prefill_reply.get("kv_transfer_params")
                cached = p_params.get("remote_prefill_cached_tokens") if isinstance(p_params, dict) else None
                if isinstance(cached, int) and cached > 0:
                    details = {"cached_tokens": cached}
            if details is not None:
                d_null = "prompt_tokens_details" in usage  # D wrote it as null (absent: no splice)
                usage["prompt_tokens_details"] = details
                if not changed and d_null:
                    spliced = splice_null_key(raw, "prompt_tokens_details", details)
                    if spliced is not None:
                        return spliced  # D's bytes with one value put in: not written again
                changed = True
        return compact_json(reply) if changed else raw

