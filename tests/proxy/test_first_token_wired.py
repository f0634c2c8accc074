"""The prefill worker's first token streamed at once (``--first-token-from-prefill on``, issue 19),
through pd-proxy against pd-sim: the client's stream is the aggregated worker's, event for event,
while its first chunk came from P before the decode hop (``first_to_second`` in its timing)."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest

from proxy.pools import PoolSettings
from tests.fixtures_sim import SimFactory
from tests.proxy.conftest import PD, PDFactory, ProxyFactory, req, sse_datas
from tests.proxy.scripted import Scripted, ScriptedFactory, SSEBytes, prefill_reply
from tests.proxy.test_generate import trace_stream
from tests.proxy.test_sim_fields import reference, volatile

ON = {"first_token_from_prefill": True}
PROMPT = [65, 66, 67, 68, 69]
"""Greedy on pd-sim: 290 ("ca"), 264 ("lazy"), 331 (" jihele"), ... (whole characters)."""


def r(**kw: Any) -> dict[str, Any]:
    return req(token_ids=PROMPT, **kw)

TIMED = {"X-PD-Timing": "1"}

CASES: dict[str, dict[str, Any]] = {
    "greedy-tokens": r(),
    "greedy-text": r(output_mode="text"),
    "seeded-tokens": r(sp={"temperature": 0.8, "top_p": 0.9, "top_k": 20, "seed": 3}),
    "seeded-text": r(output_mode="text", sp={"temperature": 0.9, "seed": 11}),
    "text-stop-strings": r(output_mode="text", sp={"max_tokens": 30, "stop": ["e", "a"]}),
    "text-stop-include": r(output_mode="text",
                             sp={"max_tokens": 30, "stop": ["e"], "include_stop_str_in_output": True}),
    "stop-token-ids": r(sp={"max_tokens": 30, "stop_token_ids": [300, 301, 302]}),
    "min-tokens": r(sp={"max_tokens": 12, "min_tokens": 10}),
    "min-tokens-1": r(sp={"max_tokens": 12, "min_tokens": 1}),
    "min-tokens-masks-a-stop-token": r(sp={"max_tokens": 6, "min_tokens": 1, "stop_token_ids": [290]}),
    "logprobs-tokens": r(sp={"logprobs": 2}),
    "logprobs-text": r(output_mode="text", sp={"logprobs": 2}),
    "return-token-ids": r(return_token_ids=True),
    "ignore-eos": r(sp={"ignore_eos": True, "max_tokens": 5}),
    "stop-string-on-2": r(output_mode="text", sp={"max_tokens": 8, "stop": ["z"]}),
    "stop-string-across-1-and-2": r(output_mode="text", sp={"max_tokens": 8, "stop": ["al"]}),
    "stop-string-held-back": r(output_mode="text", sp={"max_tokens": 8, "stop": ["la", "qq"]}),
    "stop-token-on-2": r(sp={"max_tokens": 8, "stop_token_ids": [264]}),
    "n2-seeded": r(sp={"n": 2, "temperature": 1.0, "seed": 7}),
    "n3-seeded-text": r(output_mode="text", sp={"n": 3, "temperature": 0.7, "seed": 5, "logprobs": 1}),
    "continuous-usage": r(stream_options={"include_usage": True, "continuous_usage_stats": True}),
}


async def stream(pd: PD, body: dict[str, Any], **kw: Any) -> tuple[int, list[Any], str]:
    """Status, parsed data events, and the server-timing comment."""
    r = await pd.client.post("/inference/v1/generate", json={**body, "stream": True}, headers=TIMED, **kw)
    raw = await r.read()
    timing = next((line for line in raw.decode().splitlines() if line.startswith(": server-timing")), "")
    return r.status, sse_datas(raw), timing


async def stream_and_reference(pd: PD, sim_factory: SimFactory, body: dict[str, Any], *,
                               usage: bool = False) -> tuple[int, int, list[Any], list[Any], str]:
    """``body`` streamed through the proxy and through one aggregated pd-sim (``usage``: with
    ``include_usage``): both statuses, both event lists, and the proxy's Server-Timing line."""
    if usage:
        body = {**body, "stream_options": {"include_usage": True}}
    status, got, timing = await stream(pd, body)
    want_status, want = await reference(sim_factory, body, True, {})
    return status, want_status, got, want, timing


@pytest.mark.parametrize("usage", [False, True], ids=["plain", "usage"])
@pytest.mark.parametrize("name", list(CASES))
async def test_stream_is_the_aggregated_workers_with_ps_token_first(
        pd_factory: PDFactory, sim_factory: SimFactory, name: str, usage: bool) -> None:
    pd = await pd_factory(**ON)
    status, want_status, got, want, timing = await stream_and_reference(
        pd, sim_factory, {**CASES[name], "request_id": f"ft-{name}"}, usage=usage)
    assert status == want_status == 200
    assert volatile(got) == volatile(want)
    assert "first_to_second;dur=" in timing  # token 1 was P's, written before the decode hop
    await pd.quiet()


@pytest.mark.parametrize("mode", ["tokens", "text"])
@pytest.mark.parametrize("n", [1, 2])
async def test_unseeded_sampling_gets_one_seed_for_both_hops(pd_factory: PDFactory, mode: str,
                                                             n: int) -> None:
    """No seed: P and D draw the same token 1 (a generated seed on both hops), so every choice
    is a whole sample: no token 1 twice, none missing, no mismatch."""
    pd = await pd_factory(**ON)
    body = {**r(output_mode=mode, sp={"n": n, "temperature": 1.0, "max_tokens": 8}),
            "stream_options": {"include_usage": True}}
    for _ in range(3):
        status, got, timing = await stream(pd, body)
        assert status == 200 and "first_to_second;dur=" in timing
        per = [[t for e in got if isinstance(e, dict) for c in e["choices"] if c["index"] == i
                for t in c["token_ids"]] for i in range(n)]
        assert [len(ids) for ids in per] == [8] * n
        assert got[-2]["usage"]["completion_tokens"] == 8 * n
    assert await metric(pd, "pd_proxy_first_token_mismatch_total") == 0
    await pd.quiet()


FINISH_AT_P: dict[str, dict[str, Any]] = {
    "max-tokens-1": r(sp={"max_tokens": 1}),
    "max-tokens-1-text": r(output_mode="text", sp={"max_tokens": 1, "logprobs": 1}),
    "stop-token-on-1": r(sp={"max_tokens": 8, "stop_token_ids": [290]}),
    "stop-string-on-1": r(output_mode="text", sp={"max_tokens": 8, "stop": ["a"]}),
}


@pytest.mark.parametrize("usage", [False, True], ids=["plain", "usage"])
@pytest.mark.parametrize("name", list(FINISH_AT_P))
async def test_ps_token_that_ends_the_request_ends_the_stream_without_a_decode_hop(
        pd_factory: PDFactory, sim_factory: SimFactory, name: str, usage: bool) -> None:
    pd = await pd_factory(**ON)
    status, want_status, got, want, timing = await stream_and_reference(
        pd, sim_factory, {**FINISH_AT_P[name], "request_id": f"fp-{name}"}, usage=usage)
    assert status == want_status == 200
    assert volatile(got) == volatile(want)
    assert got[-2 if not usage else -3]["choices"][0]["finish_reason"] in ("stop", "length")
    assert "first_to_second" in timing  # P's chunk was the client's
    decode = [(await d.state())["generate_calls"] for d in pd.decode]
    assert decode == [1]  # the KV release only (one token, thrown away): no decode hop
    await pd.quiet()  # P's KV freed, nothing left in the table
    assert (await pd.p.state())["releases"]["pulled"] == 1


async def test_turned_off_the_stream_is_the_decode_workers(pd_factory: PDFactory,
                                                          sim_factory: SimFactory) -> None:
    pd = await pd_factory(first_token_from_prefill=False)
    status, _, got, want, timing = await stream_and_reference(
        pd, sim_factory, {**r(output_mode="text"), "request_id": "off"})
    assert status == 200 and volatile(got) == volatile(want)
    assert "first_to_second" not in timing


async def test_on_by_default(pd_factory: PDFactory, sim_factory: SimFactory) -> None:
    pd = await pd_factory()
    status, _, got, want, timing = await stream_and_reference(
        pd, sim_factory, {**r(output_mode="text"), "request_id": "default"})
    assert status == 200 and volatile(got) == volatile(want)
    assert "first_to_second" in timing


async def test_first_token_reaches_the_client_while_the_decode_worker_hangs_then_ends_in_band(
        pd_factory: PDFactory) -> None:
    pd = await pd_factory(decode={"faults": {"hang_before_headers": True}}, stream_idle_timeout=0.5,
                          prefill={"lease_seconds": 0.5}, **ON)
    resp = await pd.client.post("/inference/v1/generate", json={**r(), "stream": True, "request_id": "hang"})
    assert resp.status == 200
    first = await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 30.0)
    assert json.loads(first[6:])["choices"][0]["token_ids"] == [290]  # P's token; D sent nothing
    rest = sse_datas(await resp.read())
    assert "error" in rest[0] and rest[-1] == "[DONE]"  # the headers were sent: the failure is in-band
    await pd.d.set_faults(hang_before_headers=False)
    await asyncio.sleep(0.6)
    pd.serving.expire_leases()
    await pd.quiet(limit=30.0)


async def wait_for_phase(pd: PD, phase: str) -> None:
    for _ in range(1500):  # 30 s at most
        if any(rec.phase.value == phase for rec in pd.serving.table.all()):
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"no request reached {phase}")


async def test_abort_right_after_ps_chunk_ends_the_stream_and_frees_ps_kv(pd_factory: PDFactory) -> None:
    pd = await pd_factory(hold_between_hops=10.0, **ON)
    resp = await pd.client.post("/inference/v1/generate", json={**r(), "stream": True, "request_id": "ab"})
    first = await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 30.0)
    assert json.loads(first[6:])["choices"][0]["token_ids"] == [290]
    assert (await pd.p.state())["kv_held"]
    a = await pd.client.post("/inference/v1/abort_requests", json={"request_ids": ["generate-tokens-ab"]})
    assert a.status == 200
    rest = sse_datas(await resp.read())
    assert rest[0]["choices"][0]["finish_reason"] == "abort" and rest[-1] == "[DONE]"
    assert not [t for e in rest[:-1] for c in e["choices"] for t in c["token_ids"]]
    await pd.quiet(limit=30.0)  # P's KV released, lease closed, nothing in the table or tracker
    assert (await pd.p.state())["releases"]["pulled"] == 1


async def test_disconnect_right_after_ps_chunk_frees_ps_kv(pd_factory: PDFactory) -> None:
    pd = await pd_factory(hold_between_hops=10.0, **ON)
    resp = await pd.client.post("/inference/v1/generate", json={**r(), "stream": True, "request_id": "dc"})
    await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 30.0)
    await wait_for_phase(pd, "kv_held")
    resp.close()  # the client goes away holding one token, before the decode hop
    await pd.quiet(limit=30.0)
    assert (await pd.p.state())["releases"]["pulled"] == 1


MIGRATE = PoolSettings.plain(migrate=True, breaker_failures=1)
"""One failure would open a worker's circuit: a mismatch is not the worker's failure."""


@pytest.mark.parametrize("mode", ["tokens", "text"])
async def test_mismatch_continues_from_ps_token_without_a_contradiction(
        pd_factory: PDFactory, sim_factory: SimFactory, mode: str) -> None:
    pd = await pd_factory(pools=MIGRATE, decode={"faults": {"first_token_mismatch": True}}, **ON)
    body = {**r(output_mode=mode, sp={"max_tokens": 10}), "request_id": f"mm-{mode}",
            "stream_options": {"include_usage": True}}
    status, got, _ = await stream(pd, body)
    _, want = await reference(sim_factory, body, True, {})
    assert status == 200
    assert volatile(got) == volatile(want)  # P's token kept; the rest continues from it
    assert await metric(pd, "pd_proxy_first_token_mismatch_total") == 1
    assert pd.serving.decode_pool.workers[0].breaker.opened_count == 0  # a mismatch: not its failure
    await pd.quiet()


async def test_mismatch_of_a_request_that_cannot_continue_ends_in_band(
        pd_factory: PDFactory) -> None:
    pd = await pd_factory(pools=MIGRATE, decode={"faults": {"first_token_mismatch": True}}, **ON)
    body = {**r(output_mode="text", sp={"max_tokens": 10, "stop": ["qq"]}), "request_id": "mm-stop"}
    status, got, _ = await stream(pd, body)
    assert status == 200
    assert got[0]["choices"][0]["token_ids"] == [290]
    assert "error" in got[1] and got[-1] == "[DONE]"  # never D's contradicting token
    assert [t for e in got if isinstance(e, dict) for c in e.get("choices", [])
            for t in c["token_ids"]] == [290]
    assert await metric(pd, "pd_proxy_first_token_mismatch_total") == 1
    await pd.quiet()


async def metric(pd: PD, name: str) -> float:
    text = (await (await pd.client.get("/metrics")).read()).decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith((name + " ", name + "{")))


@pytest.mark.parametrize("fault", ["fail_next", "refuse_kv_pulls"])
async def test_a_retried_or_decode_only_attempt_still_drops_token_1(
        pd_factory: PDFactory, sim_factory: SimFactory, fault: str) -> None:
    """D's open fails (a 500 before its first byte: retried) or its pull of P's KV does (the
    decode-only rescue computes the prompt itself): that attempt's token 1 is taken out too."""
    on_d = {"fail_next": 1} if fault == "fail_next" else {}
    on_p = {"refuse_kv_pulls": True} if fault == "refuse_kv_pulls" else {}
    pd = await pd_factory(pools=PoolSettings.plain(decode_attempts=2), n_decode=2,
                          decode={"faults": on_d}, prefill={"faults": on_p, "lease_seconds": 0.5}, **ON)
    body = {**r(output_mode="text", sp={"max_tokens": 6}), "request_id": f"re-{fault}"}
    status, got, timing = await stream(pd, body)
    _, want = await reference(sim_factory, body, True, {})
    assert status == 200
    assert volatile(got) == volatile(want)
    assert "first_to_second;dur=" in timing
    calls = [(await d.state())["generate_calls"] for d in pd.decode]
    assert sum(calls) >= 2  # the failed attempt did happen, another took the request
    await pd.p.set_faults(refuse_kv_pulls=False)
    await pd.quiet(limit=30.0)  # P's blocks: pulled, or freed at the end of its (short) lease


# --------------------------------------------------------- vLLM's recorded bytes (scripted workers)


def _prefill_from_trace(first: dict[str, Any], body: dict[str, Any]) -> dict[str, Any]:
    """P's one-token reply as vLLM writes it, for the trace's first token."""
    c = first["choices"][0]
    choice = {"index": 0, "finish_reason": "length", "stop_reason": None, "token_ids": c["token_ids"],
              "routed_experts": None, "sampling_mask": None,
              "weight_versions": [{"version": "default", "start": 0, "end": 1}]}
    if "text" in c:
        choice["text"] = c["text"]
    choice["logprobs"] = c["logprobs"]
    return prefill_reply(body, request_id=first["request_id"], choices=[choice])


@pytest.mark.parametrize("merged", [False, True], ids=["as-recorded", "merged-first-chunk"])
@pytest.mark.parametrize("name", ["gen-text-stream-include-usage.txt", "gen-logprobs-text-stream.txt",
                                  "gen-logprobs-tokens-stream.txt"])
async def test_the_client_gets_vllms_recorded_bytes(scripted_factory: ScriptedFactory,
                                                    proxy_factory: ProxyFactory, name: str,
                                                    merged: bool) -> None:
    """P's chunk, then D's stream without token 1, are the bytes the aggregated vLLM sent; when
    D merged tokens 1 and 2 into one chunk, token 1 is cut out of its bytes and the rest kept."""
    body, stream = trace_stream(name)
    events = stream.split(b"\n\n")[:-1]
    first = json.loads(events[0][6:])
    d_stream = stream
    if merged:
        one, two = json.loads(events[0][6:]), json.loads(events[1][6:])
        c1, c2 = one["choices"][0], two["choices"][0]
        head = events[0].replace(b'"token_ids":' + json.dumps(c1["token_ids"]).encode(),
                                 b'"token_ids":' + json.dumps(c1["token_ids"] + c2["token_ids"],
                                                              separators=(",", ":")).encode())
        if "text" in c1:
            head = head.replace(json.dumps(c1["text"]).encode(), json.dumps(c1["text"] + c2["text"]).encode())
        if c1["logprobs"] is not None:  # the content list is last: its items as recorded
            tail = b"]}}]}"
            assert head.endswith(tail) and events[1].endswith(tail)
            lp2 = events[1][events[1].index(b'"content":[') + 11 : -len(tail)]
            head = head[: -len(tail)] + b"," + lp2 + tail
        d_stream = b"\n\n".join([head, *events[2:]]) + b"\n\n"
    p: Scripted = await scripted_factory(lambda b, r: _prefill_from_trace(first, b))
    d: Scripted = await scripted_factory(lambda b, r: SSEBytes([d_stream[i : i + 7] for i in
                                                                range(0, len(d_stream), 7)]))
    client, _ = await proxy_factory([p.url], [d.url], **ON)
    r = await client.post("/inference/v1/generate", json=body)
    got = await r.read()
    assert r.status == 200
    assert p.received[0]["output_mode"] == body.get("output_mode", "tokens")
    assert got == stream
    text = (await (await client.get("/metrics")).read()).decode()
    assert 'pd_proxy_stage_seconds_count{stage="first_to_second"} 1.0' in text  # token 1 was P's


async def raw_streams(pd: PD, sim_factory: SimFactory, body: dict[str, Any],
                      **sim: Any) -> tuple[bytes, bytes]:
    """``body`` streamed through the proxy and through one aggregated pd-sim (``sim``: its
    settings): both raw bodies."""
    got = await (await pd.client.post("/inference/v1/generate", json={**body, "stream": True})).read()
    agg = await sim_factory(role="aggregated", zero_latency=True, **sim)
    want = await (await agg.session.post(agg.url + "/inference/v1/generate",
                                         json={**body, "stream": True})).read()
    return got, want


@pytest.mark.parametrize("usage", [False, True], ids=["plain", "usage"])
async def test_n2_where_one_choice_stops_at_token_1(pd_factory: PDFactory, sim_factory: SimFactory,
                                                    usage: bool) -> None:
    """Only choice 0 stops at token 1 (a stop token): the stream goes on for choice 1; choice 0's
    token and its end come in one chunk, P's, as one vLLM server sends them: the client's stream is
    the aggregated worker's, byte for byte."""
    base = r(sp={"n": 2, "temperature": 1.0, "seed": 7, "max_tokens": 6})
    _, plain = await reference(sim_factory, {**base, "request_id": "n2a"}, True, {})
    first = [next(c["token_ids"][0] for e in plain[:-1] for c in e["choices"] if c["index"] == i)
             for i in range(2)]
    assert first[0] != first[1]
    body = {**base, "request_id": "n2s", "sampling_params": {**base["sampling_params"],
                                                           "stop_token_ids": [first[0]]}}
    pd = await pd_factory(**ON)
    status, got, timing = await stream(pd, body)
    _, want = await reference(sim_factory, body, True, {})
    assert status == 200 and "first_to_second;dur=" in timing

    def per_choice(events: list[Any]) -> list[tuple[list[int], str | None]]:
        out = []
        for i in range(2):
            cs = [c for e in events if isinstance(e, dict) for c in e["choices"] if c["index"] == i]
            out.append(([t for c in cs for t in c["token_ids"]], cs[-1]["finish_reason"]))
        return out

    assert per_choice(got) == per_choice(want)
    assert per_choice(got)[0] == ([first[0]], "stop")
    if usage:
        body["stream_options"] = {"include_usage": True}
    raw, want_raw = await raw_streams(pd, sim_factory, {**body, "request_id": "n2b"})
    assert raw == want_raw
    ends = [c for e in sse_datas(raw) if isinstance(e, dict) for c in e["choices"]
            if c["index"] == 0 and c["finish_reason"] is not None]
    assert len(ends) == 1 and ends[0]["token_ids"] == [first[0]]  # one chunk: the token and its end
    await pd.quiet()


async def model_lens_known(pd: PD) -> list[int | None]:
    """The decode workers' model lengths, once the proxy learned them (bounded wait)."""
    for _ in range(500):
        lens = [getattr(w, "max_model_len", None) for w in pd.serving.decode_pool]
        if all(n is not None for n in lens):
            break
        await asyncio.sleep(0.01)
    return lens


@pytest.mark.parametrize("how", ["learned", "learned-usage", "setting"])
async def test_token_1_at_the_model_length_ends_the_stream_in_ps_chunk(
        pd_factory: PDFactory, sim_factory: SimFactory, how: str) -> None:
    """Only one token fits the model length (prompt + 1 = max_model_len): the stream ends at P's
    token, the token and its ``length`` end in one chunk, as one vLLM server sends it (byte for
    byte), with no decode hop but the release of P's KV. The model length is the decode workers'
    (``GET /v1/models``, behind the workers' API key) or ``--max-model-len``."""
    sims = {"max_model_len": 20, "api_key": "upstream"}
    setting = {"max_model_len": 20} if how == "setting" else {}
    pd = await pd_factory(prefill=sims, decode=sims, upstream_api_key="upstream", **setting, **ON)
    lens = await model_lens_known(pd) if how != "setting" else []
    body = req(token_ids=list(range(300, 319)), request_id="at-len", sp={"max_tokens": 8})
    if how == "learned-usage":
        body["stream_options"] = {"include_usage": True}
    raw, want = await raw_streams(pd, sim_factory, body, max_model_len=20)
    assert raw == want, (lens, raw)
    ends = [c for e in sse_datas(raw) if isinstance(e, dict) for c in e["choices"]
            if c["finish_reason"] is not None]
    assert len(ends) == 1 and ends[0]["finish_reason"] == "length" and len(ends[0]["token_ids"]) == 1
    await pd.quiet()  # P's KV released


async def test_a_deadline_passing_after_ps_chunk_ends_the_stream_and_frees_ps_kv(
        pd_factory: PDFactory) -> None:
    # A deadline generous enough for P's hop on a loaded machine (a 300 ms one passed before P
    # answered there), and a hold between the hops far past it: the deadline ends the stream.
    pd = await pd_factory(hold_between_hops=120.0, **ON)
    resp = await pd.client.post("/inference/v1/generate", json={**r(), "stream": True, "request_id": "dl"},
                                headers={"X-PD-Deadline-Ms": "3000"})
    rest = sse_datas(await asyncio.wait_for(resp.read(), 60.0))
    assert rest[0]["choices"][0]["token_ids"] == [290]  # P's token, then the deadline's abort
    assert rest[1]["choices"][0]["finish_reason"] == "abort" and rest[-1] == "[DONE]"
    await pd.quiet(limit=30.0)
    assert (await pd.p.state())["releases"]["pulled"] == 1


async def test_ps_chunk_carries_the_id_the_client_knows(pd_factory: PDFactory) -> None:
    """Several tenants: the workers see a namespaced id; P's chunk, as D's, is rewritten back."""
    pd = await pd_factory(api_keys=(("a", "key-a"), ("b", "key-b")), **ON)
    resp = await pd.client.post("/inference/v1/generate", json={**r(), "stream": True, "request_id": "tn"},
                                headers={"Authorization": "Bearer key-a"})
    got = sse_datas(await resp.read())
    assert resp.status == 200 and len(got) > 2
    assert {e["request_id"] for e in got if isinstance(e, dict)} == {"generate-tokens-tn"}
    assert (await pd.p.state())["generate_calls"] == 1
    await pd.quiet()


@pytest.mark.parametrize("mode", ["tokens", "text"])
async def test_a_stream_that_breaks_after_ps_token_migrates_from_where_the_client_is(
        pd_factory: PDFactory, sim_factory: SimFactory, mode: str) -> None:
    """D resets mid-stream: the continuation's prompt holds P's token (the client had it from P,
    not from D), so the stream goes on seamlessly, as the aggregated worker's."""
    pd = await pd_factory(pools=PoolSettings.plain(migrate=True), n_decode=2,
                          decode={"faults": {"reset_after_tokens": 3}}, **ON)
    for d in pd.decode[1:]:
        await d.set_faults(reset_after_tokens=None)
    body = {**r(output_mode=mode, sp={"max_tokens": 10}), "request_id": f"mig-{mode}",
            "stream_options": {"include_usage": True}}
    for _ in range(2):  # whichever decode worker is picked first, one stream breaks
        status, got, timing = await stream(pd, body)
        _, want = await reference(sim_factory, body, True, {})
        assert status == 200 and "first_to_second;dur=" in timing
        assert volatile(got) == volatile(want)
    assert await metric(pd, "pd_proxy_migrations_total") >= 1
    await pd.quiet()


@pytest.mark.parametrize("name", ["greedy-tokens", "greedy-text", "n2-seeded", "continuous-usage"])
async def test_a_read_of_many_events_loses_token_1_and_goes_on_as_a_block(
        pd_factory: PDFactory, sim_factory: SimFactory, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """D's whole stream in one read (as at zero latency, or when D bursts): only its first event
    is read event by event to take token 1 out; in tokens mode the rest of the read goes out as
    one block (text mode reads on event by event), and the client's stream is still the
    aggregated worker's."""
    from proxy.stream.read import DecodeReader  # noqa: PLC0415
    from proxy.upstream.client import Upstream  # noqa: PLC0415

    pipe = Upstream.pipe

    async def one_read(self: Upstream, hop: str, worker: str, resp: Any,
                       sink: Callable[[bytes], bool]) -> None:
        reads: list[bytes] = []  # every read to the sink, then as one

        def kept(chunk: bytes) -> bool:
            reads.append(chunk)
            return True

        await pipe(self, hop, worker, resp, kept)
        sink(b"".join(reads))

    one_by_one = Counter[str]()
    put = DecodeReader._put

    def counted(self: DecodeReader, *args: Any) -> bool:
        one_by_one["events"] += 1
        return put(self, *args)

    monkeypatch.setattr(Upstream, "pipe", one_read)
    monkeypatch.setattr(DecodeReader, "_put", counted)
    pd = await pd_factory(**ON)
    body = {**CASES[name], "request_id": f"one-read-{name}"}
    status, want_status, got, want, _ = await stream_and_reference(pd, sim_factory, body)
    assert status == want_status == 200
    assert volatile(got) == volatile(want)
    assert len(got) > 4  # several events: P's, D's (token 1 dropped), [DONE]
    if body.get("output_mode") != "text":
        # D's first event of each choice; not one per event of D's stream
        assert one_by_one["events"] == body["sampling_params"].get("n", 1)
    await pd.quiet()


async def _aborts_reach(d: Scripted, n: int) -> None:
    """Until ``d`` was sent ``n`` aborts (bounded: 10 s)."""
    for _ in range(1000):
        if len(d.aborts) >= n:
            return
        await asyncio.sleep(0.01)


async def _unseen_answer(d: Scripted, dropped: int) -> bytes:
    """D runs the request 1 s without a word (its API server behind its engine), then answers all
    at once: vLLM's aborted ending if an abort beyond the ``dropped`` ones came meanwhile, else all
    16 tokens (the first P's) and ``length``."""
    from tests.proxy.scripted_streams import DONE, chunk  # noqa: PLC0415

    for _ in range(100):
        if len(d.aborts) > dropped:
            return chunk(finish="abort") + DONE
        await asyncio.sleep(0.01)
    return b"".join(chunk(7 if i == 0 else 100 + i, finish="length" if i == 15 else None)
                    for i in range(16)) + DONE


async def _abort_after_ps_token(client: Any, d: Scripted, rid: str) -> list[Any]:
    """A stream whose client aborts as soon as it has P's token, D having its request by then:
    what came after P's token, checked to end as vLLM's aborted stream."""
    resp = await client.post("/inference/v1/generate", json={**req(request_id=rid), "stream": True})
    first = await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 30.0)
    assert json.loads(first[6:])["choices"][0]["token_ids"] == [7]  # P's token
    for _ in range(1000):  # the decode hop reached D (bounded: 10 s)
        if d.received:
            break
        await asyncio.sleep(0.01)
    a = await client.post("/inference/v1/abort_requests", json={"request_ids": [f"generate-tokens-{rid}"]})
    assert a.status == 200
    rest = sse_datas(await asyncio.wait_for(resp.read(), 30.0))
    finishes = [c["finish_reason"] for e in rest[:-1] for c in e["choices"] if c["finish_reason"]]
    assert finishes == ["abort"] and rest[-1] == "[DONE]"
    return rest


async def test_an_abort_that_reached_d_before_its_request_is_sent_again_at_ds_first_event(
        scripted_factory: ScriptedFactory, proxy_factory: ProxyFactory) -> None:
    """The client aborts right after P's token, while the decode hop is on its way: D drops that
    abort (vLLM drops an abort of an id it has not registered yet), and the one sent again at its
    headers too (here D registers the request only after that one), and starts streaming. At D's
    first event D certainly has the request: the abort goes again at once, so the stream ends as
    an aborted one, not after D's whole answer (the repeats, put off here, would come later)."""
    from aiohttp import web  # noqa: PLC0415

    from tests.proxy.scripted_streams import DONE, chunk  # noqa: PLC0415

    p: Scripted = await scripted_factory(lambda b, r: prefill_reply(b))
    d: Scripted

    async def decode(body: dict[str, Any], request: web.Request) -> web.StreamResponse:
        await _aborts_reach(d, 1)  # a first abort came before the headers
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await resp.prepare(request)
        await _aborts_reach(d, 2)  # registered only after the abort sent at the headers
        dropped = len(d.aborts)
        for i in range(100):  # 5 s of tokens unless an abort comes
            if len(d.aborts) > dropped:
                await resp.write(chunk(finish="abort"))
                break
            await resp.write(chunk(7 if i == 0 else 100 + i, finish="length" if i == 99 else None))
            await asyncio.sleep(0.05)
        await resp.write(DONE)
        return resp

    d = await scripted_factory(decode)
    client, _ = await proxy_factory([p.url], [d.url], abort_grace=60.0, abort_repeat_first=60.0, **ON)
    await _abort_after_ps_token(client, d, "lost")
    assert len(d.aborts) >= 3  # the two D dropped, and the one sent at its first event


async def test_an_abort_lost_by_d_goes_again_soon_while_d_runs_the_request_unseen(
        scripted_factory: ScriptedFactory, proxy_factory: ProxyFactory) -> None:
    """As in a real-vLLM cancellation run: the client aborts right after P's token, D drops that
    abort (it had not registered the request yet), then runs the request and sends its whole
    answer at once (its API server had fallen behind its engine), so no first event came while
    it ran. The abort must go again while D runs, soon after the first, not at the next
    ``abort_grace`` (here 60 s): the stream ends as an aborted one, not D's full answer."""
    from aiohttp import web  # noqa: PLC0415

    p: Scripted = await scripted_factory(lambda b, r: prefill_reply(b))
    d: Scripted

    async def decode(body: dict[str, Any], request: web.Request) -> web.StreamResponse:
        await _aborts_reach(d, 1)  # registered only after a first abort came
        answer = await _unseen_answer(d, len(d.aborts))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await resp.prepare(request)  # the headers only with the answer: no resend at them
        await resp.write(answer)
        return resp

    d = await scripted_factory(decode)
    client, _ = await proxy_factory([p.url], [d.url], abort_grace=60.0, **ON)
    rest = await _abort_after_ps_token(client, d, "unseen")
    assert not any(t >= 100 for e in rest[:-1] for c in e["choices"] for t in c["token_ids"])


async def test_an_abort_that_reached_d_before_its_request_is_sent_again_at_ds_headers(
        scripted_factory: ScriptedFactory, proxy_factory: ProxyFactory) -> None:
    """vLLM answers a stream's headers, then registers the request: an abort the client sent
    right after P's token, which reached D before, was dropped. At D's headers it goes again at
    once: D, which here runs the request unseen and sends its whole answer at once (no first
    event while it runs), is aborted; the repeats, put off here, would come too late."""
    from aiohttp import web  # noqa: PLC0415

    p: Scripted = await scripted_factory(lambda b, r: prefill_reply(b))
    d: Scripted

    async def decode(body: dict[str, Any], request: web.Request) -> web.StreamResponse:
        await _aborts_reach(d, 1)  # the client's abort came before D's headers
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await resp.prepare(request)  # the headers go now; the request is registered after them
        await resp.write(await _unseen_answer(d, len(d.aborts)))
        return resp

    d = await scripted_factory(decode)
    client, _ = await proxy_factory([p.url], [d.url], abort_grace=60.0, abort_repeat_first=60.0, **ON)
    await _abort_after_ps_token(client, d, "early")
    assert len(d.aborts) >= 2  # the one D dropped, and the one sent at its headers


@pytest.fixture
def server_writes(monkeypatch: pytest.MonkeyPatch) -> list[tuple[object, bytes]]:
    """Every write an aiohttp server of this process hands its transport (one entry per ``write``
    or ``writelines``: one syscall when the socket takes it), in order, with the server it came
    from (pd-sim's too); the test client's own writes are left out."""
    from aiohttp import http_writer  # noqa: PLC0415
    from aiohttp.web_protocol import RequestHandler  # noqa: PLC0415

    writes: list[tuple[object, bytes]] = []
    write, writelines = http_writer.StreamWriter._write, http_writer.StreamWriter._writelines

    def server_of(protocol: object) -> object | None:
        """The server whose connection ``protocol`` is (an aiohttp request handler's)."""
        return protocol._manager if isinstance(protocol, RequestHandler) else None

    def one(self: Any, chunk: Any) -> None:
        if (server := server_of(self._protocol)) is not None:
            writes.append((server, bytes(chunk)))
        write(self, chunk)

    def several(self: Any, chunks: Any) -> None:
        if (server := server_of(self._protocol)) is not None:
            writes.append((server, b"".join(bytes(c) for c in chunks)))
        writelines(self, chunks)

    monkeypatch.setattr(http_writer.StreamWriter, "_write", one)
    monkeypatch.setattr(http_writer.StreamWriter, "_writelines", several)
    return writes


@pytest.mark.parametrize(("body", "last_events"), [(r(sp={"max_tokens": 1}), 1)], ids=["ends-at-p"])
async def test_the_headers_go_with_ps_token_and_the_last_events_with_the_streams_end(
        pd_factory: PDFactory, server_writes: list[tuple[object, bytes]], body: dict[str, Any],
        last_events: int) -> None:
    """One write for the headers and P's chunk, one for the last events, ``[DONE]`` and the
    chunked end: not a write each (each is a syscall). ``last_events``: data events in the last
    write at least (D's last events and ``[DONE]``; ``[DONE]`` alone after P's chunk ended it,
    with the Server-Timing comment)."""
    pd = await pd_factory(**ON)
    status, got, _ = await stream(pd, body)
    assert status == 200 and got[-1] == "[DONE]"
    assert pd.client.server is not None
    proxy = pd.client.server.handler
    writes = [data for server, data in server_writes if server is proxy]
    head, *_, last = writes
    assert head.startswith(b"HTTP/1.1 200 ") and b"\r\n\r\n" in head
    assert b"\r\ndata: {" in head  # P's chunk went with the headers
    assert b"data: [DONE]\n\n\r\n0\r\n\r\n" in last and last.count(b"data: ") >= last_events
    assert b"0\r\n\r\n" not in writes  # no chunked end alone
    await pd.quiet()


@pytest.mark.parametrize("max_migrations", [1, 2])
async def test_a_decode_worker_broken_before_its_first_event_migrates_once_with_no_false_mismatch(
        pd_factory: PDFactory, sim_factory: SimFactory, max_migrations: int) -> None:
    """D answers its headers, then resets before any event: the stream goes on elsewhere from
    the prompt and P's token, which the client has. The continuation's first token is token 2:
    nothing is taken out of it, no mismatch is counted, one migration serves the client the
    aggregated stream. Before, the token-1 check stayed on and took token 2 for a contradicting
    token 1: a mismatch counted and a second migration spent, and with ``max_migrations`` 1 the
    client's stream ended with an error."""
    pd = await pd_factory(pools=PoolSettings.plain(migrate=True, max_migrations=max_migrations), n_decode=2,
                          first_token_from_prefill=True)
    await pd.decode[0].set_faults(reset_after_tokens=0)
    for i in range(2):
        body = req(token_ids=[65, 66, 67, 68, 69], request_id=f"brk{i}", sp={"max_tokens": 10})
        status, want_status, got, want, _ = await stream_and_reference(pd, sim_factory, body, usage=True)
        assert status == want_status == 200 and volatile(got) == volatile(want)
    broken = (await pd.decode[0].state())["generate_calls"]
    assert broken >= 1  # the broken worker took at least one of them
    assert await metric(pd, "pd_proxy_first_token_mismatch_total") == 0
    assert await metric(pd, "pd_proxy_migrations_total") == broken  # one each
