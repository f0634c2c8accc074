"""The prefill worker's first token streamed at once (``first_token_from_prefill``): the client's
stream opens with P's chunk before the hand-off, then D's stream without token 1, or the end when
P's token ends the request. After P's chunk every failure ends in-band."""

from __future__ import annotations

import logging
from typing import Any

from aiohttp import web

from proxy.pools import migration_blocker
from proxy.sse.first_token import (
    NotBuildable,
    ends_at_first_token,
    first_chunk,
    seed_for,
    usage_event,
)
from proxy.sse.first_token_filter import FirstTokenFilter
from proxy.sse.relay import event_stream, write_bounded
from proxy.walk.aborts import abort_events, end_stream
from proxy.walk.cleanup import Cleanup
from proxy.walk.core import Core, Part
from proxy.walk.flight import Flight, PrefillFirst
from proxy.wire.errors import ProxyError

log = logging.getLogger("pd_proxy")


class FirstStream(Part):
    def __init__(self, core: Core, cleanup: Cleanup) -> None:
        super().__init__(core)
        self.cleanup = cleanup

    def arm(self, f: Flight) -> None:
        """Whether this request gets P's token first; a random request gets one seed for every hop."""
        s, req = self.settings, f.request
        if not s.first_token_from_prefill or not req.is_stream:
            return
        sp = f.data["sampling_params"]
        if s.prefill_tokens_only and (req.output_mode != "tokens" or sp.get("stop")):
            return  # P cannot detokenize: its token 1 cannot be checked against stop strings
        f.first_token = True
        seed = seed_for(sp)
        if seed is not None:
            f.data["sampling_params"] = {**sp, "seed": seed}

    def build(self, f: Flight, reply: dict[str, Any]) -> None:
        """P's reply into the client's first chunk (``f.first``); None when it cannot be built exactly."""
        req = f.request
        sp = f.data["sampling_params"]
        rid = reply.get("request_id")
        opts = f.data.get("stream_options")
        continuous = bool(req.include_usage and isinstance(opts, dict) and opts.get("continuous_usage_stats"))
        try:
            if not isinstance(rid, str):
                raise NotBuildable("the prefill reply has no request_id")
            # At the model length D would end the stream at token 1 too, in one chunk.
            final = ends_at_first_token(reply, sp) or self.pools.one_token_left(len(req.token_ids))
            events, shown = first_chunk(reply, request_id=rid, output_mode=req.output_mode,
                                        sampling_params=sp, final=final, continuous_usage=continuous)
        except NotBuildable as e:
            log.debug("request %s: first token not sent from prefill: %s", f.record.engine_id, e)
            return
        if not final and any(t.text == "" for t in shown) and self.pools.settings.migrate \
                and migration_blocker(f.data) is None:
            # No text for token 1 yet: a continuation would rewind over it; D's stream as it is.
            return
        usage = b""
        if final and req.include_usage:
            u = reply.get("usage")
            prompt_tokens = u.get("prompt_tokens") if isinstance(u, dict) else None
            if not isinstance(prompt_tokens, int):
                return
            usage = usage_event(request_id=rid, output_mode=req.output_mode, prompt_tokens=prompt_tokens,
                                completion_tokens=len(shown),
                                prompt_tokens_details=u.get("prompt_tokens_details") if isinstance(u, dict)
                                else None)
        f.first = PrefillFirst(events, shown, final, usage)
        if not final:
            f.first_filter = FirstTokenFilter(shown)

    async def start(self, request: web.Request, f: Flight) -> web.StreamResponse:
        assert f.first is not None
        resp = event_stream(request, f.headers, headers_with_first_write=True)
        await resp.prepare(request)
        data = f.first.events
        if f.first.final:
            data += f.first.usage
        await write_bounded(request, resp, f.rewrite.apply(data) if f.rewrite is not None else data,
                            self.settings.slow_reader_timeout)
        now = f.first.written_at = f.timing.first_write = self.clock()
        self.metrics.ttft.observe(now - f.timing.received)
        return resp

    async def finish_at_prefill(self, request: web.Request, f: Flight,
                                resp: web.StreamResponse) -> web.StreamResponse:
        """P's token ended the request: end the stream and free P's KV (no decode hop)."""
        await self.cleanup.release_shielded(f)
        self.core.set_done(f)
        await end_stream(request, resp, f, self.clock(), b"")
        return resp

    async def end_aborted(self, request: web.Request, f: Flight,
                          resp: web.StreamResponse) -> web.StreamResponse:
        """Aborted after the client had P's token: its stream ends as vLLM ends an aborted one."""
        self.core.set_done(f)
        await end_stream(request, resp, f, self.clock(), abort_events(f))
        return resp

    async def end_with_error(self, request: web.Request, f: Flight, resp: web.StreamResponse,
                             e: ProxyError) -> web.StreamResponse:
        self.core.set_done(f)
        log.warning("request %s: stream ended with an error: %s", f.record.engine_id, e.message)
        await end_stream(request, resp, f, self.clock(), e.sse_event())
        return resp


__all__ = ["FirstStream"]
