"""The recorded vLLM 0.32 answers (the referee) replayed byte for byte to pd-bench's client.

For every trace with a generate call, the expected outcome is worked out from the trace itself
with a plain reading (status, last event, [DONE], token ids of choice 0) and compared with how
pd-bench classifies and counts the same bytes arriving over HTTP, one recorded event per write.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from benchmarks.client import ClientOptions, send_request
from benchmarks.datasets import RequestSpec
from benchmarks.records import FAIL_ABORTED, FAIL_HTTP_STATUS, FAIL_NO_DONE, RequestRecord
from tests.benchmarks.scripted import Script, make_app
from tests.traces import Block, load_trace, trace_files

ServerFactory = Callable[..., Awaitable[TestServer]]


def generate_exchanges() -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    for path in trace_files():
        trace = load_trace(path)
        for req in trace.requests():
            if req.path == "/inference/v1/generate" and req.header("Content-Type") == "application/json":
                try:
                    body = json.loads(req.body)
                except ValueError:
                    continue  # pd-bench only ever sends valid JSON
                if isinstance(body, dict):
                    out.append((path.name, req.label))
    return out


EXCHANGES = generate_exchanges()


def expected(req: Block, resp: Block) -> tuple[str | None, int]:
    """(failure kind or None, output tokens of choice 0) by a plain reading of the trace."""
    if resp.status != 200:
        return FAIL_HTTP_STATUS, 0
    body = json.loads(req.body)
    if body.get("stream"):
        events = [e for e in resp.body.decode().split("\n\n") if e]
        datas = [e[len("data: ") :] for e in events]
        chunks = [json.loads(d) for d in datas if d != "[DONE]"]
        tokens = sum(len(c["token_ids"] or []) for ch in chunks for c in ch["choices"] if c["index"] == 0)
        if datas[-1] != "[DONE]":
            return FAIL_NO_DONE, tokens
        reasons = [c["finish_reason"] for ch in chunks for c in ch["choices"] if c["index"] == 0]
        return (FAIL_ABORTED if "abort" in reasons else None), tokens
    doc = json.loads(resp.body)
    choice = doc["choices"][0]
    return (FAIL_ABORTED if choice["finish_reason"] == "abort" else None), len(choice["token_ids"])


def test_there_are_traces_to_replay() -> None:
    assert len(EXCHANGES) > 50


@pytest.mark.parametrize(("name", "label"), EXCHANGES, ids=[f"{n}:{lb}" for n, lb in EXCHANGES])
async def test_replayed_trace_is_classified_like_the_trace_says(
    aiohttp_server: ServerFactory, name: str, label: str
) -> None:
    trace = load_trace(next(p for p in trace_files() if p.name == name))
    req = trace.request(label)
    resp = trace.response(label)
    body: dict[str, Any] = json.loads(req.body)
    ctype = (resp.header("content-type") or "application/json").split(";")[0]
    if body.get("stream") and resp.status == 200:
        events = [e + b"\n\n" for e in resp.body.split(b"\n\n") if e]
        script = Script(steps=[(0.0, e) for e in events], content_type=ctype)
    else:
        script = Script(status=resp.status, raw_body=resp.body, content_type=ctype)
    server = await aiohttp_server(make_app(lambda b: script))
    url = f"http://127.0.0.1:{server.port}"
    opts = ClientOptions(
        url=url, stream=bool(body.get("stream")), output_mode=body.get("output_mode", "tokens")
    )
    spec = RequestSpec(prompt=list(body.get("token_ids") or [3]), output_len=1)
    rec = RequestRecord(0, "x", url, len(spec.prompt), 1)
    async with aiohttp.ClientSession() as session:
        rec = await send_request(session, opts, spec, rec, 0.0)
    kind, tokens = expected(req, resp)
    assert rec.failure == kind, rec.error
    assert rec.output_tokens == tokens
    assert rec.success == (kind is None)
    if kind is None and opts.stream:
        assert rec.ttft_s is not None and len(rec.chunk_times_s) >= 1
