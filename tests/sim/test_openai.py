"""pd-sim's OpenAI surface: render/derender as vLLM 0.32's scale-out endpoints, and the plain
/v1/chat/completions and /v1/completions of one aggregated server.

The referee is the recorded exchanges with a real vLLM 0.32 in
``tests/data/traces/vllm-0.32.0-cpu/openai/`` (JSON keys, order, types, error bodies), and the
property that matters to pd-proxy: render -> generate -> derender answers what one worker answers.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.fixtures_sim import SimFactory, SimWorker
from tests.sse import done, json_events
from tests.traces import TRACE_DIR, Trace, load_trace
from workers.sim.openai import TokenStrings, detokenize_delta, seed_state
from workers.sim.tokenizer import ByteTokenizer

OPENAI_TRACES = sorted((TRACE_DIR / "openai").glob("*.txt"))
CHAT, CMPL = "/v1/chat/completions", "/v1/completions"
MSGS = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Héllo there 😀, how are you?"},
]
# Values that depend on the model's weights, the tokenizer or the clock: compared by type only.
TYPE_ONLY = frozenset(
    {
        "id",
        "request_id",
        "created",
        "token_ids",
        "prompt_token_ids",
        "content",
        "text",
        "prompt_tokens",
        "total_tokens",
        "prev_tokens",
        "prefix_offset",
        "read_offset",
        "logprob_context_token_ids",
        "logprob_text_offset",
        "system_fingerprint",
        "token",
        "logprob",
        "bytes",
        "top_logprobs",
        "stop_reason",
        "finish_reason",
        "completion_tokens",
        "tokens",
        "token_logprobs",
        "text_offset",
        "max_tokens",
        "role",
    }
)


def shape_diff(exp: Any, act: Any, path: str = "$", key: str = "") -> list[str]:
    """Where ``act`` differs from the trace's ``exp``: keys and their order, types, and the values
    that do not depend on the model (sampling params, errors, object names, usage layout)."""
    if key in TYPE_ONLY:
        if exp is None or act is None or type(exp) is type(act):
            return []
        return [f"{path}: type {type(exp).__name__} != {type(act).__name__}"]
    if type(exp) is not type(act):
        return [f"{path}: {exp!r} != {act!r}"]
    if isinstance(exp, dict):
        if list(exp) != list(act):
            return [f"{path}: keys {list(exp)} != {list(act)}"]
        return [e for k in exp for e in shape_diff(exp[k], act[k], f"{path}.{k}", k)]
    if isinstance(exp, list):
        if len(exp) != len(act):
            return [f"{path}: length {len(exp)} != {len(act)}"]
        return [
            e
            for i, (x, y) in enumerate(zip(exp, act, strict=True))
            for e in shape_diff(x, y, f"{path}[{i}]", key)
        ]
    return [] if exp == act else [f"{path}: {exp!r} != {act!r}"]


async def post(w: SimWorker, path: str, body: Any) -> tuple[int, Any]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with w.session.post(f"{w.url}{path}", data=data, headers={"Content-Type": "application/json"}) as r:
        return r.status, json.loads(await r.read())


async def sse(w: SimWorker, path: str, body: dict[str, Any]) -> list[Any]:
    async with w.session.post(f"{w.url}{path}", json=body) as r:
        assert r.status == 200, await r.text()
        assert r.headers["Content-Type"].startswith("text/event-stream")
        raw = await r.read()
    assert done(raw)
    return list(json_events(raw))


@pytest.fixture
async def sim(sim_factory: SimFactory) -> SimWorker:
    return await sim_factory(enable_scale_out=True, zero_latency=True)


# -- the recorded shapes -------------------------------------------------------------------------

REPLAYED = [p for p in OPENAI_TRACES if not p.stem.startswith(("oai-chat-split", "oai-completions-split"))]


def test_openai_traces_are_there() -> None:
    assert len(OPENAI_TRACES) >= 30


@pytest.mark.parametrize("path", REPLAYED, ids=[p.stem for p in REPLAYED])
async def test_single_exchange_matches_the_trace(path: Path, sim: SimWorker) -> None:
    trace = load_trace(path)
    (req,) = trace.requests()
    exp = trace.response("main")
    async with sim.session.post(
        f"{sim.url}{req.path}", data=req.body, headers={"Content-Type": "application/json"}
    ) as r:
        status, raw = r.status, await r.read()
        ctype = r.headers["Content-Type"]
    assert status == exp.status, raw[:300]
    if exp.header(
        "content-type",
    ).startswith("text/event-stream"):  # type: ignore[union-attr]
        assert ctype.startswith("text/event-stream")
        exp_ev = [json.loads(e) for e in exp.sse_events() if e != "[DONE]"]
        act_ev = json_events(raw)
        assert raw.decode().endswith("data: [DONE]\n\n")
        # the token-dependent middle may differ in length; the first event and the last two must agree
        for e, a in [(exp_ev[0], act_ev[0]), *zip(exp_ev[-2:], act_ev[-2:], strict=True)]:
            assert shape_diff(e, a) == [], (e, a)
        return
    assert shape_diff(exp.json(), json.loads(raw)) == []


@pytest.mark.parametrize(
    "name",
    [
        "oai-chat-split-stream",
        "oai-completions-split-stream",
        "oai-chat-split-nonstream",
        "oai-completions-split-nonstream",
        "oai-chat-split-stream-no-usage",
    ],
)
async def test_split_exchanges_match_the_trace(name: str, sim: SimWorker) -> None:
    """Each recorded render, generate (fed the render's answer as is) and derender call."""
    trace: Trace = load_trace(TRACE_DIR / "openai" / f"{name}.txt")
    for req in trace.requests():
        if req.path == "/inference/v1/generate":
            continue  # the generate contract is test_contract's
        status, act = await post(sim, req.path, req.body)
        exp = trace.response(req.label)
        assert status == exp.status
        assert shape_diff(exp.json(), act) == [], req.label


async def test_render_matches_vllm_sampling_params_exactly(sim: SimWorker) -> None:
    trace = load_trace(TRACE_DIR / "openai" / "oai-chat-render-stream.txt")
    status, act = await post(sim, CHAT + "/render", trace.requests()[0].body)
    assert status == 200
    exp = trace.response("main").json()
    assert act["sampling_params"] == exp["sampling_params"]
    assert act["request_id"] == "chatcmpl-my-id"
    assert act["stream_options"] == {"include_usage": True, "continuous_usage_stats": False}


async def test_chat_template_and_prompt_ids(sim: SimWorker) -> None:
    tok = ByteTokenizer()
    status, g = await post(sim, CHAT + "/render", {"messages": [{"role": "user", "content": "hi"}]})
    assert status == 200
    assert g["token_ids"] == tok.encode("user: hi\nassistant:")
    assert g["sampling_params"]["max_tokens"] == sim.settings.max_model_len - len(g["token_ids"])
    status, gs = await post(sim, CMPL + "/render", {"prompt": ["ab", [300, 301]]})
    assert status == 200
    assert [x["token_ids"] for x in gs] == [tok.encode("ab"), [300, 301]]
    assert gs[0]["request_id"].endswith("-0") and gs[1]["request_id"].endswith("-1")


# -- stop strings: the text ends before the matched stop string ---------------------------------


async def generated_pieces(w: SimWorker, body: dict[str, Any]) -> list[str]:
    """The text of each token the engine generates for ``body`` (chat, greedy, no stop string)."""
    status, g = await post(w, CHAT + "/render", {**body, "stop": None, "stream": False})
    assert status == 200
    status, gen = await post(w, "/inference/v1/generate", g)
    assert status == 200
    ts = TokenStrings(ByteTokenizer())
    state = seed_state(ts, g["token_ids"])
    out = []
    for tok in gen["choices"][0]["token_ids"]:
        text, state = detokenize_delta(ts, [tok], state)
        out.append(text)
    return out


async def chat_text(w: SimWorker, body: dict[str, Any], *, stream: bool) -> tuple[str, Any, Any]:
    """The aggregated answer's content, finish reason and stop reason (a stream's, concatenated)."""
    if not stream:
        status, d = await post(w, CHAT, body)
        assert status == 200, d
        c = d["choices"][0]
        return c["message"]["content"], c["finish_reason"], c["stop_reason"]
    chunks = await sse(w, CHAT, {**body, "stream": True})
    (end,) = finish_of(chunks)
    return text_of(chunks, True), *end


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("include", [False, True])
async def test_text_ends_at_the_stop_string_as_the_trace(
    sim: SimWorker, stream: bool, include: bool
) -> None:
    """oai-chat-stop.txt: vLLM 0.32 answers " " for the token " e" with stop "e": the text ends
    before the matched stop string, inside the token that completed it (after the string with
    ``include_stop_str_in_output``, the rest of that token dropped)."""
    trace = load_trace(TRACE_DIR / "openai" / "oai-chat-stop.txt")
    body = trace.requests()[0].json()
    assert body["stop"] == ["e"] and trace.response("main").json()["choices"][0]["message"]["content"] == " "
    if include:
        body["include_stop_str_in_output"] = True
    full = "".join(await generated_pieces(sim, body))
    at = full.find("e")
    assert at > 0
    want = full[: at + 1] if include else full[:at]
    assert await chat_text(sim, body, stream=stream) == (want, "stop", "e")


@pytest.mark.parametrize("stream", [False, True])
async def test_stop_string_across_tokens_is_held_back(sim: SimWorker, stream: bool) -> None:
    """A three-character stop string that starts in one token and ends in the next: a stream holds
    back two characters (``output_text_buffer_length``), so none of it is ever sent."""
    body = load_trace(TRACE_DIR / "openai" / "oai-chat-stop.txt").requests()[0].json()
    pieces = await generated_pieces(sim, body)
    full = "".join(pieces)
    stop, at = "", -1
    for j in range(len(pieces) - 1):
        cand = pieces[j][-1:] + pieces[j + 1][:2]
        start = len("".join(pieces[: j + 1])) - 1
        if len(cand) == 3 and "\ufffd" not in cand and full.find(cand) == start:
            stop, at = cand, start
            break
    assert stop, pieces
    body = {**body, "stop": [stop]}
    # A stream cannot take back what it sent: a part of the stop string sent early stays in its text.
    assert await chat_text(sim, body, stream=stream) == (full[:at], "stop", stop)


# -- render -> generate -> derender equals the aggregated answer ----------------------------------


async def split_full(w: SimWorker, ep: str, req: dict[str, Any]) -> dict[str, Any]:
    status, g = await post(w, ep + "/render", req)
    assert status == 200
    gen_req = g if ep == CHAT else g[0]
    status, gen = await post(w, "/inference/v1/generate", gen_req)
    assert status == 200
    n = len(gen_req["token_ids"])
    if ep == CHAT:
        body = {"generate_response": gen, "prompt_tokens": n, "prompt_token_ids": gen_req["token_ids"]}
    else:
        body = {"generate_responses": [gen], "prompt_tokens": [n], "prompt_token_ids": [gen_req["token_ids"]]}
    status, out = await post(w, ep + "/derender", body)
    assert status == 200
    assert isinstance(out, dict)
    return out


async def split_stream(w: SimWorker, ep: str, req: dict[str, Any]) -> list[dict[str, Any]]:
    status, g = await post(w, ep + "/render", req)
    assert status == 200
    gen_req = g if ep == CHAT else g[0]
    state = None
    chunks = []
    for ev in await sse(w, "/inference/v1/generate", gen_req):
        body = {
            "stream": True,
            "generate_chunk": ev,
            "stream_state": state,
            "prompt_tokens": len(gen_req["token_ids"]),
            "prompt_token_ids": gen_req["token_ids"],
        }
        status, d = await post(w, ep + "/derender", body)
        assert status == 200, d
        chunks.append(d["chunk"])
        state = d["stream_state"]
    return chunks


def text_of(chunks: list[dict[str, Any]], chat: bool) -> str:
    key = "content"
    out = []
    for c in chunks:
        for ch in c["choices"]:
            out.append((ch["delta"].get(key) if chat else ch["text"]) or "")
    return "".join(out)


def finish_of(chunks: list[dict[str, Any]]) -> list[Any]:
    return [
        (ch["finish_reason"], ch.get("stop_reason"))
        for c in chunks
        for ch in c["choices"]
        if ch["finish_reason"]
    ]


def before_stop(text: str, finish: Any, stop_reason: Any) -> str:
    """Derender decodes every output token, the one that completed a stop string included; the
    aggregated text ends before the string (its first occurrence: the engine stopped there)."""
    if finish == "stop" and isinstance(stop_reason, str):
        assert stop_reason in text
        return text[: text.find(stop_reason)]
    return text


CASES = [
    {"max_tokens": 12, "temperature": 0},
    {"max_tokens": 30, "temperature": 0.8, "seed": 5},
    {"max_tokens": 40, "temperature": 0, "stop": ["e", "a"]},
    {"max_tokens": 5, "temperature": 0, "logprobs": True, "top_logprobs": 2},
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("ep", [CHAT, CMPL])
async def test_split_nonstream_equals_aggregated(sim: SimWorker, ep: str, case: dict[str, Any]) -> None:
    req: dict[str, Any] = {"model": "tiny-llama", **case}
    if ep == CHAT:
        req["messages"] = MSGS
    else:
        req["prompt"] = "Héllo 😀 there"
        if "logprobs" in case:
            req["logprobs"] = case["top_logprobs"]
            del req["top_logprobs"]
    status, agg = await post(sim, ep, req)
    assert status == 200
    split = await split_full(sim, ep, req)
    for k in ("id", "created", "system_fingerprint"):
        agg.pop(k), split.pop(k)
    c = split["choices"][0]
    holder, key = (c["message"], "content") if ep == CHAT else (c, "text")
    holder[key] = before_stop(holder[key], c["finish_reason"], c["stop_reason"])
    assert split == agg


@pytest.mark.parametrize("usage", [True, False])
@pytest.mark.parametrize("case", CASES[:3])
@pytest.mark.parametrize("ep", [CHAT, CMPL])
async def test_split_stream_equals_aggregated(
    sim: SimWorker, ep: str, case: dict[str, Any], usage: bool
) -> None:
    req: dict[str, Any] = {"model": "tiny-llama", "stream": True, **case}
    if usage:
        req["stream_options"] = {"include_usage": True}
    chat = ep == CHAT
    if chat:
        req["messages"] = MSGS
    else:
        req["prompt"] = "Héllo 😀 there"
    agg = await sse(sim, ep, req)
    split = await split_stream(sim, ep, req)
    assert finish_of(split) == finish_of(agg) and len(finish_of(agg)) == 1
    assert before_stop(text_of(split, chat), *finish_of(split)[0]) == text_of(agg, chat) != ""
    agg_usage = [c["usage"] for c in agg if c.get("usage")]
    split_usage = [c["usage"] for c in split if c.get("usage")]
    if usage:
        assert len(agg_usage) == len(split_usage) == 1
        assert {k: split_usage[0][k] for k in agg_usage[0]} == agg_usage[0]
        assert agg_usage[0]["prompt_tokens"] > 0
    else:
        assert agg_usage == split_usage == []
    _, full = await post(sim, ep, {**req, "stream": False, "stream_options": None})
    assert text_of(agg, chat) == (
        full["choices"][0]["message"]["content"] if chat else full["choices"][0]["text"]
    )


async def test_nonstream_derender_without_prompt_tokens_reports_zero(sim: SimWorker) -> None:
    """As vLLM 0.32: the generate response's own usage is ignored; prompt_tokens defaults to 0."""
    _, g = await post(sim, CHAT + "/render", {"messages": MSGS, "max_tokens": 3, "temperature": 0})
    _, gen = await post(sim, "/inference/v1/generate", g)
    assert gen["usage"]["prompt_tokens"] == len(g["token_ids"])
    _, out = await post(sim, CHAT + "/derender", {"generate_response": gen})
    assert out["usage"]["prompt_tokens"] == 0 and out["usage"]["completion_tokens"] == 3


def test_incremental_detok_equals_whole_decode() -> None:
    tok = ByteTokenizer()
    ts = TokenStrings(tok)
    prompt = tok.encode("ab é")
    out = [*tok.encode("Héllo 😀 wörld"), 300, 410, 1, 257]
    whole, _ = detokenize_delta(ts, out, seed_state(ts, prompt))
    state = seed_state(ts, prompt)
    parts = []
    for t in out:
        text, state = detokenize_delta(ts, [t], state)
        parts.append(text)
        assert len(state["prev_tokens"]) <= 8
    assert "".join(parts) == whole
    assert whole.startswith("Héllo 😀 wörld")


# -- errors --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body", "status", "message"),
    [
        (
            CHAT + "/render",
            {"messages": MSGS, "max_tokens": 3, "n": 2, "temperature": 0},
            400,
            "n must be 1 when using greedy sampling, got 2.",
        ),
        (
            CHAT + "/render",
            {"messages": [{"role": "user", "content": "x" * 600}]},
            400,
            "This model's maximum context length is 512 tokens. However, your prompt contains 617 input "
            "tokens, which exceeds this limit even without any output tokens. Please reduce the length of "
            "the input prompt. (parameter=input_tokens, value=617)",
        ),
        (
            CMPL + "/render",
            {"prompt": []},
            400,
            "Either prompt or prompt_embeds must be provided and non-empty. (parameter=prompt)",
        ),
        (
            CHAT,
            {"messages": MSGS, "model": "nope"},
            404,
            "The model `nope` does not exist. Valid aliases: tiny-llama.",
        ),
        (
            CMPL + "/derender",
            {
                "generate_responses": [{"request_id": "x", "choices": [{"index": 0, "token_ids": [3]}]}],
                "prompt_tokens": [1, 2],
            },
            400,
            "prompt_tokens length (2) must equal generate_responses length (1)",
        ),
        (
            CHAT + "/derender",
            {
                "stream": True,
                "generate_chunk": {
                    "request_id": "x",
                    "choices": [{"index": 0, "token_ids": [3]}, {"index": 1, "token_ids": [4]}],
                },
            },
            400,
            "derender_chat_stream expects at most one choice per chunk (got 2).",
        ),
    ],
)
async def test_errors_in_vllm_shape(sim: SimWorker, path: str, body: Any, status: int, message: str) -> None:
    got, data = await post(sim, path, body)
    assert got == status
    assert list(data) == ["error"] and list(data["error"]) == ["message", "type", "param", "code"]
    assert data["error"]["message"] == message and data["error"]["code"] == status


async def test_errors_of_the_aggregated_path_hold_nothing(sim: SimWorker) -> None:
    got, data = await post(sim, CHAT, {"messages": MSGS, "max_tokens": 600})
    assert got == 400 and data["error"]["param"] == "max_tokens"
    state = await sim.state()
    assert state["inflight"] == []


async def test_tokens_only_worker_refuses_render(sim_factory: SimFactory) -> None:
    w = await sim_factory(enable_scale_out=False, tokens_only=True, zero_latency=True)
    got, data = await post(w, CHAT + "/render", {"messages": MSGS})
    assert got == 400 and data["error"]["type"] == "BadRequestError"


async def test_wrong_content_type(sim: SimWorker) -> None:
    async with sim.session.post(
        f"{sim.url}{CHAT}/render", data=b"{}", headers={"Content-Type": "text/plain"}
    ) as r:
        assert r.status == 400
        assert (await r.json())["error"]["type"] == "Bad Request"


async def test_aggregated_stream_client_disconnect_aborts(sim_factory: SimFactory) -> None:
    w = await sim_factory(enable_scale_out=True, itl_ms=20.0, prefill_base_ms=0.0, prefill_per_token_ms=0.0)
    body = {"messages": MSGS, "stream": True, "max_tokens": 400}
    async with aiohttp.ClientSession() as s, s.post(f"{w.url}{CHAT}", json=body) as r:
        await r.content.readline()
    for _ in range(200):
        if not (await w.state())["inflight"]:
            break
        await asyncio.sleep(0.02)
    assert (await w.state())["inflight"] == []
