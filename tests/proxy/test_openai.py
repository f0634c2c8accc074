"""pd-proxy's OpenAI routes on pd-sim pairs: the answer through the P/D split is what one worker's
own aggregated /v1/chat/completions and /v1/completions answer (content, finish and stop reason,
usage), and the hand-off happened (the decode worker pulled the KV)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest

from tests.proxy.conftest import PD, PDFactory, sse_datas
from workers.sim import openai as sim_openai
from workers.sim.errors import InternalError

CHAT, CMPL = "/v1/chat/completions", "/v1/completions"
MSGS = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Héllo there 😀, how are you?"}]


def chat(**kw: Any) -> dict[str, Any]:
    return {"model": "tiny-llama", "messages": MSGS, "max_tokens": 12, "temperature": 0, **kw}


def cmpl(**kw: Any) -> dict[str, Any]:
    return {"model": "tiny-llama", "prompt": "Hello there 😀, how are you?", "max_tokens": 12,
            "temperature": 0, **kw}


async def direct(pd: PD, path: str, body: dict[str, Any]) -> tuple[int, bytes]:
    """The decode worker's own aggregated answer (the "one vLLM server" reference)."""
    async with aiohttp.ClientSession() as s, s.post(pd.d.url + path, json=body) as r:
        return r.status, await r.read()


async def proxied(pd: PD, path: str, body: dict[str, Any], **kw: Any) -> tuple[int, bytes, Any]:
    r = await pd.client.post(path, json=body, **kw)
    return r.status, await r.read(), r.headers


def summary(raw: bytes, *, stream: bool, chat: bool) -> dict[str, Any]:
    """What must agree: the text, finish and stop reason, usage (counts)."""
    if not stream:
        d = json.loads(raw)
        c = d["choices"][0]
        text = c["message"]["content"] if chat else c["text"]
        u = d["usage"]
        return {"text": text, "finish": c["finish_reason"], "stop": c["stop_reason"],
                "usage": (u["prompt_tokens"], u["completion_tokens"], u["total_tokens"])}
    events = sse_datas(raw)
    assert events[-1] == "[DONE]"
    text, finish, stop, usage = "", None, None, None
    for e in events[:-1]:
        for c in e["choices"]:
            text += (c["delta"].get("content") or "") if chat else c["text"]
            if c["finish_reason"] is not None:
                finish, stop = c["finish_reason"], c.get("stop_reason")
        if e.get("usage"):
            usage = (e["usage"]["prompt_tokens"], e["usage"]["completion_tokens"], e["usage"]["total_tokens"])
    return {"text": text, "finish": finish, "stop": stop, "usage": usage}


CASES = [
    (CHAT, chat()),
    (CHAT, chat(stop=["e"], max_tokens=30)),
    (CHAT, chat(stop=["im"], include_stop_str_in_output=True, max_tokens=30)),  # inside a token
    (CHAT, chat(stop=["a_", "xyz"], max_tokens=30)),  # across two tokens
    (CHAT, chat(stop=["rag"], include_stop_str_in_output=True, max_tokens=30)),  # across two tokens
    (CHAT, chat(max_tokens=3)),
    (CHAT, chat(max_tokens=16)),  # render leaves out a max_tokens of 16, SamplingParams' default
    (CMPL, cmpl(max_tokens=16)),
    (CHAT, chat(logprobs=True, top_logprobs=2, max_tokens=4)),
    (CMPL, cmpl()),
    (CMPL, cmpl(stop="r", max_tokens=30)),
    (CMPL, cmpl(max_tokens=2)),
]


@pytest.mark.parametrize("derender", ["auto", "always"])
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("path", "body"), CASES)
async def test_same_answer_as_one_worker(pd_factory: PDFactory, path: str, body: dict[str, Any], stream: bool,
                                         derender: str) -> None:
    pd = await pd_factory(openai_derender=derender)
    if stream:
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    status, raw, headers = await proxied(pd, path, body)
    assert status == 200, raw
    ref_status, ref = await direct(pd, path, body)
    assert ref_status == 200
    chat_ = path == CHAT
    assert summary(raw, stream=stream, chat=chat_) == summary(ref, stream=stream, chat=chat_)
    assert await pd.d.pulled_bytes() > 0  # the hand-off happened: D pulled P's KV
    rid = headers["X-Request-Id"]
    assert rid.startswith("chatcmpl-" if chat_ else "cmpl-")
    if stream:
        assert headers["Content-Type"] == "text/event-stream; charset=utf-8"
        ids = {e["id"] for e in sse_datas(raw) if isinstance(e, dict)}
        assert ids == {rid}
    else:
        got, want = json.loads(raw), json.loads(ref)
        assert got["id"] == rid
        assert list(got) == list(want)  # the aggregated server's keys, in its order
        assert list(got["choices"][0]) == list(want["choices"][0])
        if "logprobs" in body:
            assert got["choices"][0]["logprobs"] == want["choices"][0]["logprobs"]
    await pd.quiet()


async def test_stream_framing_is_the_aggregated_servers(pd_factory: PDFactory) -> None:
    """Chunk by chunk, keys included (ids and times aside), as pd-sim's aggregated stream."""
    pd = await pd_factory()
    usage = {"include_usage": True}
    for body, path in ((chat(stream=True), CHAT), (chat(stream=True, stream_options=usage), CHAT),
                       (cmpl(stream=True), CMPL)):
        _, raw, _ = await proxied(pd, path, body)
        _, ref = await direct(pd, path, body)
        got, want = sse_datas(raw), sse_datas(ref)

        def norm(events: list[Any]) -> list[Any]:
            out = []
            for e in events:
                out.append({k: v for k, v in e.items() if k not in ("id", "created", "system_fingerprint")}
                           if isinstance(e, dict) else e)
            return out

        assert norm(got) == norm(want)
        assert [("system_fingerprint" in e) for e in got if isinstance(e, dict)] == \
            [("system_fingerprint" in e) for e in want if isinstance(e, dict)]


async def test_model_omitted_answers_the_served_name(pd_factory: PDFactory) -> None:
    pd = await pd_factory()
    body = chat()
    del body["model"]
    status, raw, _ = await proxied(pd, CHAT, body)
    assert status == 200
    assert json.loads(raw)["model"] == "tiny-llama"


async def test_pass_through_render_derender_models(pd_factory: PDFactory) -> None:
    pd = await pd_factory()
    r = await pd.client.post(CHAT + "/render", json=chat(), headers={"X-Request-Id": "r1"})
    _, ref = await direct(pd, CHAT + "/render", chat())
    got = json.loads(await r.read())
    assert r.status == 200 and got["request_id"] == "chatcmpl-r1"
    assert got["token_ids"] == json.loads(ref)["token_ids"]
    r = await pd.client.post(CMPL + "/render", json=cmpl())
    assert r.status == 200 and isinstance(await r.json(), list)
    r = await pd.client.post(CHAT + "/derender", json={"generate_response": {"request_id": "x", "choices": [
        {"index": 0, "token_ids": [], "finish_reason": "stop"}]}})
    assert r.status == 400  # the worker's own answer
    assert "empty or null token_ids" in (await r.json())["error"]["message"]
    r = await pd.client.get("/v1/models")
    assert r.status == 200 and (await r.json())["data"][0]["id"] == "tiny-llama"


@pytest.mark.parametrize("path", [CHAT, CMPL])
async def test_errors_are_the_workers(pd_factory: PDFactory, path: str) -> None:
    pd = await pd_factory()
    body = chat(model="nope") if path == CHAT else cmpl(model="nope")
    status, raw, _ = await proxied(pd, path, body)
    ref_status, ref = await direct(pd, path, body)
    assert (status, json.loads(raw)) == (ref_status, json.loads(ref)) and status == 404
    too_long = json.dumps({**body, "model": "tiny-llama", "max_tokens": 600}).encode()
    for data, ctype in ((b"{not json", "application/json"), (b"{}", "text/plain"),
                        (too_long, "application/json")):
        r = await pd.client.post(path, data=data, headers={"Content-Type": ctype})
        async with aiohttp.ClientSession() as s, s.post(pd.d.url + path, data=data,
                                                         headers={"Content-Type": ctype}) as ref_r:
            assert (r.status, await r.json()) == (ref_r.status, await ref_r.json())
        assert r.status in (400, 415)
    await pd.quiet()


async def test_several_prompts_refused(pd_factory: PDFactory) -> None:
    pd = await pd_factory()
    status, raw, _ = await proxied(pd, CMPL, cmpl(prompt=["a b", "c d"]))
    assert status == 400
    err = json.loads(raw)["error"]
    assert err["type"] == "BadRequestError" and err["param"] == "prompt"
    await pd.quiet()


@pytest.mark.parametrize("stream", [False, True])
async def test_abort_by_openai_id(pd_factory: PDFactory, stream: bool) -> None:
    """The id the client knows (``chatcmpl-<X-Request-Id>``) aborts the request in the walk."""
    pd = await pd_factory(hold_between_hops=5.0)
    body = chat(stream=stream)
    task = asyncio.create_task(proxied(pd, CHAT, body, headers={"X-Request-Id": "ab1"}))
    for _ in range(500):
        if pd.serving.table.entries("generate-tokens-chatcmpl-ab1"):
            break
        await asyncio.sleep(0.01)
    r = await pd.client.post("/inference/v1/abort_requests", json={"request_ids": ["chatcmpl-ab1"]})
    assert r.status == 200
    status, raw, _ = await asyncio.wait_for(task, 10)
    assert status == 200
    if stream:
        events = sse_datas(raw)
        assert events[-1] == "[DONE]"
        ends = [c["finish_reason"] for e in events[:-1] for c in e["choices"] if c["finish_reason"]]
        assert ends == ["abort"]
        assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    else:
        answer = json.loads(raw)
        assert answer["id"] == "chatcmpl-ab1"
        assert answer["choices"][0]["finish_reason"] == "abort"
    await pd.quiet()


async def test_disconnect_reaches_both_workers(pd_factory: PDFactory) -> None:
    """A client that leaves mid-stream: the decode worker is aborted, nothing held anywhere."""
    pd = await pd_factory(decode={"zero_latency": False, "itl_ms": 50.0})
    r = await pd.client.post(CHAT, json=chat(stream=True, max_tokens=200))
    assert r.status == 200
    await r.content.readline()
    for _ in range(500):
        if (await pd.d.state())["inflight"]:
            break
        await asyncio.sleep(0.01)
    r.close()
    await pd.quiet(limit=5.0)


@pytest.mark.parametrize("failing_call", [1, 4])
async def test_failed_derender_aborts_the_request(pd_factory: PDFactory, monkeypatch: pytest.MonkeyPatch,
                                                  failing_call: int) -> None:
    """A derender that fails mid-stream (the worker answers 500 from its ``failing_call``-th
    derender on: 1 is P's token, while P holds the KV; 4 is in D's stream): the client's stream ends
    with the error, and the request is aborted as the walk aborts any, so the decode worker stops
    (at 100 ms a token its 400 tokens would take 40 s, and the client's stream would wait for
    them) and nothing stays held anywhere."""
    calls = 0
    derender = sim_openai.derender_stream

    def failing(st: Any, body: dict[str, Any], *, chat: bool) -> dict[str, Any]:
        nonlocal calls
        calls += 1
        if calls >= failing_call:
            raise InternalError()
        return derender(st, body, chat=chat)

    monkeypatch.setattr(sim_openai, "derender_stream", failing)
    pd = await pd_factory(openai_derender="always", decode={"zero_latency": False, "itl_ms": 100.0})
    status, raw, _ = await asyncio.wait_for(proxied(pd, CHAT, chat(stream=True, max_tokens=400)), 20)
    assert status == 200 and calls == failing_call
    events = sse_datas(raw)
    assert events[-1] == "[DONE]"
    error = events[-2]["error"]
    assert error["code"] == 502 and "derender" in error["message"]
    assert all("error" not in e for e in events[:-2])
    for _ in range(250):
        if not (await pd.d.state())["inflight"]:
            break
        await asyncio.sleep(0.02)
    assert (await pd.d.state())["inflight"] == []
    await pd.quiet(limit=5.0)
    metrics = await (await pd.client.get("/metrics")).text()
    assert 'pd_proxy_aborts_total{source="derender"' in metrics  # the walk's abort
