"""The HTTP/SSE timing client: one ``POST /inference/v1/generate`` -> one :class:`RequestRecord`.

Times are ``time.perf_counter()`` readings taken the moment a network read returns, before any
parsing, and stored as seconds since the request was sent: the moment its bytes are handed to
the connection (aiohttp's ``on_request_chunk_sent`` trace, see :func:`new_session`), so that
pd-bench's own work before that (building the request, serializing the body, taking or opening a
connection, a loop tick for the body-writer task) is not charged to the server. A session
without that trace falls back to the moment ``send_request`` began. A "chunk" is one SSE ``data`` event
that carries at least one new output token (``choices[0].token_ids``); chunks without tokens
(the ``include_usage`` chunk, an ``abort`` chunk) count toward nothing but failure checks.
"""

from __future__ import annotations

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


def build_body(spec: RequestSpec, request_id: str, opts: ClientOptions) -> dict[str, Any]:
    """The generate request for ``spec``: exact output length, greedy, tokens in."""
    return {
        "request_id": request_id,
        "token_ids": spec.prompt,
        "sampling_params": {
            "max_tokens": spec.output_len,
            "temperature": 0.0,
            "ignore_eos": True,
        },
        "stream": opts.stream,
        "output_mode": opts.output_mode,
    }


def build_headers(request_id: str, opts: ClientOptions) -> dict[str, str]:
    headers = {"X-Request-Id": request_id}
    if opts.api_key:
        headers["Authorization"] = f"Bearer {opts.api_key}"
    if opts.ask_server_timing:
        headers[TIMING_REQUEST_HEADER] = "1"
    return headers


def endpoint(url: str) -> str:
    """Accept a base URL (``http://h:p``) or the full generate URL."""
    url = url.rstrip("/")
    return url if url.endswith(GENERATE_PATH) else url + GENERATE_PATH


async def send_request(
    session: aiohttp.ClientSession,
    opts: ClientOptions,
    spec: RequestSpec,
    record: RequestRecord,
    t0: float,
) -> RequestRecord:
    """Send one request and fill ``record``. Never raises except ``CancelledError``.

    Cancelling the task closes the connection, which makes vLLM (and pd-proxy) abort the request.
    """
    body = build_body(spec, record.request_id, opts)
    headers = build_headers(record.request_id, opts)
    timeout = aiohttp.ClientTimeout(total=opts.request_timeout_s)
    mark = _SendMark()
    start = time.perf_counter()
    record.start_s = start - t0
    end: float | None = None
    try:
        async with session.post(
            endpoint(opts.url), json=body, headers=headers, timeout=timeout, trace_request_ctx=mark
        ) as resp:
            if mark.at is not None:  # the request was written before any answer could come
                start = mark.at
                record.start_s = start - t0
            record.http_status = resp.status
            record.server_request_id = resp.headers.get("X-Request-Id")
            if resp.status != 200:
                raw = await resp.content.read(_MAX_ERROR_BODY)
                record.fail(FAIL_HTTP_STATUS, f"HTTP {resp.status}: {_error_message(raw)}")
                return record
            header_timing = resp.headers.get("Server-Timing")
            if header_timing:
                record.server_timing = parse_server_timing(header_timing)
            if opts.stream:
                end = await _read_stream(resp, opts, record, start)
            else:
                raw = await resp.read()
                end = time.perf_counter()
                _handle_json(raw, opts, record, start, end)
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
    if record.failure is None and record.finish_reason == "abort":
        record.fail(FAIL_ABORTED, "finish_reason abort")
    record.success = record.failure is None
    return record


async def _read_stream(
    resp: aiohttp.ClientResponse, opts: ClientOptions, record: RequestRecord, start: float
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
            if not _handle_event(ev.data, opts, record, now - start):
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
