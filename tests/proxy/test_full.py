"""proxy.walk.full: the non-stream decode. D's reply goes to the client as D's own bytes with what only
P knows spliced in; the lease ends when D answered; a failed decode is retried (through
``proxy.walk.decode``) or raised after the clean-up took over P's KV."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from proxy.fleet import BYPASS_HEADER
from proxy.observe.state import Phase
from proxy.walk.flight import Flight
from proxy.wire.errors import UpstreamProtocolError, UpstreamStatusError
from proxy.wire.protocol import compact_json
from tests.proxy.parts import (
    D_URLS,
    P_URLS,
    Call,
    Walk,
    count,
    decode_reply,
    decoding,
    finished,
    hold,
    make_core,
    make_flight,
    sample,
    worker,
)
from tests.proxy.scripted import KV_PARAMS, prefill_reply

REQUEST = make_mocked_request("POST", "/inference/v1/generate")


def status(code: int) -> UpstreamStatusError:
    return UpstreamStatusError("decode", "d", code, b'{"error":{"message":"no"}}', "application/json")


def raw_reply(call: Call) -> bytes:
    """D's bytes as no encoder of the proxy's would write them (a space after a colon, 1.50)."""
    text = json.dumps(decode_reply(call.body, metrics=1.5), separators=(",", ":"))
    return text.replace('"created":1', '"created": 1').replace('"metrics":1.5', '"metrics":1.50').encode()


async def test_ds_reply_goes_out_as_its_own_bytes_and_the_lease_ends_pulled() -> None:
    core, up, _ = make_core(report_cached_tokens=False)
    walk = Walk.over(core)
    f = make_flight(core)
    f.headers["X-Request-Id"] = "client-1"
    kv = hold(core, f, worker(core, P_URLS[0]))
    d, body = await decoding(core, f, kv)
    sent: list[bytes] = []

    def answer(call: Call) -> bytes:
        sent.append(raw_reply(call))
        return sent[-1]

    up.script("decode", answer)
    resp = await walk.full.decode(f, d, body, REQUEST)
    assert isinstance(resp, web.Response) and resp.body == sent[0]
    assert up.calls[0].body["kv_transfer_params"] == kv
    assert resp.headers["X-Request-Id"] == "client-1" and "decode_ttft;dur=" in resp.headers["Server-Timing"]
    assert f.record.lease is not None and f.record.lease.reason == "pulled"
    assert f.record.phase is Phase.DONE and f.settled.is_set() and d.inflight == 0
    assert f.completion_tokens == 4 and f.timing.first_token is not None
    assert sample(core, "pd_proxy_tpot_seconds_count") == 1
    assert sample(core, "pd_proxy_ttft_seconds_count") == 1


async def test_a_request_aborted_while_d_answered_ends_its_lease_aborted() -> None:
    core, up, _ = make_core()
    walk = Walk.over(core)
    f = make_flight(core)
    d, body = await decoding(core, f, hold(core, f, worker(core, P_URLS[0])))

    def abort_then_answer(call: Call) -> dict[str, Any]:
        core.note_abort(f, "client_call")
        return decode_reply(call.body)

    up.script("decode", abort_then_answer)
    resp = await walk.full.decode(f, d, body, REQUEST)
    assert resp.status == 200
    assert f.record.lease is not None and f.record.lease.reason == "aborted"


async def test_an_aborted_request_whose_decode_hangs_gets_the_aborted_answer_and_the_hop_goes_on() -> None:
    core, up, _ = make_core(abort_grace=0.01)
    walk = Walk.over(core)
    f = make_flight(core)
    f.client_id = "r1"
    d, body = await decoding(core, f, hold(core, f, worker(core, P_URLS[0])))
    answer: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    up.script("decode", answer)
    decode = asyncio.create_task(walk.full.decode(f, d, body, REQUEST))
    await asyncio.wait_for(up.sent(), 5)
    core.note_abort(f, "client_call")
    resp = await asyncio.wait_for(decode, 5)
    assert isinstance(resp, web.Response) and isinstance(resp.body, bytes)
    assert json.loads(resp.body)["choices"][0]["finish_reason"] == "abort"
    # the hop outlives the handler: the clean-up (which owns the request now) awaits it
    assert f.record.phase is Phase.DECODING and f.decode_task is not None and not f.decode_task.done()
    answer.set_result(decode_reply(up.calls[0].body))
    await asyncio.wait_for(f.decode_task, 5)
    assert d.inflight == 0 and f.settled.is_set()


async def test_ds_answer_in_another_output_mode_is_a_protocol_error() -> None:
    core, up, _ = make_core()
    walk = Walk.over(core)
    f = make_flight(core)
    d, body = await decoding(core, f)
    up.script("decode", lambda c: decode_reply(c.body, output_mode="text"))
    with pytest.raises(UpstreamProtocolError, match="output_mode 'text'"):
        await walk.full.decode(f, d, body, REQUEST)
    assert count(core.metrics.upstream_errors, pool="decode", worker=d.url, error="protocol") == 1


async def test_a_decode_failure_is_retried_on_another_decode_worker_with_the_same_kv() -> None:
    core, up, _ = make_core(1, 2, pools={"decode_attempts": 2})
    walk = Walk.over(core)
    f = make_flight(core)
    kv = hold(core, f, worker(core, P_URLS[0]))
    d, body = await decoding(core, f, kv)
    up.script("decode", status(503))
    resp = await walk.full.decode(f, d, body, REQUEST)
    assert resp.status == 200
    assert up.to("decode") == [D_URLS[0], D_URLS[1]]
    assert [c.body.get("kv_transfer_params") for c in up.calls] == [kv, kv]
    assert f.record.decode_worker is worker(core, D_URLS[1])
    assert f.record.lease is not None and f.record.lease.reason == "pulled"
    assert all(worker(core, u).inflight == 0 for u in D_URLS)


async def test_a_4xx_from_d_is_raised_once_the_release_of_ps_kv_started() -> None:
    core, up, _ = make_core()
    walk = Walk.over(core)
    f = make_flight(core)
    d, body = await decoding(core, f, hold(core, f, worker(core, P_URLS[0])))
    up.script("decode", status(400))
    with pytest.raises(UpstreamStatusError) as raised:
        await walk.full.decode(f, d, body, REQUEST)
    assert raised.value.passthrough and f.record.phase is Phase.DONE
    assert f.release_task is not None
    await f.release_task
    assert [c.worker for c in up.releases] == [D_URLS[0]]
    assert f.record.lease is not None and f.record.lease.reason == "aborted"


async def test_a_5xx_from_d_releases_ps_kv_through_the_other_decode_worker() -> None:
    core, up, _ = make_core(1, 2)
    walk = Walk.over(core)
    f = make_flight(core)
    d, body = await decoding(core, f, hold(core, f, worker(core, P_URLS[0])))
    up.script("decode", status(503))
    with pytest.raises(UpstreamStatusError):
        await walk.full.decode(f, d, body, REQUEST)
    assert f.release_task is not None
    await f.release_task
    assert [c.worker for c in up.releases] == [D_URLS[1]]


# ------------------------------------------------------------------ what only P knows


async def flight_after(core_kw: dict[str, Any], p_reply: dict[str, Any] | BaseException | None,
                       **body: Any) -> tuple[Walk, Flight]:
    core, _, _ = make_core(**core_kw)
    f = make_flight(core, **body)
    if p_reply is not None:
        f.prefill_task = await finished(p_reply)
    return Walk.over(core), f


def d_reply(details: Any = None, *, written: bool = True, **extra: Any) -> tuple[dict[str, Any], bytes]:
    reply = decode_reply({"token_ids": [1, 2], "request_id": "r1"}, **extra)
    if written:
        reply["usage"]["prompt_tokens_details"] = details
    else:
        del reply["usage"]["prompt_tokens_details"]
    # D's spelling, not the proxy's: a space after one colon
    raw = json.dumps(reply, separators=(",", ":")).replace('"created":1', '"created": 1').encode()
    return json.loads(raw), raw


def p_reply(cached: int = 0, details: Any = None, **extra: Any) -> dict[str, Any]:
    reply = prefill_reply({"token_ids": [1, 2], "request_id": "r1"},
                          {**KV_PARAMS, "remote_prefill_cached_tokens": cached}, **extra)
    reply["usage"]["prompt_tokens_details"] = details
    return reply


async def test_ps_cached_tokens_are_spliced_into_ds_own_bytes() -> None:
    walk, f = await flight_after({}, p_reply(cached=128))
    reply, raw = d_reply()
    out = walk.full.merge_prefill_info(f, reply, raw)
    assert out == raw.replace(b'"prompt_tokens_details":null',
                              b'"prompt_tokens_details":{"cached_tokens":128}')


async def test_ps_own_usage_details_win_over_its_transfer_params() -> None:
    walk, f = await flight_after({}, p_reply(cached=128, details={"cached_tokens": 64}))
    reply, raw = d_reply()
    out = walk.full.merge_prefill_info(f, reply, raw)
    assert json.loads(out)["usage"]["prompt_tokens_details"] == {"cached_tokens": 64}


async def test_ps_cached_tokens_are_added_where_d_wrote_no_details() -> None:
    walk, f = await flight_after({}, p_reply(cached=128))
    reply, raw = d_reply(written=False)
    out = walk.full.merge_prefill_info(f, reply, raw)
    assert out == compact_json({**reply, "usage": {**reply["usage"],
                                                   "prompt_tokens_details": {"cached_tokens": 128}}})


async def test_ps_prompt_logprobs_replace_ds() -> None:
    plp = [None, {"12": {"logprob": -6.0, "rank": 102}}]
    p = p_reply(cached=0, prompt_logprobs=plp, prompt_token_id_logprobs=[[-1.0]])
    walk, f = await flight_after({}, p, sp={"prompt_logprobs": 1})
    reply, raw = d_reply(details={"cached_tokens": 0})
    out = json.loads(walk.full.merge_prefill_info(f, reply, raw))
    assert out["prompt_logprobs"] == plp and out["prompt_token_id_logprobs"] == [[-1.0]]
    assert out["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}  # D's own


@pytest.mark.parametrize("case", ["no_prefill", "prefill_failed", "decode_only", "not_reported",
                                  "none_cached", "d_reported"])
async def test_ds_bytes_are_untouched_when_p_adds_nothing(case: str) -> None:
    p: dict[str, Any] | BaseException | None = p_reply(cached=0 if case == "none_cached" else 128)
    if case == "no_prefill":
        p = None
    if case == "prefill_failed":
        p = status(503)
    walk, f = await flight_after({"report_cached_tokens": case != "not_reported"}, p)
    if case == "decode_only":
        f.headers[BYPASS_HEADER] = "prefill_error"
    reply, raw = d_reply(details={"cached_tokens": 5} if case == "d_reported" else None)
    assert walk.full.merge_prefill_info(f, reply, raw) is raw
