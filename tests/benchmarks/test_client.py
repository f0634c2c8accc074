"""The timing client against a scripted server: parsing, failure classification, cancellation."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Awaitable, Callable
from itertools import pairwise
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

import benchmarks.client
from benchmarks.client import (
    ClientOptions,
    build_body,
    endpoint,
    new_session,
    parse_server_timing,
    prefill_hop_body,
    send_request,
)
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
from tests.benchmarks.scripted import DONE, SEEN, Script, ScriptFn, chunk, make_app, stream_of

ServerFactory = Callable[..., Awaitable[TestServer]]
SPEC = RequestSpec(prompt=[5, 6, 7, 8], output_len=4)


async def serve(aiohttp_server: ServerFactory, script: ScriptFn) -> tuple[str, web.Application]:
    app = make_app(script)
    server = await aiohttp_server(app)
    return f"http://127.0.0.1:{server.port}", app


async def one(url: str, spec: RequestSpec = SPEC, **opts: Any) -> RequestRecord:
    rec = RequestRecord(0, "rq-1", url, len(spec.prompt), spec.output_len)
    async with aiohttp.ClientSession() as session:
        return await send_request(session, ClientOptions(url=url, **opts), spec, rec, 0.0)


async def test_stream_success_and_request_shape(aiohttp_server: ServerFactory) -> None:
    def script(body: dict[str, Any]) -> Script:
        steps = stream_of("rq-1", [1, 2, 1], gap_s=0.01)
        usage = b'data: {"output_mode":"tokens","choices":[],"usage":{"completion_tokens":4}}\n\n'
        return Script(steps=[*steps[:-1], (0.0, usage), steps[-1]])

    url, app = await serve(aiohttp_server, script)
    rec = await one(url, api_key="sekret")
    assert rec.success, rec.error
    assert rec.failure is None
    assert rec.output_tokens == 4
    assert rec.chunk_tokens == [1, 2, 1]  # the usage chunk carries no tokens and is not a chunk
    assert rec.chunk_times_s == sorted(rec.chunk_times_s)
    assert rec.ttft_s == rec.chunk_times_s[0]
    assert rec.e2e_s is not None and rec.e2e_s >= rec.chunk_times_s[-1]
    assert rec.finish_reason == "length"
    body = app[SEEN].bodies[0]
    assert body == {
        "request_id": "rq-1",
        "token_ids": [5, 6, 7, 8],
        "sampling_params": {"max_tokens": 4, "temperature": 0.0, "ignore_eos": True},
        "stream": True,
        "output_mode": "tokens",
    }
    headers = app[SEEN].headers[0]
    assert headers["X-Request-Id"] == "rq-1"
    assert headers["X-PD-Timing"] == "1"
    assert headers["Authorization"] == "Bearer sekret"


async def test_events_split_across_network_writes(aiohttp_server: ServerFactory) -> None:
    raw = b"".join(data for _, data in stream_of("rq-1", [1, 1, 1, 1]))
    cuts = [0, 5, 60, 61, 150, 151, 152, 300, len(raw) - 3, len(raw)]

    def script(body: dict[str, Any]) -> Script:
        return Script(steps=[(0.005, raw[a:b]) for a, b in pairwise(cuts)])

    url, _ = await serve(aiohttp_server, script)
    rec = await one(url)
    assert rec.success, rec.error
    assert rec.chunk_tokens == [1, 1, 1, 1]


async def test_text_mode(aiohttp_server: ServerFactory) -> None:
    url, _ = await serve(aiohttp_server, lambda b: Script(steps=stream_of("rq-1", [1, 1, 2], mode="text")))
    rec = await one(url, output_mode="text")
    assert rec.success, rec.error
    assert rec.output_tokens == 4


@pytest.mark.parametrize(
    ("script", "kind"),
    [
        (Script(status=400), FAIL_HTTP_STATUS),
        (Script(status=503, json_body={"error": {"message": "overloaded", "type": "x"}}), FAIL_HTTP_STATUS),
        (
            Script(
                steps=[(0, chunk("rq-1", [3])), (0, b'data: {"error": {"message": "boom", "type": "x"}}\n\n')]
            ),
            FAIL_ERROR_EVENT,
        ),
        (Script(steps=[(0, chunk("rq-1", [3])), (0, chunk("rq-1", [4], "length"))]), FAIL_NO_DONE),
        (Script(steps=[(0, chunk("rq-1", [3])), (0, b'data: {"output_mode": "tok')]), FAIL_NO_DONE),
        (Script(steps=[(0, chunk("rq-1", [3], mode="text")), (0, DONE)]), FAIL_OUTPUT_MODE),
        (Script(steps=[(0, chunk("rq-1", [3], mode=None)), (0, DONE)]), FAIL_OUTPUT_MODE),
        (Script(steps=[(0, chunk("rq-1", [3])), (0, chunk("rq-1", [], "abort")), (0, DONE)]), FAIL_ABORTED),
        (Script(steps=[(0, b"data: not json\n\n"), (0, DONE)]), FAIL_INVALID),
        (Script(steps=[(0, b'{"choices": []}')], content_type="application/json"), FAIL_INVALID),
    ],
    ids=[
        "400",
        "503-with-message",
        "error-event",
        "no-done",
        "cut-mid-event",
        "wrong-mode",
        "missing-mode",
        "abort",
        "bad-json",
        "not-sse",
    ],
)
async def test_failure_kinds(aiohttp_server: ServerFactory, script: Script, kind: str) -> None:
    url, _ = await serve(aiohttp_server, lambda b: script)
    rec = await one(url)
    assert not rec.success
    assert rec.failure == kind, rec.error
    assert rec.error


async def test_error_message_is_kept(aiohttp_server: ServerFactory) -> None:
    url, _ = await serve(
        aiohttp_server, lambda b: Script(status=503, json_body={"error": {"message": "overloaded"}})
    )
    rec = await one(url)
    assert rec.http_status == 503
    assert rec.error is not None and "overloaded" in rec.error


async def test_connection_refused_is_transport_failure() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rec = await one(f"http://127.0.0.1:{port}")
    assert rec.failure == FAIL_TRANSPORT


async def test_timeout(aiohttp_server: ServerFactory) -> None:
    url, _ = await serve(aiohttp_server, lambda b: Script(steps=[(0, chunk("rq-1", [3])), (30.0, DONE)]))
    rec = await one(url, request_timeout_s=0.2)
    assert rec.failure == FAIL_TIMEOUT
    assert rec.output_tokens == 1


async def test_non_stream_with_server_timing_header(aiohttp_server: ServerFactory) -> None:
    answer = {"request_id": "generate-tokens-rq-1", "output_mode": "tokens"}
    answer["choices"] = [{"index": 0, "finish_reason": "length", "token_ids": [3, 4, 5, 6]}]  # type: ignore[assignment]
    timing = "queue;dur=0.1, prefill;dur=20.5, handoff;dur=1.5, decode_ttft;dur=8, total;dur=60"

    def script(body: dict[str, Any]) -> Script:
        assert body["stream"] is False
        return Script(json_body=answer, headers={"Server-Timing": timing, "X-Request-Id": "rq-1"})

    url, _ = await serve(aiohttp_server, script)
    rec = await one(url, stream=False)
    assert rec.success, rec.error
    assert rec.output_tokens == 4
    assert rec.ttft_s is None  # no stream, no first-token time of its own
    assert rec.server_timing == {
        "queue": 0.1,
        "prefill": 20.5,
        "handoff": 1.5,
        "decode_ttft": 8.0,
        "total": 60.0,
    }
    assert rec.server_request_id == "rq-1"


async def test_stream_server_timing_comment(aiohttp_server: ServerFactory) -> None:
    comment = (
        b": server-timing queue;dur=0.5, prefill;dur=30, handoff;dur=2, decode_ttft;dur=9.5, total;dur=80\n\n"
    )

    def script(body: dict[str, Any]) -> Script:
        steps = stream_of("rq-1", [1, 1])
        return Script(steps=[*steps[:-1], (0, comment), steps[-1]], headers={"X-Request-Id": "rq-1"})

    url, _ = await serve(aiohttp_server, script)
    rec = await one(url)
    assert rec.success, rec.error
    assert rec.server_timing == {
        "queue": 0.5,
        "prefill": 30.0,
        "handoff": 2.0,
        "decode_ttft": 9.5,
        "total": 80.0,
    }


async def test_timing_header_can_be_turned_off(aiohttp_server: ServerFactory) -> None:
    url, app = await serve(aiohttp_server, lambda b: Script(steps=stream_of("rq-1", [1])))
    await one(url, ask_server_timing=False)
    assert "X-PD-Timing" not in app[SEEN].headers[0]
    assert "Authorization" not in app[SEEN].headers[0]


async def test_cancel_closes_the_connection(aiohttp_server: ServerFactory) -> None:
    steps = [(0.0, chunk("rq-1", [3]))] + [(0.05, chunk("rq-1", [4]))] * 200 + [(0, DONE)]
    url, app = await serve(aiohttp_server, lambda b: Script(steps=steps))
    seen = app[SEEN]
    task = asyncio.create_task(one(url))
    await asyncio.wait_for(seen.first_write.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.wait_for(seen.disconnected.wait(), 5)
    assert seen.disconnects == 1
    assert seen.in_flight == 0


def test_parse_server_timing() -> None:
    assert parse_server_timing('a;dur=1.5, b;desc="x";dur=2, c, d;dur=bad, a;dur=9') == {"a": 1.5, "b": 2.0}
    assert parse_server_timing(" queue;dur=0") == {"queue": 0.0}
    assert parse_server_timing("") == {}


def test_endpoint() -> None:
    assert endpoint("http://h:1") == "http://h:1/inference/v1/generate"
    assert endpoint("http://h:1/") == "http://h:1/inference/v1/generate"
    assert endpoint("http://h:1/inference/v1/generate") == "http://h:1/inference/v1/generate"


def test_record_json_is_milliseconds() -> None:
    r = RequestRecord(
        1, "x", "t", 3, 2, ttft_s=0.25, e2e_s=0.5, chunk_times_s=[0.25, 0.5], chunk_tokens=[1, 1]
    )
    d = r.to_json()
    assert d["ttft_ms"] == 250.0
    assert d["e2e_ms"] == 500.0
    assert d["chunk_times_ms"] == [250.0, 500.0]
    assert "ttft_s" not in d
    json.dumps(d)


class _Ticks:
    """A ``time`` stand-in whose ``perf_counter`` counts calls: 1.0, 2.0, ..."""

    def __init__(self) -> None:
        self.n = 0.0

    def perf_counter(self) -> float:
        self.n += 1.0
        return self.n


@pytest.mark.parametrize("traced", [True, False])
async def test_the_clock_starts_when_the_request_is_written(
    aiohttp_server: ServerFactory, monkeypatch: pytest.MonkeyPatch, traced: bool
) -> None:
    # One reading before session.post, one in the write hook (a run's session), then one per
    # network read: times count from the write, so pd-bench's own request building, body
    # serialization and connection set-up are not charged to the server.
    url, _ = await serve(aiohttp_server, lambda body: Script(steps=stream_of("rq-1", [1, 1], gap_s=0.0)))
    rec = RequestRecord(0, "rq-1", url, len(SPEC.prompt), SPEC.output_len)
    ticks = _Ticks()
    async with new_session() if traced else aiohttp.ClientSession() as session:
        monkeypatch.setattr(benchmarks.client, "time", ticks)
        await send_request(session, ClientOptions(url=url), SPEC, rec, 0.0)
    assert rec.success, rec.error
    start = 2.0 if traced else 1.0
    assert rec.start_s == start
    assert rec.ttft_s is not None and rec.e2e_s is not None
    # every later reading is a whole tick after the start (relative to it, not to the call)
    assert (rec.ttft_s + start).is_integer() and rec.ttft_s >= 1.0
    assert rec.e2e_s + start == ticks.n


def test_prefill_hop_body_follows_spec_section_3() -> None:
    body = build_body(RequestSpec(prompt=[1, 2, 3], output_len=256), "rq-1", ClientOptions(url="x"))
    body["sampling_params"]["min_tokens"] = 4
    body["stream_options"] = {"include_usage": True}
    hop = prefill_hop_body(body)
    assert hop["stream"] is False
    assert hop["sampling_params"]["max_tokens"] == 1
    assert "min_tokens" not in hop["sampling_params"]
    assert "stream_options" not in hop
    assert hop["output_mode"] == "tokens"
    assert hop["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False}
    assert hop["token_ids"] == [1, 2, 3]
    # the original is untouched (the decode hop sends it)
    assert body["sampling_params"]["max_tokens"] == 256
    assert body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}


async def test_only_the_output_token_ids_are_counted(aiohttp_server: ServerFactory) -> None:
    # prompt_token_ids, a null token_ids and the usage chunk carry no output tokens
    first = chunk("rq-1", [9, 9]).replace(b'"choices"', b'"prompt_token_ids": [1, 2, 3, 4], "choices"')
    empty = chunk("rq-1", []).replace(b'"token_ids": []', b'"token_ids": null')
    usage = b'data: {"output_mode":"tokens","choices":[],"usage":{"completion_tokens":3}}\n\n'
    steps = [(0.0, first), (0.0, empty), (0.0, chunk("rq-1", [7], "length")), (0.0, usage), (0.0, DONE)]
    url, _ = await serve(aiohttp_server, lambda b: Script(steps=steps))
    rec = await one(url)
    assert rec.success, rec.error
    assert rec.output_tokens == 3
    assert rec.chunk_tokens == [2, 1]
