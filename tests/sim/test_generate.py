"""pd-sim's /inference/v1/generate surface in tokens mode: shapes, ids, aborts, disconnects, keys."""

from __future__ import annotations

import asyncio
import re

import aiohttp

from tests import sse
from tests.fixtures_sim import SimFactory
from tests.sim.helpers import ABORT, GEN, body, eventually, post_json, stream_events, stream_tokens

NONSTREAM_KEYS = [
    "request_id",
    "model",
    "created",
    "usage",
    "prompt_logprobs",
    "prompt_token_id_logprobs",
    "prompt_token_ids",
    "mm_placeholders",
    "metrics",
    "kv_transfer_params",
    "ec_transfer_params",
    "output_mode",
    "choices",
]
CHOICE_KEYS = [
    "index",
    "finish_reason",
    "stop_reason",
    "token_ids",
    "routed_experts",
    "sampling_mask",
    "weight_versions",
    "logprobs",
]


async def test_nonstream_shape_and_determinism(sim_factory: SimFactory) -> None:
    w = await sim_factory(zero_latency=True)
    async with aiohttp.ClientSession() as s:
        st, a = await post_json(s, w.url + GEN, body(max_tokens=6, request_id="r1"))
        st2, b = await post_json(s, w.url + GEN, body(max_tokens=6, request_id="r2"))
    assert st == st2 == 200
    assert list(a) == NONSTREAM_KEYS
    assert list(a["choices"][0]) == CHOICE_KEYS
    assert a["request_id"] == "generate-tokens-r1"
    assert a["usage"] == {
        "prompt_tokens": 7,
        "total_tokens": 13,
        "completion_tokens": 6,
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }
    assert a["choices"][0]["finish_reason"] == "length"
    assert a["choices"][0]["weight_versions"] == [{"version": "default", "start": 0, "end": 6}]
    assert len(a["choices"][0]["token_ids"]) == 6
    assert a["choices"][0]["token_ids"] == b["choices"][0]["token_ids"]


async def test_stream_framing_and_usage(sim_factory: SimFactory) -> None:
    w = await sim_factory(zero_latency=True)
    async with aiohttp.ClientSession() as s:
        evs = await stream_events(
            s, w.url + GEN, body(max_tokens=5, stream=True, stream_options={"include_usage": True})
        )
        cont = await stream_events(
            s,
            w.url + GEN,
            body(
                max_tokens=3,
                stream=True,
                stream_options={"include_usage": True, "continuous_usage_stats": True},
            ),
        )
        only_cont = await stream_events(
            s, w.url + GEN, body(max_tokens=2, stream=True, stream_options={"continuous_usage_stats": True})
        )
        _, full = await post_json(s, w.url + GEN, body(max_tokens=5))
    assert evs[-1] == "[DONE]"
    assert len(evs) == 7  # 5 token chunks, the usage chunk, [DONE]
    assert [list(e) for e in evs[:5]] == [["request_id", "usage", "output_mode", "choices"]] * 5
    assert all(e["usage"] is None and len(e["choices"][0]["token_ids"]) == 1 for e in evs[:5])
    assert [e["choices"][0]["finish_reason"] for e in evs[:5]] == [None] * 4 + ["length"]
    assert evs[4]["choices"][0]["weight_versions"] == [{"version": "default", "start": 0, "end": 5}]
    assert evs[5] == {
        "request_id": evs[0]["request_id"],
        "usage": {"prompt_tokens": 7, "total_tokens": 12, "completion_tokens": 5},
        "output_mode": "tokens",
        "choices": [],
    }
    assert stream_tokens(evs) == full["choices"][0]["token_ids"]
    assert [e["usage"]["completion_tokens"] for e in cont[:3]] == [1, 2, 3]
    assert list(cont[0]["usage"]) == [
        "prompt_tokens",
        "total_tokens",
        "completion_tokens",
        "prompt_tokens_details",
        "completion_tokens_details",
    ]
    assert all(e["usage"] is None for e in only_cont[:2]) and len(only_cont) == 3


async def test_each_sse_event_is_its_own_http_chunk(sim_factory: SimFactory) -> None:
    w = await sim_factory(zero_latency=True)
    async with aiohttp.ClientSession() as s, s.post(w.url + GEN, json=body(max_tokens=4, stream=True)) as r:
        chunks = [data async for data, _ in r.content.iter_chunks()]
    # aiohttp's client may merge HTTP chunks that arrive together, never split an event across two.
    joined = b"".join(chunks)
    assert joined.count(b"data: ") == 5
    assert all(c.endswith(b"\n\n") for c in chunks if c)


async def test_request_id_rules(sim_factory: SimFactory) -> None:
    w = await sim_factory(zero_latency=True)
    async with aiohttp.ClientSession() as s:
        _, hdr = await post_json(s, w.url + GEN, body(request_id="body"), headers={"X-Request-Id": "hdr"})
        _, bod = await post_json(s, w.url + GEN, body(request_id="body"))
        _, empty = await post_json(s, w.url + GEN, body(request_id=""))
        _, neither = await post_json(s, w.url + GEN, body())
    assert hdr["request_id"] == "generate-tokens-hdr"
    assert bod["request_id"] == "generate-tokens-body"
    assert empty["request_id"] == "generate-tokens-"
    assert re.fullmatch(r"generate-tokens-[0-9a-f]{16}", neither["request_id"])


async def test_request_id_headers_flag(sim_factory: SimFactory) -> None:
    w = await sim_factory(zero_latency=True, enable_request_id_headers=True)
    async with aiohttp.ClientSession() as s:
        async with s.post(w.url + GEN, json=body(), headers={"X-Request-Id": "h1"}) as r:
            assert r.headers["x-request-id"] == "h1"
        async with s.post(w.url + GEN, json=body(token_ids=[])) as r:
            assert r.status == 400
            assert re.fullmatch(r"[0-9a-f]{32}", r.headers["x-request-id"])


async def test_max_tokens_defaults_and_caps_to_model_len(sim_factory: SimFactory) -> None:
    w = await sim_factory(zero_latency=True, max_model_len=40)
    async with aiohttp.ClientSession() as s:
        _, a = await post_json(s, w.url + GEN, body(max_tokens=None))
        _, b = await post_json(s, w.url + GEN, body(max_tokens=1000))
        st, c = await post_json(s, w.url + GEN, body(tokens=list(range(3, 50))))
        st_eq, eq = await post_json(s, w.url + GEN, body(tokens=list(range(3, 43))))
    assert a["usage"]["completion_tokens"] == 33
    assert b["usage"]["completion_tokens"] == 33
    assert st == 400 and "longer than the maximum model length of 40" in c["error"]["message"]
    assert st_eq == 400 and "(length 40) plus the number of requested output tokens" in eq["error"]["message"]


async def test_abort_in_flight_stream_and_nonstream(sim_factory: SimFactory) -> None:
    w = await sim_factory(itl_ms=5.0, prefill_base_ms=0.0)
    async with aiohttp.ClientSession() as s:
        async with s.post(
            w.url + GEN, json=body(max_tokens=400, stream=True, request_id="ab1", sp={"ignore_eos": True})
        ) as r:
            first = await r.content.readuntil(b"\n\n")
            assert b'"token_ids":[' in first
            st, _ = await post_json(s, w.url + ABORT, {"request_ids": ["generate-tokens-ab1"]})
            assert st == 200
            rest = await r.read()
        events = sse.events(rest)
        assert events[-1] == sse.DONE
        assert b'"finish_reason":"abort"' in events[-2] and b'"token_ids":[]' in events[-2]

        task = asyncio.ensure_future(post_json(s, w.url + GEN, body(max_tokens=400, request_id="ab2")))

        async def running() -> bool:  # and has a token: the abort must cut it mid-way (a loaded
            # CI machine once aborted it registered but before its first token)
            return any(r["request_id"] == "generate-tokens-ab2" and r["output_tokens"] > 0
                       for r in (await w.state())["inflight"])

        assert await eventually(running)
        await post_json(s, w.url + ABORT, {"request_ids": "generate-tokens-ab2"})  # a bare string works too
        st, res = await task
    assert st == 200
    assert res["choices"][0]["finish_reason"] == "abort"
    assert res["kv_transfer_params"] is None
    assert 0 < len(res["choices"][0]["token_ids"]) < 400


async def test_abort_endpoint_errors(sim_factory: SimFactory) -> None:
    w = await sim_factory(zero_latency=True)
    async with aiohttp.ClientSession() as s:
        st, missing = await post_json(s, w.url + ABORT, {"ids": ["x"]})
        async with s.post(
            w.url + ABORT, data=b"not json{", headers={"Content-Type": "application/json"}
        ) as r:
            bad = (r.status, await r.json())
        st_unknown, _ = await post_json(s, w.url + ABORT, {"request_ids": ["nope"]})
        async with s.post(w.url + "/abort_requests", json={"request_ids": []}) as r:
            legacy = (r.status, await r.json())
    assert (st, missing) == (
        400,
        {
            "error": {
                "message": "Missing 'request_ids' in request body",
                "type": "Bad Request",
                "param": None,
                "code": 400,
            }
        },
    )
    assert bad == (
        400,
        {
            "error": {
                "message": "JSON decode error: Expecting value: line 1 column 1 (char 0)",
                "type": "Bad Request",
                "param": None,
                "code": 400,
            }
        },
    )
    assert st_unknown == 200
    assert legacy == (404, {"detail": "Not Found"})


async def test_client_disconnect_aborts(sim_factory: SimFactory) -> None:
    w = await sim_factory(itl_ms=5.0, prefill_base_ms=0.0)
    async with aiohttp.ClientSession() as s:
        r = await s.post(w.url + GEN, json=body(max_tokens=400, stream=True, sp={"ignore_eos": True}))
        await r.content.readuntil(b"\n\n")
        assert (await w.state())["inflight"]
        r.close()  # drop the connection mid-stream

        task = asyncio.ensure_future(s.post(w.url + GEN, json=body(max_tokens=400, request_id="ns")))

        async def has_ns() -> bool:
            return any(x["request_id"] == "generate-tokens-ns" for x in (await w.state())["inflight"])

        assert await eventually(has_ns)
        task.cancel()  # non-stream client gives up

        async def idle() -> bool:
            st = await w.state()
            return not st["inflight"] and st["kv_blocks_used"] == 0 and st["running"] == 0

        assert await eventually(idle)


async def test_api_key_guards_what_vllm_guards(sim_factory: SimFactory) -> None:
    w = await sim_factory(zero_latency=True, tokens_only=True, enable_scale_out=False, api_key="k")
    good = {"Authorization": "Bearer k"}
    async with aiohttp.ClientSession() as s:
        assert await post_json(s, w.url + GEN, body()) == (401, {"error": "Unauthorized"})
        assert await post_json(s, w.url + GEN, body(), {"Authorization": "Bearer no"}) == (
            401,
            {"error": "Unauthorized"},
        )
        assert (await post_json(s, w.url + GEN, body(), good))[0] == 200
        assert (await post_json(s, w.url + ABORT, {"request_ids": []}))[0] == 401
        assert (await post_json(s, w.url + ABORT, {"request_ids": []}, good))[0] == 200
        assert (await post_json(s, w.url + "/abort_requests", {"request_ids": []}))[0] == 200
        async with s.get(w.url + "/health") as r:
            assert r.status == 200
        async with s.get(w.url + "/metrics") as r:
            assert r.status == 200 and "vllm:num_requests_running" in await r.text()
        async with s.get(w.url + "/v1/models") as r:
            assert r.status == 401


async def test_403_without_scale_out_or_tokens_only(sim_factory: SimFactory) -> None:
    w = await sim_factory(zero_latency=True, enable_scale_out=False, tokens_only=False)
    async with aiohttp.ClientSession() as s:
        st, res = await post_json(s, w.url + GEN, body())
    assert st == 403 and res["error"]["type"] == "PermissionDeniedError"


async def test_validation_errors_match_vllm(sim_factory: SimFactory) -> None:
    w = await sim_factory(zero_latency=True)
    async with aiohttp.ClientSession() as s:
        st, e = await post_json(s, w.url + GEN, {"token_ids": [], "sampling_params": {"max_tokens": 2}})
        st2, e2 = await post_json(s, w.url + GEN, body(sp={"max_tokens": 0}))
        st3, e3 = await post_json(s, w.url + GEN, body(sp={"max_tokens": 3, "min_tokens": 5}))
        st4, e4 = await post_json(s, w.url + GEN, body(tokens=[260, 520]))
        async with s.post(
            w.url + GEN,
            data=b'{"token_ids":[1],"sampling_params":{}}',
            headers={"Content-Type": "text/plain"},
        ) as r:
            st5, e5 = r.status, await r.json()
    assert st == 400 and e["error"]["param"] == "body.token_ids" and e["error"]["type"] == "Bad Request"
    assert e["error"]["message"].startswith(
        "1 validation error:\n  {'type': 'too_short', 'loc': 'body.token_ids'"
    )
    assert (st2, e2["error"]) == (
        400,
        {
            "message": "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)",
            "type": "BadRequestError",
            "param": "max_tokens",
            "code": 400,
        },
    )
    assert st3 == 400
    assert e3["error"]["message"] == "min_tokens must be less than or equal to max_tokens=3, got 5."
    assert st4 == 400
    assert e4["error"]["message"] == "Token id 520 is out of vocabulary"
    assert st5 == 400 and e5["error"]["param"] is None and "Unsupported Media Type" in e5["error"]["message"]
    assert (await w.state())["inflight"] == []


async def test_sampling_params_checks_run_while_parsing(sim_factory: SimFactory) -> None:
    w = await sim_factory(zero_latency=True)
    async with aiohttp.ClientSession() as s:
        # vLLM's SamplingParams errors escape pydantic: they win over other fields' errors
        _, a = await post_json(s, w.url + GEN, {"token_ids": [], "sampling_params": {"max_tokens": 0}})
        _, b = await post_json(s, w.url + GEN, body(max_tokens=None, sp={"min_tokens": 20}))
        _, c = await post_json(s, w.url + GEN, body(sp={"temperature": 3}))
        _, d = await post_json(s, w.url + GEN, body(sp={"stop": ["x"], "detokenize": False}))
        _, e = await post_json(s, w.url + GEN, body(sp={"max_tokens": "many"}))
    assert a["error"]["type"] == "BadRequestError" and a["error"]["param"] == "max_tokens"
    assert b["error"]["message"] == "min_tokens must be less than or equal to max_tokens=16, got 20."
    assert c["error"] == {
        "message": "temperature must be in [0, 2], got 3.0. (parameter=temperature, value=3.0)",
        "type": "BadRequestError",
        "param": "temperature",
        "code": 400,
    }
    assert d["error"]["message"].startswith("stop strings are only supported when detokenize is True")
    assert e["error"]["type"] == "Bad Request" and e["error"]["param"] == "body.sampling_params.max_tokens"
