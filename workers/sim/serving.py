"""``POST /inference/v1/generate`` and the abort endpoints, as vLLM 0.32 serves them."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
import secrets
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
from aiohttp import web

from .engine import Inflight, Lease, TokenCadence
from .errors import (
    BadRequest,
    Forbidden,
    InjectedFailure,
    InternalError,
    RequestValidation,
    SimError,
)
from .model import choice_seed, fold_all
from .protocol import (
    GenerateRequest,
    parse_generate_request,
    unsupported_media_type,
    usage_body,
    vllm_error,
)
from .sequence import SeqConfig, Sequence, prompt_logprobs
from .state import DUMPS, SIM, SimState, json_response, read_json, request_id_header, side_channel_url

log = logging.getLogger("pd_sim")

_KV_BYTES_PER_TOKEN = 4096
_YIELD_EVERY = 16
_DISABLED = "Scale-out endpoints are disabled. Restart vllm serve with --enable-scale-out to enable them."


class _Run:
    """One generate call from validation to the last byte."""

    def __init__(self, request: web.Request, st: SimState, req: GenerateRequest, request_id: str) -> None:
        self.request = request
        self.st = st
        self.req = req
        self.sp = req.sampling_params
        self.request_id = request_id
        self.settings = st.settings
        self.prompt = req.token_ids
        self.stream = bool(req.stream)
        opts = req.stream_options
        self.include_usage = bool(opts and opts.include_usage)
        self.continuous_usage = self.include_usage and bool(opts and opts.continuous_usage_stats)
        kv = req.engine_kv_transfer_params() or {}
        role = self.settings.role
        self.kv_producer = role == "prefill" and bool(kv.get("do_remote_decode"))
        self.kv_consumer = role == "decode" and bool(kv.get("do_remote_prefill"))
        self.remote = kv if self.kv_consumer else None
        self.inflight = Inflight(request_id, len(self.prompt))
        self.acquired = False
        self.pulled = False
        self.freed_remote = False
        self.lease: Lease | None = None
        self.cached_tokens = 0
        self.recomputed = False
        """The pull failed and this decode worker computed the prompt itself (``recompute_failed_pulls``)."""
        self.created = int(time.time())
        self.max_tokens = 0
        self.text_mode = req.output_mode == "text"
        self.choices: list[Sequence] = []
        self.seed = 0
        self.pending_prompt_ids = False
        self.resp: web.StreamResponse | None = None
        self.t_arrival = st.clock.now()
        self.t_first: float | None = None

    # -- validation (vLLM's order of checks) --------------------------------------------------

    def validate(self) -> None:
        s = self.settings
        sp = self.sp
        if sp.n > s.max_num_seqs:
            raise BadRequest(
                f"sampling_params.n must be at most the server's max_num_seqs ({s.max_num_seqs}), got {sp.n}."
            )
        if self.stream and sp.prompt_logprob_token_ids is not None:
            raise BadRequest("prompt_logprob_token_ids are not available when stream=true.")
        if s.tokens_only and sp.stop_strings():
            raise BadRequest(
                "stop strings are not supported on a --tokens-only server because detokenization "
                "is disabled. Check stop strings on the coordinator, or use stop_token_ids."
            )
        if self.req.output_mode != "tokens" and not s.has_tokenizer:
            raise BadRequest(
                f"output_mode={self.req.output_mode!r} requires a tokenizer, but this server does not "
                "load one (--tokens-only or --skip-tokenizer-init). Send the request to a server that "
                "loads a tokenizer, or use output_mode='tokens'."
            )
        for name, kind, value in (
            ("logprobs", "sample", sp.logprobs),
            ("prompt_logprobs", "prompt", sp.prompt_logprobs),
        ):
            count = s.vocab_size if value == -1 else value
            if count and count > s.max_logprobs:
                raise vllm_error(
                    f"Requested {kind} logprobs of {count}, which is greater than max allowed: "
                    f"{s.max_logprobs}",
                    name,
                    count,
                )
        if sp.prompt_logprob_token_ids is not None:
            raise vllm_error(
                "prompt_logprob_token_ids requires the V2 model runner (VLLM_USE_V2_MODEL_RUNNER=1).",
                "prompt_logprob_token_ids",
            )
        for t in self.prompt:
            if t >= s.vocab_size:
                raise BadRequest(f"Token id {t} is out of vocabulary")
        if len(self.prompt) > s.max_model_len:
            raise BadRequest(
                f"The decoder prompt (length {len(self.prompt)}) is longer than the maximum model length of "
                f"{s.max_model_len}. Make sure that `max_model_len` is no smaller than the number of "
                "text tokens."
            )
        if len(self.prompt) == s.max_model_len:
            raise BadRequest(
                f"The decoder prompt (length {len(self.prompt)}) plus the number of requested output tokens "
                f"(at least 1) is longer than the maximum model length of {s.max_model_len}. Make sure "
                "that `max_model_len` is no smaller than the number of text tokens (prompt + requested "
                "output tokens)."
            )
        room = s.max_model_len - len(self.prompt)
        # The server fills an omitted max_tokens from the model length, and caps one that does not fit.
        max_tokens = room if sp.max_tokens is None else min(sp.max_tokens, room)
        self.max_tokens = max_tokens
        cfg = SeqConfig.build(
            sp,
            vocab_size=s.vocab_size,
            max_tokens=self.max_tokens,
            tokenizer=self.st.tokenizer,
            text_mode=self.text_mode,
            prompt=self.prompt,
            token_id_placeholders=s.return_tokens_as_token_ids,
            first_differs=self.kv_consumer and self.st.faults.first_token_mismatch,
        )
        seed = 0 if sp.temperature < 1e-05 else sp.seed if sp.seed is not None else random.getrandbits(63)
        self.seed = seed
        h = fold_all(self.prompt)
        self.choices = [Sequence(i, choice_seed(seed, i), h, cfg) for i in range(sp.n)]

    # -- the response ---------------------------------------------------------------------------

    def _headers(self) -> dict[str, str] | None:
        return request_id_header(self.request)

    async def run(self) -> web.StreamResponse:
        st = self.st
        faults = st.faults
        st.generate_calls += 1
        if (
            faults.exit_after_requests is not None
            and st.generate_calls > faults.exit_after_requests
            and self.settings.allow_exit
        ):
            log.warning("pd-sim: exit fault after %d generate requests", faults.exit_after_requests)
            os._exit(3)  # a crash: no clean-up, open connections are reset
        if faults.fail_next > 0:
            faults.fail_next -= 1
            raise InjectedFailure(faults.fail_status)
        if faults.hang_before_headers:
            st.hung += 1
            try:
                await asyncio.Event().wait()  # until the client gives up (handler cancellation)
            finally:
                st.hung -= 1
        st.registry.add(self.inflight)
        try:
            if self.stream:
                return await self._run_stream()
            return await self._run_full()
        except asyncio.CancelledError:
            # Client disconnect (handler cancellation): vLLM aborts the request in the engine.
            self.inflight.abort()
            raise
        finally:
            self._cleanup()

    def _cleanup(self) -> None:
        st = self.st
        st.registry.remove(self.inflight)
        if self.remote is not None and not self.pulled and not self.freed_remote:
            self._free_remote()
        if self.inflight.blocks:
            st.pool.free(self.inflight.blocks)
            self.inflight.blocks = []
        if self.acquired:
            self.acquired = False
            st.scheduler.release()

    def _free_remote(self) -> None:
        """D aborted before pulling: tell P to free its blocks at once."""
        self.freed_remote = True
        remote = self.remote
        if remote is None:
            return
        url = side_channel_url(remote, "free")
        rrid = remote.get("remote_request_id")
        if url is None or not isinstance(rrid, str):
            return
        st = self.st

        async def notify() -> None:
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, OSError):
                async with st.client_session().post(url, json={"remote_request_id": rrid}) as r:
                    await r.read()

        st.spawn(notify())

    async def _schedule(self) -> bool:
        """Wait for a running slot, take the KV blocks, pull remote KV, prefill. False if aborted."""
        st = self.st
        s = self.settings
        inflight = self.inflight
        clock = st.clock
        t0 = clock.now()
        needed = st.pool.blocks_needed(len(self.prompt))
        heartbeat = None
        queued = st.scheduler.would_wait(needed)
        if self.remote is not None and queued:
            heartbeat = asyncio.ensure_future(self._heartbeat())
        try:
            granted = await st.scheduler.acquire(inflight, needed)
        finally:
            if heartbeat is not None:
                heartbeat.cancel()
        if not granted:
            return False
        self.acquired = True
        if inflight.aborted:
            return False
        st.metrics.queue_time.observe(clock.now() - t0)
        inflight.state = "prefilling"
        t_prefill = clock.now()
        # Nothing queued ahead: the engine starts on the request as it arrives, the frontend's work
        # (a stream's headers) runs beside it (vLLM's API server and engine core are two processes).
        t_start = t_prefill if queued else self.t_arrival
        alloc = st.pool.allocate_prompt(self.prompt, self.req.cache_salt)
        if alloc is not None:
            inflight.blocks, self.cached_tokens = alloc
        st.metrics.prefix_queries.inc(len(self.prompt))
        st.metrics.prefix_hits.inc(self.cached_tokens)
        if self.remote is not None:
            inflight.state = "pulling"
            try:
                ok = await self._pull()
            except _KvLoadFailed:
                if not st.faults.recompute_failed_pulls:
                    raise
                self.recomputed = True  # vLLM's kv_load_failure_policy "recompute": silently
                ok = not inflight.aborted
            if not ok:
                return False
        if not s.zero_latency:
            delay = self.prefill_delay()
            start = clock.now() if self.remote is not None else t_start  # a tail starts after the pull
            if delay > 0 and not await clock.sleep_until_exact(inflight, start + delay):
                return False
        st.metrics.prompt_tokens.inc(len(self.prompt))
        self._count_sources()
        st.metrics.prefill_time.observe(clock.now() - t_prefill)
        inflight.state = "decoding"
        return True

    def _count_sources(self) -> None:
        """``vllm:prompt_tokens_by_source_total`` as vLLM 0.32 counts a prompt: local prefix-cache
        hits first, then the tokens the pull promised (counted before it runs, so a failed pull
        recomputed here counts as pulled too), the rest computed here. A fully pulled prompt
        computes nothing (the last token vLLM recomputes to sample from counts as cached)."""
        n = len(self.prompt)
        hit = min(self.cached_tokens, n)
        external = 0
        if self.remote is not None:
            external = max(0, self._covered() - hit)
        by_source = self.st.metrics.prompt_tokens_by_source
        by_source["local_cache_hit"].inc(hit)
        by_source["external_kv_transfer"].inc(external)
        by_source["local_compute"].inc(n - hit - external)

    def _covered(self) -> int:
        """Prompt tokens the pulled blocks cover."""
        remote = self.remote or {}
        groups = remote.get("remote_block_ids")
        nblocks = sum(len(g) for g in groups if isinstance(g, list)) if isinstance(groups, list) else 0
        covered = min(len(self.prompt), nblocks * self.settings.block_size)
        num_tokens = remote.get("remote_num_tokens")
        if isinstance(num_tokens, int) and not isinstance(num_tokens, bool):
            covered = min(covered, max(num_tokens, 0))
        return covered

    def remote_tail_tokens(self) -> int:
        """Prompt tokens a decode worker computes itself after pulling the KV: those the pulled
        blocks do not cover, at least the last one (vLLM treats pulled tokens as computed, and a
        fully loaded prompt recomputes its last token to sample the next)."""
        return max(len(self.prompt) - self._covered(), 1)

    def prefill_delay(self) -> float:
        """Seconds of compute before the first token (the queue and, for a decode worker, the
        pull itself come on top). A prefill: ``--prefill-base-ms`` + per uncached prompt token.
        A decode worker whose KV was pulled: no prefill, ``--remote-prefill-step-ms`` + per token
        of the tail the blocks did not cover."""
        s = self.settings
        if self.remote is not None and not self.recomputed:
            ms = s.remote_prefill_step_ms + s.prefill_per_token_ms * self.remote_tail_tokens()
        else:
            ms = s.prefill_base_ms + s.prefill_per_token_ms * (len(self.prompt) - self.cached_tokens)
        return ms / 1000.0

    async def _heartbeat(self) -> None:
        """While queued, keep the prefill side's lease alive (as vLLM's queued decode requests do)."""
        remote = self.remote
        url = side_channel_url(remote, "heartbeat") if remote is not None else None
        if url is None or remote is None:
            return
        body = {"remote_request_id": remote.get("remote_request_id")}
        while True:
            await asyncio.sleep(self.settings.kv_heartbeat_s)
            with contextlib.suppress(aiohttp.ClientError, TimeoutError, OSError):
                async with self.st.client_session().post(url, json=body) as r:
                    await r.read()

    async def _pull(self) -> bool:
        """Pull the prompt's KV from the prefill worker's side channel."""
        st = self.st
        remote = self.remote
        assert remote is not None
        url = side_channel_url(remote, "pull")
        t0 = st.clock.now()
        nblocks = sum(len(g) for g in remote.get("remote_block_ids") or [] if isinstance(g, list))
        ok = False
        if url is not None:
            body = {
                "remote_request_id": remote.get("remote_request_id"),
                "remote_engine_id": remote.get("remote_engine_id"),
                "remote_block_ids": remote.get("remote_block_ids"),
                "remote_num_tokens": remote.get("remote_num_tokens"),
            }
            task = asyncio.ensure_future(self._post_pull(url, body))

            def cancel_pull() -> None:
                task.cancel()

            self.inflight.on_abort.append(cancel_pull)
            try:
                ok = await task
            except asyncio.CancelledError:
                if not self.inflight.aborted:
                    raise
                return False
            finally:
                with contextlib.suppress(ValueError):
                    self.inflight.on_abort.remove(cancel_pull)
        if not ok:
            st.metrics.failed_transfers.inc()
            self.pulled = True  # nothing left to free remotely: the pull itself failed
            raise _KvLoadFailed
        self.pulled = True
        st.metrics.xfer_time.observe(st.clock.now() - t0)
        st.metrics.xfer_bytes.observe(nblocks * self.settings.block_size * _KV_BYTES_PER_TOKEN)
        return not self.inflight.aborted

    async def _post_pull(self, url: str, body: dict[str, Any]) -> bool:
        try:
            async with self.st.client_session().post(url, json=body) as r:
                await r.read()
                return r.status == 200
        except (TimeoutError, aiohttp.ClientError, OSError):
            return False

    def _itl(self) -> float:
        s = self.settings
        if s.zero_latency:
            return 0.0
        running = max(self.st.scheduler.running - 1, 0)
        d = s.itl_ms * (1.0 + s.slowdown_per_running * running)
        if s.itl_jitter_ms > 0:
            d += random.uniform(0.0, s.itl_jitter_ms)
        return d / 1000.0

    def _client_gone(self) -> bool:
        transport = self.request.transport
        return transport is None or transport.is_closing()

    async def _generate(self, emit: Callable[[Sequence], Awaitable[bool]] | None) -> None:
        """The decode loop; ``emit`` (streams) writes each step's chunk, False when the client left."""
        st = self.st
        inflight = self.inflight
        faults = st.faults
        clock = st.clock
        cadence = TokenCadence()
        block_size = self.settings.block_size
        n_total = 0
        active = [c for c in self.choices if c.finish_reason is None]
        while active:
            extra = faults.chunk_delay_ms / 1000.0 if faults.chunk_delay_ms > 0 else 0.0
            if n_total:
                interval = self._itl() + extra
                if interval > 0:
                    if not await clock.sleep_until(inflight, cadence.next(interval, clock.now)):
                        break
                else:
                    cadence.due = None  # not paced: a later delay starts a new schedule
                if n_total % _YIELD_EVERY == _YIELD_EVERY - 1:
                    await asyncio.sleep(0)  # also when catching up on a late schedule
            elif extra > 0 and not await clock.sleep_until(inflight, clock.now() + extra):
                break
            if inflight.aborted:
                break
            if emit is None and self._client_gone():
                inflight.abort()
                break
            for c in active:
                c.step()
                inflight.num_output += 1
                n_total += 1
                if self.t_first is None:
                    self.t_first = clock.now()
                    cadence.start(self.t_first)
                    st.metrics.ttft.observe(self.t_first - self.t_arrival)
                if inflight.num_output % block_size == 0:
                    b = st.pool.allocate_one()
                    if b is not None:
                        inflight.blocks.append(b)
                if emit is not None:
                    if faults.reset_after_tokens is not None and n_total > faults.reset_after_tokens:
                        raise _ResetConnection
                    if faults.error_after_tokens is not None and n_total > faults.error_after_tokens:
                        raise _InBandError
                    if not await emit(c):
                        inflight.abort()
                        return
            active = [c for c in active if c.finish_reason is None]

    def _finish(self) -> None:
        """Mark unfinished choices aborted; account the request."""
        st = self.st
        aborted = self.inflight.aborted
        for c in self.choices:
            if c.finish_reason is None:
                c.finish_reason = "abort" if aborted else "length"
        generated = sum(len(c.tokens) for c in self.choices)
        st.metrics.generation_tokens.inc(generated)
        now = st.clock.now()
        if not aborted:
            for c in self.choices:
                st.metrics.success[str(c.finish_reason)].inc()
            st.metrics.e2e.observe(now - self.t_arrival)
            if self.t_first is not None:
                st.metrics.decode_time.observe(now - self.t_first)
                if generated > 1:
                    st.metrics.itl.observe((now - self.t_first) / (generated - 1))

    def _kv_params(self, host: str, port: int) -> dict[str, Any] | None:
        """Hand the prompt's blocks to a lease and describe them (prefill role only)."""
        if not self.kv_producer or self.inflight.aborted:
            return None
        st = self.st
        s = self.settings
        num_prompt_blocks = st.pool.blocks_needed(len(self.prompt))
        blocks = self.inflight.blocks
        held, rest = blocks[:num_prompt_blocks], blocks[num_prompt_blocks:]
        st.pool.free(rest)
        self.inflight.blocks = []
        remote_request_id = f"{self.request_id}-{secrets.token_hex(4)}"
        self.lease = st.leases.hold(
            remote_request_id, self.request_id, held, len(self.prompt), s.lease_seconds
        )
        if self.stream or st.faults.drop_kv_params:
            return None
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [held],
            "remote_engine_id": st.engine_id,
            "remote_request_id": remote_request_id,
            "remote_host": s.kv_host or host,
            "remote_port": s.kv_port or port,
            "tp_size": 1,
            "dcp_size": 1,
            "pp_size": 1,
            "remote_num_tokens": len(self.prompt),
            "remote_blocks_expiry_time": None,
            "transfer_mode": "pull",
            "remote_prefill_cached_tokens": self.cached_tokens,
        }

    def _local_address(self) -> tuple[str, int]:
        transport = self.request.transport
        sock = transport.get_extra_info("sockname") if transport is not None else None
        if isinstance(sock, tuple) and len(sock) >= 2:
            return str(sock[0]), int(sock[1])
        return "127.0.0.1", 0

    @staticmethod
    def _weight_versions(c: Sequence) -> list[dict[str, Any]]:
        return [{"version": "default", "start": 0, "end": len(c.tokens)}]

    async def _run_full(self) -> web.StreamResponse:
        host, port = self._local_address()
        try:
            if await self._schedule():
                await self._generate(None)
        except _KvLoadFailed:
            raise InternalError() from None
        self._finish()
        if self.st.faults.hang_after_headers:
            # A non-stream response has no "after headers"; hang before answering instead.
            await asyncio.Event().wait()
        kv_params = self._kv_params(host, port)
        n_prompt = len(self.prompt)
        n_out = sum(len(c.tokens) for c in self.choices)
        sp = self.sp
        p_logprobs = None
        if sp.prompt_logprobs is not None:
            p_logprobs = prompt_logprobs(
                self.prompt,
                sp.prompt_logprobs,
                self.choices[0].salt,
                self.settings.vocab_size,
                self.st.tokenizer,
            )
        choices = []
        for c in self.choices:
            choice: dict[str, Any] = {
                "index": c.index,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
                "token_ids": c.tokens,
                "routed_experts": None,
                "sampling_mask": None,
                "weight_versions": self._weight_versions(c),
            }
            if self.text_mode:
                choice["text"] = c.text
            choice["logprobs"] = c.all_logprobs()
            choices.append(choice)
        body = {
            "request_id": self.request_id,
            "model": self.settings.model_name,
            "created": self.created,
            "usage": {
                "prompt_tokens": n_prompt,
                "total_tokens": n_prompt + n_out,
                "completion_tokens": n_out,
                "prompt_tokens_details": None,
                "completion_tokens_details": None,
            },
            "prompt_logprobs": p_logprobs,
            "prompt_token_id_logprobs": None,
            "prompt_token_ids": list(self.prompt) if self.req.return_token_ids else None,
            "mm_placeholders": None,
            "metrics": None,
            "kv_transfer_params": kv_params,
            "ec_transfer_params": None,
            "output_mode": self.req.output_mode,
            "choices": choices,
        }
        return json_response(body, headers=self._headers())

    def _usage(self, n_out: int, details: bool) -> dict[str, Any]:
        return usage_body(len(self.prompt), n_out, details)

    def _chunk(self, c: Sequence) -> bytes:
        """One SSE event for choice ``c``: its new tokens (and text/logprobs), final if it finished."""
        final = c.finish_reason is not None
        d: dict[str, Any] = {
            "request_id": self.request_id,
            "usage": self._usage(len(c.tokens), True) if self.continuous_usage else None,
        }
        if self.pending_prompt_ids:
            self.pending_prompt_ids = False
            d["prompt_token_ids"] = list(self.prompt)
        d["output_mode"] = self.req.output_mode
        choice: dict[str, Any] = {
            "index": c.index,
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
            "token_ids": c.take_tokens(),
            "routed_experts": None,
            "sampling_mask": None,
            "weight_versions": self._weight_versions(c) if final else None,
        }
        if self.text_mode:
            choice["text"] = c.take_text()
        choice["logprobs"] = c.take_logprobs()
        d["choices"] = [choice]
        return b"data: " + DUMPS(d).encode() + b"\n\n"

    async def _run_stream(self) -> web.StreamResponse:
        host, port = self._local_address()
        resp = web.StreamResponse(headers=self._headers())
        resp.content_type = "text/event-stream"
        resp.charset = "utf-8"
        resp.enable_chunked_encoding()
        await resp.prepare(self.request)
        self.resp = resp
        faults = self.st.faults
        if faults.hang_after_headers:
            await asyncio.Event().wait()
        self.pending_prompt_ids = bool(self.req.return_token_ids)
        rid = DUMPS(self.request_id)
        mode = DUMPS(self.req.output_mode)
        head = f'data: {{"request_id":{rid},"usage":null,"output_mode":{mode},"choices":[{{"index":'.encode()
        mid = b',"finish_reason":null,"stop_reason":null,"token_ids":['
        tail = b'],"routed_experts":null,"sampling_mask":null,"weight_versions":null,"logprobs":null}]}\n\n'
        fast = not self.text_mode and self.sp.logprobs is None and not self.continuous_usage
        write_raw = resp.write

        async def write(data: bytes) -> bool:
            try:
                await write_raw(data)
            except (ConnectionResetError, ConnectionError, RuntimeError):
                return False
            return True

        async def emit(c: Sequence) -> bool:
            if fast and c.finish_reason is None and not self.pending_prompt_ids:
                new = c.tokens[c.sent :]
                c.sent = len(c.tokens)
                data = head + str(c.index).encode() + mid + ",".join(map(str, new)).encode() + tail
            else:
                data = self._chunk(c)
            return await write(data)

        error: SimError | None = None
        try:
            if await self._schedule():
                await self._generate(emit)
        except _KvLoadFailed:
            error = InternalError()
        except _ResetConnection:
            transport = self.request.transport
            if transport is not None:
                transport.abort()
            self.inflight.abort()
            return resp
        except _InBandError:
            error = InternalError()
            self.inflight.abort()
        if error is not None:
            # vLLM writes its in-band error with json.dumps' default separators.
            await write(f"data: {json.dumps(error.body())}\n\n".encode())
            await write(b"data: [DONE]\n\n")
            self._finish()
            return resp
        gone = self.inflight.aborted and self._client_gone()
        unfinished = [c for c in self.choices if c.finish_reason is None]
        self._finish()
        self._kv_params(host, port)
        if gone:
            return resp
        for c in unfinished:  # aborted: one last chunk with finish_reason "abort"
            if not await write(self._chunk(c)):
                return resp
        if self.include_usage:
            final = {
                "request_id": self.request_id,
                "usage": self._usage(sum(len(c.tokens) for c in self.choices), False),
                "output_mode": self.req.output_mode,
                "choices": [],
            }
            if not await write(b"data: " + DUMPS(final).encode() + b"\n\n"):
                return resp
        await write(b"data: [DONE]\n\n")
        with contextlib.suppress(ConnectionError, RuntimeError):
            await resp.write_eof()
        return resp


class _KvLoadFailed(Exception):
    pass


class _ResetConnection(Exception):
    pass


class _InBandError(Exception):
    pass


async def generate(request: web.Request) -> web.StreamResponse:
    st = request.app[SIM]
    if not st.settings.generate_enabled:
        raise Forbidden(_DISABLED)
    content_type = request.headers.get("Content-Type", "").lower().split(";", 1)[0].strip()
    if content_type != "application/json":
        raise unsupported_media_type()
    body = await read_json(request)
    req = parse_generate_request(body)
    base = request.headers.get("X-Request-Id")
    if base is None:
        base = req.request_id if req.request_id is not None else f"{uuid.uuid4().int & ((1 << 64) - 1):016x}"
    run = _Run(request, st, req, f"generate-tokens-{base}")
    traceparent = request.headers.get("traceparent")
    if traceparent is not None:  # recorded for tracing tests (pd-proxy's hops carry one)
        st.traceparents.append((run.request_id, traceparent))
    run.validate()
    return await run.run()


async def abort_requests(request: web.Request) -> web.Response:
    st = request.app[SIM]
    if not st.settings.generate_enabled:
        raise Forbidden(_DISABLED)
    raw = await request.read()
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestValidation(f"JSON decode error: {e}") from None
    if not isinstance(body, dict):
        raise InternalError()
    ids = body.get("request_ids")
    if ids is None:
        raise RequestValidation("Missing 'request_ids' in request body")
    id_list = [ids] if isinstance(ids, str) else list(ids) if isinstance(ids, list) else []
    # vLLM aborts in a background task; the engine has registered every request we know of.
    asyncio.get_running_loop().call_soon(st.registry.abort, id_list)
    return web.Response(status=200, headers=request_id_header(request))
