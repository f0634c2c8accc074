"""The P/D walk through pd-proxy against pd-sim workers (tokens mode) and scripted workers."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from tests.fixtures_sim import SimFactory
from tests.proxy.conftest import PROMPT, PDFactory, ProxyFactory, req, sse_datas
from tests.proxy.scripted import KV_PARAMS, Scripted, ScriptedFactory, SSEBytes, prefill_reply
from tests.traces import TRACE_DIR

CASES: list[dict[str, Any]] = json.loads(
    (pathlib.Path(__file__).parent / "data" / "validation_cases.json").read_text())


async def aggregated(sim_factory: SimFactory, body: dict[str, Any], stream: bool = False) -> Any:
    agg = await sim_factory(role="aggregated", zero_latency=True)
    async with aiohttp.ClientSession() as s, s.post(
        agg.url + "/inference/v1/generate", json={**body, "stream": stream}
    ) as r:
        raw = await r.read()
    return sse_datas(raw) if stream else json.loads(raw)


def strip_volatile(obj: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in obj.items() if k not in ("created",)}


@pytest.mark.parametrize("sp", [{}, {"max_tokens": 1}, {"max_tokens": 20, "min_tokens": 5},
                                {"max_tokens": 5, "stop_token_ids": [300]}, {"ignore_eos": True}])
async def test_nonstream_identical_to_aggregated(pd_factory: PDFactory, sim_factory: SimFactory,
                                                 sp: dict[str, Any]) -> None:
    pd = await pd_factory()
    body = req(request_id="same", sp=sp)
    status, got, headers = await pd.gen(body)
    want = await aggregated(sim_factory, body)
    assert status == 200
    assert strip_volatile(got) == strip_volatile(want)
    assert headers["X-Request-Id"] == "same"
    assert "decode_ttft;dur=" in headers["Server-Timing"]
    await pd.quiet()


@pytest.mark.parametrize("include_usage", [False, True])
async def test_stream_identical_to_aggregated(pd_factory: PDFactory, sim_factory: SimFactory,
                                              include_usage: bool) -> None:
    pd = await pd_factory()
    body = req(request_id="s1", sp={"max_tokens": 12})
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    status, events, _ = await pd.stream(body)
    want = await aggregated(sim_factory, body, stream=True)
    assert status == 200
    assert events == want
    assert events[-1] == "[DONE]"
    if include_usage:
        assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == 12
    await pd.quiet()


async def test_request_id_rules(pd_factory: PDFactory) -> None:
    pd = await pd_factory()
    _, b, h = await pd.gen(req(request_id="body-id"), headers={"X-Request-Id": "hdr-id"})
    assert b["request_id"] == "generate-tokens-hdr-id" and h["X-Request-Id"] == "hdr-id"
    _, b, h = await pd.gen(req(request_id="body-id"))
    assert b["request_id"] == "generate-tokens-body-id"
    _, b, h = await pd.gen(req(request_id=""))  # empty: a fresh id (vLLM would keep "", shared by all)
    assert b["request_id"].startswith("generate-tokens-") and len(b["request_id"]) > 20
    _, b, h = await pd.gen(req())
    assert b["request_id"].startswith("generate-tokens-") and len(b["request_id"]) > 20
    assert b["request_id"] == "generate-tokens-" + h["X-Request-Id"]
    made = {h["X-Request-Id"]} | {(await pd.gen(req()))[2]["X-Request-Id"] for _ in range(8)}
    assert len(made) == 9 and all(len(i) == 32 and int(i, 16) >= 0 for i in made)  # 128 bits, in hex


async def test_timing_comment_on_streams(pd_factory: PDFactory) -> None:
    pd = await pd_factory()
    _, _, raw = await pd.stream(req(), headers={"X-PD-Timing": "1"})
    tail = raw.split(b"\n\n")
    comment = [t for t in tail if t.startswith(b": server-timing ")]
    assert len(comment) == 1 and b"prefill;dur=" in comment[0]
    assert raw.index(comment[0]) < raw.index(b"data: [DONE]")
    _, _, raw = await pd.stream(req())
    assert b": server-timing" not in raw


@pytest.mark.parametrize("case", [c for c in CASES if c["status"] == 400], ids=lambda c: c["name"])
async def test_validation_errors_touch_no_worker(pd_factory: PDFactory, case: dict[str, Any]) -> None:
    pd = await pd_factory()
    r = await pd.client.post("/inference/v1/generate", data=case["body"].encode(),
                             headers={"Content-Type": case["content_type"]})
    assert r.status == 400
    assert await r.json() == case["response"]
    metrics = await (await pd.client.get("/metrics")).text()
    assert "pd_proxy_upstream_requests_total{" not in metrics
    for w in (pd.p, pd.d):
        assert (await w.state())["inflight"] == []
    assert len(pd.serving.table) == 0


@pytest.mark.parametrize(("settings", "body", "message"), [
    ({"decode_tokens_only": True}, req(output_mode="text"), "requires a tokenizer"),
    ({"decode_tokens_only": True}, req(sp={"stop": ["x"]}), "stop strings are not supported"),
    ({"max_num_seqs": 4}, req(sp={"n": 5, "temperature": 1}), "max_num_seqs (4), got 5"),
    ({}, {**req(sp={"prompt_logprob_token_ids": [[3]]}), "stream": True}, "not available when stream"),
])
async def test_server_level_checks(pd_factory: PDFactory, settings: dict[str, Any], body: dict[str, Any],
                                   message: str) -> None:
    pd = await pd_factory(**settings)
    status, b, _ = await pd.gen(body)
    assert status == 400
    assert b["error"]["type"] == "BadRequestError" and message in b["error"]["message"]
    metrics = await (await pd.client.get("/metrics")).text()
    assert "pd_proxy_upstream_requests_total{" not in metrics


# ------------------------------------------------------------------ hop bodies (scripted workers)


async def test_hop_bodies_follow_spec(scripted_factory: ScriptedFactory, proxy_factory: ProxyFactory) -> None:
    p: Scripted = await scripted_factory(lambda b, r: prefill_reply(b))
    d: Scripted = await scripted_factory(lambda b, r: {**prefill_reply(b), "kv_transfer_params": None})
    client, _ = await proxy_factory([p.url], [d.url], upstream_api_key="up-key")
    body = {"token_ids": [5, 6, 7], "request_id": "rid",
            "sampling_params": {"max_tokens": 9, "min_tokens": 2, "temperature": 0, "unknown_knob": 3},
            "stream": False, "stream_options": {"include_usage": True}, "cache_salt": "salt", "whatever": 1,
            "priority": 0, "model": "tiny-llama", "return_token_ids": True, "ec_transfer_params": None}
    r = await client.post("/inference/v1/generate", json=body)
    assert r.status == 200
    hop_p = p.received[0]
    assert hop_p["sampling_params"] == {"max_tokens": 1, "temperature": 0, "unknown_knob": 3}
    assert hop_p["stream"] is False and "stream_options" not in hop_p
    assert hop_p["output_mode"] == "tokens"
    assert hop_p["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False}
    for key in ("cache_salt", "whatever", "priority", "model", "return_token_ids", "ec_transfer_params"):
        assert hop_p[key] == body[key], key
    hop_d = d.received[0]
    assert hop_d == {**body, "kv_transfer_params": KV_PARAMS}
    for h in (p.headers[0], d.headers[0]):
        assert h["x-request-id"] == "rid"
        assert h["authorization"] == "Bearer up-key"


async def test_cached_tokens_go_into_the_decode_workers_own_bytes(
        scripted_factory: ScriptedFactory, proxy_factory: ProxyFactory) -> None:
    p: Scripted = await scripted_factory(lambda b, r: prefill_reply(
        b, {**KV_PARAMS, "remote_prefill_cached_tokens": 128}))
    sent: list[bytes] = []

    def decode(b: dict[str, Any], r: web.Request) -> web.Response:
        # written as no encoder of the proxy's would write it: a space after one colon, 1.50
        raw = json.dumps({**prefill_reply(b), "kv_transfer_params": None}, separators=(",", ":"))
        raw = raw.replace('"created":1', '"created": 1').replace('"metrics":null', '"metrics":1.50')
        sent.append(raw.encode())
        return web.Response(body=raw.encode(), content_type="application/json")

    d: Scripted = await scripted_factory(decode)
    client, _ = await proxy_factory([p.url], [d.url])
    r = await client.post("/inference/v1/generate", json=req())
    got = await r.read()
    assert json.loads(got)["usage"]["prompt_tokens_details"] == {"cached_tokens": 128}
    assert got == sent[0].replace(b'"prompt_tokens_details":null',
                                  b'"prompt_tokens_details":{"cached_tokens":128}')


async def test_prompt_logprobs_and_cached_tokens_come_from_prefill(
        scripted_factory: ScriptedFactory, proxy_factory: ProxyFactory) -> None:
    plp = [None, {"301": {"logprob": -6.0, "rank": 102, "decoded_token": "refi"}}]
    p: Scripted = await scripted_factory(lambda b, r: prefill_reply(
        b, {**KV_PARAMS, "remote_prefill_cached_tokens": 128}, prompt_logprobs=plp))
    d: Scripted = await scripted_factory(lambda b, r: {**prefill_reply(b), "kv_transfer_params": None})
    client, _ = await proxy_factory([p.url], [d.url])
    r = await client.post("/inference/v1/generate",
                          json=req(sp={"prompt_logprobs": 1, "prompt_logprob_token_ids": [[3]]}))
    out = await r.json()
    assert out["prompt_logprobs"] == plp
    assert out["usage"]["prompt_tokens_details"] == {"cached_tokens": 128}
    assert p.received[0]["sampling_params"]["prompt_logprobs"] == 1
    assert "prompt_logprobs" not in d.received[0]["sampling_params"]
    assert "prompt_logprob_token_ids" not in d.received[0]["sampling_params"]
    assert p.received[0]["sampling_params"]["prompt_logprob_token_ids"] == [[3]]


TRACES = TRACE_DIR


def trace_stream(name: str) -> tuple[dict[str, Any], bytes]:
    text = (TRACES / name).read_bytes()
    req_part = text.split(b">>> REQUEST", 1)[1].split(b"\n\n", 1)[1].split(b"\n<<<", 1)[0]
    resp = text.split(b"<<< RESPONSE", 1)[1].split(b"\n\n", 1)[1].rsplit(b"<<< END", 1)[0]
    return json.loads(req_part), resp.rstrip(b"\n") + b"\n\n"


@pytest.mark.parametrize("name", ["gen-text-stream-utf8-split.txt", "gen-logprobs-text-stream.txt",
                                  "gen-text-stop-stream.txt", "gen-logprobs-tokens-stream.txt",
                                  "gen-text-stream-include-usage.txt", "gen-n2-sampled-stream.txt"])
async def test_trace_stream_relayed_byte_for_byte_at_every_split(
        scripted_factory: ScriptedFactory, proxy_factory: ProxyFactory, name: str) -> None:
    """Real vLLM stream bytes, written one byte per HTTP chunk: the client gets them unchanged."""
    body, stream = trace_stream(name)
    p: Scripted = await scripted_factory(lambda b, r: prefill_reply(b))
    d: Scripted = await scripted_factory(
        lambda b, r: SSEBytes([stream[i : i + 1] for i in range(len(stream))]))
    client, _ = await proxy_factory([p.url], [d.url])
    r = await client.post("/inference/v1/generate", json=body)
    got = await r.read()
    assert r.status == 200
    assert sse_datas(got) == sse_datas(stream)
    assert got == stream
    if name == "gen-text-stream-utf8-split.txt":
        texts = [e["choices"][0]["text"] for e in sse_datas(got)[:-1]]
        assert texts == ["", "é"]


async def test_text_mode_nonstream_via_scripted(scripted_factory: ScriptedFactory,
                                                proxy_factory: ProxyFactory) -> None:
    p: Scripted = await scripted_factory(lambda b, r: prefill_reply(b))
    reply = {**prefill_reply({"request_id": "x", "token_ids": PROMPT}), "output_mode": "text",
             "kv_transfer_params": None}
    reply["choices"][0]["text"] = "héllo"
    d: Scripted = await scripted_factory(lambda b, r: reply)
    client, _ = await proxy_factory([p.url], [d.url])
    r = await client.post("/inference/v1/generate", json=req(output_mode="text", request_id="x"))
    out = await r.json()
    assert out["choices"][0]["text"] == "héllo" and out["output_mode"] == "text"
    assert p.received[0]["output_mode"] == "tokens" and d.received[0]["output_mode"] == "text"


async def test_nonstream_reply_bytes_untouched_when_nothing_to_merge(
        scripted_factory: ScriptedFactory, proxy_factory: ProxyFactory) -> None:
    reply = {**prefill_reply({"request_id": "x", "token_ids": PROMPT}), "kv_transfer_params": None}
    raw = json.dumps(reply, indent=2, ensure_ascii=True).encode()  # not how the proxy would write it
    p: Scripted = await scripted_factory(lambda b, r: prefill_reply(b))
    d: Scripted = await scripted_factory(
        lambda b, r: web.Response(body=raw, content_type="application/json"))
    client, _ = await proxy_factory([p.url], [d.url])
    r = await client.post("/inference/v1/generate", json=req(request_id="x"))
    assert await r.read() == raw
