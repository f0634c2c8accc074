"""The HTTP/SSE timing client: one ``POST /inference/v1/generate`` -> one :class:`RequestRecord`.

Times are ``time.perf_counter()`` readings taken the moment a network read returns, before any
parsing, and stored as seconds since the request was sent: the moment its bytes are handed to
the connection (aiohttp's ``on_request_chunk_sent`` trace, see :func:`new_session`), so that
pd-bench's own work before that (building the request, serializing the body, taking or opening a
connection, a loop tick for the body-writer task) is not charged to the server. A session
without that trace falls back to the moment ``send_request`` began. A "chunk" is one SSE ``data`` event
that carries at least one new output token (``choices[0].token_ids``); chunks without tokens
(the ``include_usage`` chunk, an ``abort`` chunk) count toward nothing but failure checks.

Cancellation (:class:`CancelPlan`): a request is cancelled at a time after it was sent or once a
number of output tokens arrived, by closing its connection (``disconnect``) or through the
target's ``POST /inference/v1/abort_requests`` with the engine id ``generate-tokens-<id>``
(``abort``; the answer is then read to its end, at most ``abort_grace_s``, then the connection is
closed). The two-hop floor (:attr:`ClientOptions.prefill_url`) is the client doing P/D itself: a
prefill hop (non-stream, one token, ``do_remote_decode``) to the prefill worker, then the request
with the returned ``kv_transfer_params`` to the decode worker; a cancel goes to whichever worker
holds the request at that moment, and nothing frees the prefill worker's blocks between the hops.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any, Final

import aiohttp

from benchmarks.datasets import RequestSpec
from benchmarks.records import (
    FAIL_ABORTED,
    FAIL_ERROR_EVENT,
    FAIL_HTTP_STATUS,
    FAIL_INVALID,
    FAIL_NO_DONE,
    FAIL_OUTPUT_MODE,
    FAIL_TIMEOUT,
    FAIL_TRANSPORT,
    RequestRecord,
)
from benchmarks.sse import SSEDecoder

GENERATE_PATH: Final = "/inference/v1/generate"
CHAT_PATH: Final = "/v1/chat/completions"
COMPLETIONS_PATH: Final = "/v1/completions"
OPENAI_PATHS: Final = (CHAT_PATH, COMPLETIONS_PATH)
"""The OpenAI endpoints, with the meaning of vLLM's ``openai-chat`` and ``openai`` bench backends:
text in (a completions prompt as its token ids), ``stream_options.include_usage``, TTFT and ITL
from the events that carry text, output tokens from ``usage.completion_tokens``."""
ABORT_PATH: Final = "/inference/v1/abort_requests"
CANCEL_MODES: Final = ("disconnect", "abort")
PHASE_BEFORE_FIRST_TOKEN: Final = "before_first_token"  # noqa: S105 (a phase name)
PHASE_MID_STREAM: Final = "mid_stream"
ENGINE_ID_PREFIX: Final = "generate-tokens-"
TIMING_REQUEST_HEADER: Final = "X-PD-Timing"
SERVER_TIMING_COMMENT: Final = "server-timing"

_MAX_ERROR_BODY: Final = 2048
KEEPALIVE_S: Final = 4.0
"""Idle connections are dropped before vLLM's own 5 s keep-alive closes them (a reused connection
that the server is closing fails the request)."""


class _SendMark:
    """When a request's bytes were handed to the connection (set by the trace hook)."""

    __slots__ = ("at",)

    def __init__(self) -> None:
        self.at: float | None = None


async def _on_request_chunk_sent(
    session: aiohttp.ClientSession, ctx: Any, params: aiohttp.TraceRequestChunkSentParams
) -> None:
    # Runs just before aiohttp writes the first body chunk (the buffered headers go with it).
    mark = ctx.trace_request_ctx
    if isinstance(mark, _SendMark) and mark.at is None:
        mark.at = time.perf_counter()


def send_trace_config() -> aiohttp.TraceConfig:
    """The trace hook that starts a request's clock at its write (see the module docstring)."""
    config = aiohttp.TraceConfig()
    config.on_request_chunk_sent.append(_on_request_chunk_sent)
    config.freeze()
    return config


def new_session() -> aiohttp.ClientSession:
    """The session of a run: pooled keep-alive connections (no limit; dropped after
    ``KEEPALIVE_S`` idle) and the send-time trace hook."""
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S)
    return aiohttp.ClientSession(connector=connector, trace_configs=[send_trace_config()])


@dataclass(frozen=True, slots=True)
class ClientOptions:
    """How every request of a run is sent."""

    url: str
    api_key: str | None = None
    stream: bool = True
    output_mode: str = "tokens"
    request_timeout_s: float = 300.0
    ask_server_timing: bool = True
    endpoint_path: str = GENERATE_PATH
    headers: tuple[tuple[str, str], ...] = ()
    """Sent with every request (``--header``); pd-bench's own headers override them."""
    ignore_eos: bool = True
    prefill_url: str | None = None
    """The two-hop floor: the client sends the prefill hop here, then the request to ``url``."""
    cache_salt: str | None = None
    """vLLM's ``cache_salt``: requests with different salts share no prefix-cache entries."""


@dataclass(frozen=True, slots=True)
class CancelPlan:
    """When and how one request is cancelled: ``after_s`` seconds after it was sent, or once
    ``after_tokens`` output tokens arrived (whichever comes first). ``before_first_token``: a
    first token that arrives before ``after_s`` cancels the request at once."""

    mode: str = "disconnect"
    after_s: float | None = None
    after_tokens: int | None = None
    before_first_token: bool = False
    abort_grace_s: float = 5.0


def parse_server_timing(value: str) -> dict[str, float]:
    """Parse a ``Server-Timing`` value (``name;dur=ms, name;desc="x";dur=ms``) into name -> ms.

    Entries without a numeric ``dur`` are skipped; a repeated name keeps its first value
    (as the Server-Timing spec says).
    """
    out: dict[str, float] = {}
    for entry in value.split(","):
        parts = [p.strip() for p in entry.split(";")]
        name = parts[0]
        if not name:
            continue
        for param in parts[1:]:
            key, sep, raw = param.partition("=")
            if sep and key.strip().lower() == "dur":
                try:
                    dur = float(raw.strip().strip('"'))
                except ValueError:
                    break
                out.setdefault(name, dur)
                break
    return out


def strip_engine_prefix(request_id: str) -> str:
    return request_id.removeprefix(ENGINE_ID_PREFIX)


def is_openai(opts: ClientOptions) -> bool:
    return opts.endpoint_path in OPENAI_PATHS


def prompt_text(ids: list[int]) -> str:
    """A chat message standing for the prompt ``ids``: one ASCII letter per token id (one token
    each on a byte-level tokenizer such as pd-sim's; a BPE tokenizer may merge letters)."""
    return "".join(chr(ord("a") + i % 26) for i in ids)


def openai_body(spec: RequestSpec, opts: ClientOptions) -> dict[str, Any]:
    """vLLM's ``openai-chat`` / ``openai`` bench request: greedy, ``max_tokens`` the output length
    (exact with ``ignore_eos``), usage in the stream."""
    body: dict[str, Any] = {}
    if opts.endpoint_path == CHAT_PATH:
        body["messages"] = [{"role": "user", "content": prompt_text(spec.prompt)}]
        body["max_completion_tokens"] = spec.output_len
    else:
        body["prompt"] = spec.prompt
        body["max_tokens"] = spec.output_len
    body.update(temperature=0.0, ignore_eos=opts.ignore_eos, stream=opts.stream)
    if opts.stream:
        body["stream_options"] = {"include_usage": True}
    if opts.cache_salt:
        body["cache_salt"] = opts.cache_salt
    return body


def build_body(spec: RequestSpec, request_id: str, opts: ClientOptions) -> dict[str, Any]:
    """The generate request for ``spec``: greedy, tokens in, ``max_tokens`` the output length
    (exact with ``ignore_eos``); on an OpenAI endpoint, :func:`openai_body`."""
    if is_openai(opts):
        return openai_body(spec, opts)
    return {
        "request_id": request_id,
        "token_ids": spec.prompt,
        "sampling_params": {
            "max_tokens": spec.output_len,
            "temperature": 0.0,
            "ignore_eos": opts.ignore_eos,
        },
        "stream": opts.stream,
        "output_mode": opts.output_mode,
    } | ({"cache_salt": opts.cache_salt} if opts.cache_salt else {})


def prefill_hop_body(body: dict[str, Any]) -> dict[str, Any]:
    """The floor's prefill hop: non-stream, one token, no ``min_tokens`` nor ``stream_options``,
    tokens mode, remote decode (vLLM's P/D recipe, docs/vllm.md, section 3, item 1; a proxy sends the
    same)."""
    sampling = {k: v for k, v in body["sampling_params"].items() if k != "min_tokens"}
    sampling["max_tokens"] = 1
    hop = {k: v for k, v in body.items() if k != "stream_options"}
    hop.update(
        sampling_params=sampling,
        stream=False,
        output_mode="tokens",
        kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False},
    )
    return hop


def build_headers(request_id: str, opts: ClientOptions) -> dict[str, str]:
    headers = dict(opts.headers)
    headers["X-Request-Id"] = request_id
    if opts.api_key:
        headers["Authorization"] = f"Bearer {opts.api_key}"
    if opts.ask_server_timing:
        headers[TIMING_REQUEST_HEADER] = "1"
    return headers


def endpoint(url: str, path: str = GENERATE_PATH) -> str:
    """Accept a base URL (``http://h:p``) or the full generate URL."""
    url = url.rstrip("/")
    return url if url.endswith(path) else url + path


def base_url(url: str, path: str = GENERATE_PATH) -> str:
    """``http://h:p`` of a base or full generate URL."""
    url = url.rstrip("/")
    return url[: -len(path)] if url.endswith(path) else url



class _Cancel:
    """One request's cancellation: the plan, whether it fired, and the abort call it made."""

    __slots__ = ("_abort_task", "_handle", "fired", "holder", "plan", "record", "scope", "session",
                 "start", "stop_reading")

    def __init__(self, plan: CancelPlan, session: aiohttp.ClientSession, record: RequestRecord) -> None:
        self.plan = plan
        self.session = session
        self.record = record
        self.fired = False
        self.stop_reading = False
        self.holder: tuple[str, ClientOptions] | None = None  # where an abort goes now
        self.scope: asyncio.Timeout | None = None
        self.start = 0.0
        self._handle: asyncio.TimerHandle | None = None
        self._abort_task: asyncio.Task[None] | None = None

    def arm(self, scope: asyncio.Timeout, start: float) -> None:
        """Schedule the time-based cancel ``after_s`` after ``start`` (a perf_counter reading)."""
        self.scope = scope
        self.start = start
        if self.plan.after_s is None:
            return
        loop = asyncio.get_running_loop()
        when = loop.time() + max(0.0, start + self.plan.after_s - time.perf_counter())
        if self.plan.mode == "disconnect":
            scope.reschedule(when)  # the scope cancels whatever is awaited then: the connection closes
        else:
            self._handle = loop.call_at(when, self.fire)

    def on_tokens(self) -> None:
        """After a token-bearing event: a cancel due at this token count (or at the first token)."""
        if self.fired:
            return
        due = self.plan.after_tokens is not None and self.record.output_tokens >= self.plan.after_tokens
        if due or (self.plan.before_first_token and self.record.ttft_s is not None):
            self.fire()

    def fire(self) -> None:
        if self.fired:
            return
        self.fired = True
        rec = self.record
        rec.cancelled = True
        rec.cancel_mode = self.plan.mode
        rec.cancel_s = time.perf_counter() - self.start
        rec.cancel_phase = PHASE_BEFORE_FIRST_TOKEN if rec.ttft_s is None else PHASE_MID_STREAM
        rec.tokens_at_cancel = rec.output_tokens
        if self.plan.mode == "disconnect":
            self.stop_reading = True  # a token-driven cancel: the reader hangs up
            return
        if self.holder is not None:
            url, opts = self.holder
            self._abort_task = asyncio.create_task(self._abort(url, opts))
        if self.scope is not None:  # the target has this long to end the answer, then we hang up
            self.scope.reschedule(asyncio.get_running_loop().time() + self.plan.abort_grace_s)

    async def _abort(self, url: str, opts: ClientOptions) -> None:
        body = {"request_ids": [ENGINE_ID_PREFIX + self.record.request_id]}
        headers = dict(opts.headers)
        if opts.api_key:
            headers["Authorization"] = f"Bearer {opts.api_key}"
        try:
            async with self.session.post(
                endpoint(url, ABORT_PATH), json=body, headers=headers,
                timeout=aiohttp.ClientTimeout(total=self.plan.abort_grace_s),
            ) as resp:
                await resp.read()
                self.record.abort_status = resp.status
        except (aiohttp.ClientError, TimeoutError):
            self.record.abort_status = None

    async def finish(self) -> None:
        """Let the abort call complete (it is bounded by the grace time) and drop the timer."""
        if self._handle is not None:
            self._handle.cancel()
        if self._abort_task is not None:
            await asyncio.shield(self._abort_task)


async def send_request(
    session: aiohttp.ClientSession,
    opts: ClientOptions,
    spec: RequestSpec,
    record: RequestRecord,
    t0: float,
    *,
    cancel: CancelPlan | None = None,
) -> RequestRecord:
    """Send one request and fill ``record``. Never raises except ``CancelledError``.

    Cancelling the task closes the connection, which makes vLLM (and pd-proxy) abort the request.
    With a :class:`CancelPlan` the request is cancelled as planned (``record.cancelled``).
    """
    body = build_body(spec, record.request_id, opts)
    headers = build_headers(record.request_id, opts)
    start = time.perf_counter()
    record.start_s = start - t0
    canceller = _Cancel(cancel, session, record) if cancel is not None else None
    end: float | None = None
    try:
        async with asyncio.timeout(None) as scope:
            if canceller is not None:
                canceller.arm(scope, start)
            if opts.prefill_url is not None:
                params = await _prefill_hop(
                    session, opts, body=body, headers=headers, record=record, canceller=canceller
                )
                if record.failure is not None or (canceller is not None and canceller.fired):
                    if record.failure is None and canceller is not None and canceller.fired:
                        end = time.perf_counter()  # cancelled during the prefill hop: nothing more
                    params = None
                    raise _Stop
                body = dict(body, kv_transfer_params=params)
            end = await _exchange(
                session, opts, body=body, headers=headers, record=record, t0=t0, canceller=canceller
            )
    except _Stop:
        pass
    except TimeoutError:
        # Our scope expired (aiohttp's own timeouts are handled inside the hops): a time-based
        # disconnect, or an abort the target did not honour within the grace time.
        if canceller is None:
            raise
        canceller.fire()  # a time-based disconnect records itself here (a no-op after an abort)
    finally:
        if canceller is not None:
            await canceller.finish()
    if end is not None and record.e2e_s is None:
        record.e2e_s = end - (t0 + record.start_s)
    if record.cancelled:
        if record.cancel_mode == "abort" and end is not None:
            record.abort_ended_s = end - (t0 + record.start_s)
        record.success = False
        return record
    if record.failure is None and record.finish_reason == "abort":
        record.fail(FAIL_ABORTED, "finish_reason abort")
    record.success = record.failure is None
    return record


class _Stop(Exception):
    """The request ends here (a failed or cancelled prefill hop of the floor)."""


async def _prefill_hop(
    session: aiohttp.ClientSession,
    opts: ClientOptions,
    *,
    body: dict[str, Any],
    headers: dict[str, str],
    record: RequestRecord,
    canceller: _Cancel | None,
) -> dict[str, Any] | None:
    """The floor's first hop; its ``kv_transfer_params`` (None with ``record`` failed)."""
    assert opts.prefill_url is not None
    if canceller is not None:
        canceller.holder = (opts.prefill_url, opts)
    timeout = aiohttp.ClientTimeout(total=opts.request_timeout_s)
    try:
        async with session.post(
            endpoint(opts.prefill_url, opts.endpoint_path), json=prefill_hop_body(body), headers=headers,
            timeout=timeout,
        ) as resp:
            raw = await resp.read()
            if resp.status != 200:
                record.http_status = resp.status
                record.fail(FAIL_HTTP_STATUS, f"prefill hop: HTTP {resp.status}: {_error_message(raw)}")
                return None
    except TimeoutError:
        record.fail(FAIL_TIMEOUT, f"prefill hop: no answer within {opts.request_timeout_s:g} s")
        return None
    except aiohttp.ClientError as exc:
        record.fail(FAIL_TRANSPORT, f"prefill hop: {type(exc).__name__}: {exc}")
        return None
    try:
        obj = json.loads(raw)
    except ValueError:
        record.fail(FAIL_INVALID, "prefill hop: body is not JSON")
        return None
    params = obj.get("kv_transfer_params") if isinstance(obj, dict) else None
    if canceller is not None and canceller.fired:
        return None
    if not isinstance(params, dict):
        record.fail(FAIL_INVALID, "prefill hop: no kv_transfer_params in the answer")
        return None
    return params


async def _exchange(
    session: aiohttp.ClientSession,
    opts: ClientOptions,
    *,
    body: dict[str, Any],
    headers: dict[str, str],
    record: RequestRecord,
    t0: float,
    canceller: _Cancel | None,
) -> float | None:
    """The generate call itself; the moment the answer ended (None: no complete answer)."""
    if canceller is not None:
        canceller.holder = (opts.url, opts)
    timeout = aiohttp.ClientTimeout(total=opts.request_timeout_s)
    mark = _SendMark()
    start = t0 + record.start_s
    end: float | None = None
    try:
        async with session.post(
            endpoint(opts.url, opts.endpoint_path), json=body, headers=headers, timeout=timeout,
            trace_request_ctx=mark,
        ) as resp:
            if mark.at is not None and opts.prefill_url is None:
                # the request was written before any answer could come (the floor's clock runs
                # from its first hop)
                start = mark.at
                record.start_s = start - t0
                if canceller is not None:
                    canceller.start = start
            record.http_status = resp.status
            record.server_request_id = resp.headers.get("X-Request-Id")
            if resp.status != 200:
                raw = await resp.content.read(_MAX_ERROR_BODY)
                record.fail(FAIL_HTTP_STATUS, f"HTTP {resp.status}: {_error_message(raw)}")
                return None
            header_timing = resp.headers.get("Server-Timing")
            if header_timing:
                record.server_timing = parse_server_timing(header_timing)
            if opts.stream:
                end = await _read_stream(resp, opts, record, start, canceller)
            else:
                raw = await resp.read()
                end = time.perf_counter()
                _handle_json(raw, opts, record, start, end)
            if canceller is not None and canceller.stop_reading:
                end = time.perf_counter()
                resp.close()  # hang up: the target sees the client go away
    except TimeoutError:
        record.fail(FAIL_TIMEOUT, f"no complete answer within {opts.request_timeout_s:g} s")
    except aiohttp.ClientError as exc:
        if record.http_status == 200 and opts.stream:
            # The connection broke after a 200 stream had begun: a stream without [DONE].
            record.fail(FAIL_NO_DONE, f"stream cut: {type(exc).__name__}: {exc}")
        else:
            record.fail(FAIL_TRANSPORT, f"{type(exc).__name__}: {exc}")
    if end is not None:
        record.e2e_s = end - start
    return end


async def _read_stream(
    resp: aiohttp.ClientResponse,
    opts: ClientOptions,
    record: RequestRecord,
    start: float,
    canceller: _Cancel | None = None,
) -> float | None:
    ctype = resp.headers.get("Content-Type", "")
    if "text/event-stream" not in ctype:
        raw = await resp.content.read(_MAX_ERROR_BODY)
        record.fail(FAIL_INVALID, f"expected an event stream, got {ctype!r}: {_error_message(raw)}")
        return None
    decoder = SSEDecoder()
    done_at: float | None = None
    async for chunk in resp.content.iter_any():
        now = time.perf_counter()
        for ev in decoder.feed(chunk):
            if ev.comment is not None:
                if ev.comment.startswith(SERVER_TIMING_COMMENT):
                    record.server_timing = parse_server_timing(ev.comment[len(SERVER_TIMING_COMMENT) :])
                continue
            if done_at is not None or ev.data is None:
                continue
            if ev.data.strip() == "[DONE]":
                done_at = now
                continue
            tokens_before = record.output_tokens
            if not _handle_event(ev.data, opts, record, now - start):
                return None
            if canceller is not None and record.output_tokens > tokens_before:
                canceller.on_tokens()
                if canceller.stop_reading:
                    return None
    if done_at is None:
        record.fail(FAIL_NO_DONE, "stream ended without data: [DONE]")
    return done_at


def _handle_event(data: str, opts: ClientOptions, record: RequestRecord, t: float) -> bool:
    """Account one data event; False when it is a failure that ends the read."""
    try:
        obj = json.loads(data)
    except ValueError:
        record.fail(FAIL_INVALID, "event data is not JSON")
        return False
    if not isinstance(obj, dict):
        record.fail(FAIL_INVALID, "event data is not a JSON object")
        return False
    if "error" in obj:
        record.fail(FAIL_ERROR_EVENT, _describe_error(obj["error"]))
        return False
    if is_openai(opts):
        return _handle_openai_event(obj, opts, record, t)
    mode = obj.get("output_mode")
    if mode != opts.output_mode:
        record.fail(FAIL_OUTPUT_MODE, f"asked output_mode {opts.output_mode!r}, echo was {mode!r}")
        return False
    choices = obj.get("choices")
    if not isinstance(choices, list):
        record.fail(FAIL_INVALID, "event without a choices list")
        return False
    for choice in choices:
        if not isinstance(choice, dict) or choice.get("index", 0) != 0:
            continue
        ids = choice.get("token_ids") or []
        n = len(ids) if isinstance(ids, list) else 0
        if n:
            if record.ttft_s is None:
                record.ttft_s = t
            record.chunk_times_s.append(t)
            record.chunk_tokens.append(n)
            record.output_tokens += n
        reason = choice.get("finish_reason")
        if reason is not None:
            record.finish_reason = str(reason)
    return True


def _openai_text(choice: dict[str, Any], opts: ClientOptions) -> str:
    if opts.endpoint_path == CHAT_PATH:
        key = "delta" if opts.stream else "message"
        part = choice.get(key)
        text = part.get("content") if isinstance(part, dict) else None
    else:
        text = choice.get("text")
    return text if isinstance(text, str) else ""


def _usage_tokens(obj: dict[str, Any]) -> int | None:
    usage = obj.get("usage")
    n = usage.get("completion_tokens") if isinstance(usage, dict) else None
    return n if isinstance(n, int) and not isinstance(n, bool) else None


def _handle_openai_event(obj: dict[str, Any], opts: ClientOptions, record: RequestRecord, t: float) -> bool:
    """One OpenAI chunk: an event with text is one chunk (TTFT at the first, ITL between them, as
    vLLM's bench); the count of output tokens is the usage chunk's ``completion_tokens``."""
    choices = obj.get("choices")
    if not isinstance(choices, list):
        record.fail(FAIL_INVALID, "event without a choices list")
        return False
    n = _usage_tokens(obj)
    if n is not None:
        record.output_tokens = n
    for choice in choices:
        if not isinstance(choice, dict) or choice.get("index", 0) != 0:
            continue
        if _openai_text(choice, opts):
            if record.ttft_s is None:
                record.ttft_s = t
            record.chunk_times_s.append(t)
            record.chunk_tokens.append(1)
        reason = choice.get("finish_reason")
        if reason is not None:
            record.finish_reason = str(reason)
    return True


def _handle_json(raw: bytes, opts: ClientOptions, record: RequestRecord, start: float, end: float) -> None:
    try:
        obj = json.loads(raw)
    except ValueError:
        record.fail(FAIL_INVALID, "body is not JSON")
        return
    if not isinstance(obj, dict):
        record.fail(FAIL_INVALID, "body is not a JSON object")
        return
    if "error" in obj:
        record.fail(FAIL_ERROR_EVENT, _describe_error(obj["error"]))
        return
    if is_openai(opts):
        _handle_openai_json(obj, opts, record, start, end)
        return
    if obj.get("output_mode") != opts.output_mode:
        record.fail(
            FAIL_OUTPUT_MODE, f"asked output_mode {opts.output_mode!r}, echo was {obj.get('output_mode')!r}"
        )
        return
    choices = obj.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        record.fail(FAIL_INVALID, "response without choices")
        return
    ids = choices[0].get("token_ids") or []
    record.output_tokens = len(ids) if isinstance(ids, list) else 0
    reason = choices[0].get("finish_reason")
    record.finish_reason = None if reason is None else str(reason)
    if record.output_tokens:
        # The whole answer arrives at once: one chunk, so no ITL and no TTFT of its own.
        record.chunk_times_s.append(end - start)
        record.chunk_tokens.append(record.output_tokens)


def _handle_openai_json(
    obj: dict[str, Any], opts: ClientOptions, record: RequestRecord, start: float, end: float
) -> None:
    choices = obj.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        record.fail(FAIL_INVALID, "response without choices")
        return
    n = _usage_tokens(obj)
    if n is None:
        record.fail(FAIL_INVALID, "response without usage.completion_tokens")
        return
    record.output_tokens = n
    reason = choices[0].get("finish_reason")
    record.finish_reason = None if reason is None else str(reason)
    if n:
        record.chunk_times_s.append(end - start)
        record.chunk_tokens.append(n)


def _describe_error(err: object) -> str:
    if isinstance(err, dict):
        return f"{err.get('type')}: {err.get('message')}"
    return str(err)


def _error_message(raw: bytes) -> str:
    text = raw.decode("utf-8", errors="replace")
    try:
        obj = json.loads(text)
    except ValueError:
        return text[:200]
    if isinstance(obj, dict) and "error" in obj:
        return _describe_error(obj["error"])
    return text[:200]
