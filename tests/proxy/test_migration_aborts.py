"""A migrated stream's continuation and its client's going: the continuation's prompt is prefilled
on P (its KV held under a lease of its own) and handed to another decode worker, D2. Whenever the
client goes away or aborts, P ends up holding nothing: the continuation is not sent once the
request is aborted (its KV released instead), and once it is sent, D2 is aborted until it had
the request, never cut off before (vLLM registers a stream's request only as it answers its
headers; cut before, D2 never pulls and P keeps the KV until its lease)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from proxy.http.app import SERVING
from proxy.http.serving import Serving
from proxy.pools import PoolSettings
from tests import sse
from tests.fixtures_sim import SimWorker
from tests.proxy.conftest import PDFactory, ProxyFactory, req
from tests.proxy.scripted import Scripted, ScriptedFactory, prefill_reply

D1_SLOW = {"zero_latency": False, "itl_ms": 20.0, "prefill_base_ms": 0.0, "prefill_per_token_ms": 0.0,
           "transfer_per_block_ms": 0.0}


def d2_like_vllm(registered: list[str], headers_after: float) -> Any:
    """A decode worker that answers a stream's headers ``headers_after`` seconds late and only
    then registers the request (as vLLM does): registered, it takes P's KV (P frees it); cut
    before, it never had the request. A non-stream call (the release) takes the KV and answers."""
    async def decode(body: dict[str, Any], request: web.Request) -> Any:
        if body.get("stream"):
            await asyncio.sleep(headers_after)
            if request.transport is None or request.transport.is_closing():
                return web.Response()  # cut before it registered: it never pulls
        registered.append(body["request_id"])
        params = body.get("kv_transfer_params")
        if isinstance(params, dict):  # it pulls: P frees
            async with aiohttp.ClientSession() as s, s.post(
                    f"http://{params['remote_host']}:{params['remote_port']}/sim/kv/free",
                    json={"remote_request_id": params["remote_request_id"]}) as r:
                await r.read()
        if not body.get("stream"):
            return prefill_reply(body, kv_transfer_params=None)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await resp.prepare(request)
        for token in (5, 6):
            event = {"request_id": "generate-tokens-" + body["request_id"], "output_mode": "tokens",
                     "usage": None, "choices": [{"index": 0, "token_ids": [token], "finish_reason": None}]}
            with contextlib.suppress(ConnectionError, RuntimeError):
                await resp.write(b"data: " + json.dumps(event).encode() + b"\n\n")
            await asyncio.sleep(0.2)
        with contextlib.suppress(ConnectionError, RuntimeError):
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        return resp
    return decode


async def migrating(sim_factory: Any, scripted_factory: ScriptedFactory, proxy_factory: ProxyFactory,
                    d2_headers_after: float, p_settings: dict[str, Any] | None = None,
                    ) -> tuple[Any, Serving, SimWorker, Scripted, list[str]]:
    """P (pd-sim), D1 (pd-sim, its stream reset after 3 tokens) and D2 (``d2_like_vllm``):
    every continuation goes through P."""
    p = await sim_factory(role="prefill", **({"zero_latency": True} | (p_settings or {})))
    d1 = await sim_factory(role="decode", **D1_SLOW)
    await d1.set_faults(reset_after_tokens=3)
    registered: list[str] = []
    d2 = await scripted_factory(d2_like_vllm(registered, d2_headers_after))
    client, app = await proxy_factory(
        [p.url], [d1.url, d2.url], first_token_from_prefill=False, abort_grace=0.05,
        pools=PoolSettings.plain(migrate=True, migrate_prefill_tokens=0, decode_policy="round_robin"))
    return client, app[SERVING], p, d2, registered


async def held_on_p(serving: Serving, p: SimWorker) -> list[Any]:
    """What P still holds once the proxy is done with the request (bounded), and D2 with it."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 8
    while len(serving.table) or len(serving.tracker):
        assert loop.time() < deadline, f"the request never ended: {serving.table.all()}"
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.5)  # a pull D2 still makes
    held: list[Any] = (await p.state())["kv_held"]
    return held


async def received(worker: Scripted) -> bool:
    return bool(worker.received)


async def until(condition: Any, what: str, response: aiohttp.ClientResponse | None = None) -> None:
    """Poll ``condition`` (bounded), reading the client's stream meanwhile when given."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 5
    while not await condition():
        assert loop.time() < deadline, f"never: {what}"
        if response is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(response.content.readany(), 0.02)
        else:
            await asyncio.sleep(0.01)


async def test_a_client_gone_before_d2_registered_the_continuation_leaves_nothing_on_p(
        sim_factory: Any, scripted_factory: ScriptedFactory, proxy_factory: ProxyFactory) -> None:
    """The client goes away while D2 has not answered the continuation's headers. Before, the
    clean-up took D1's first event for D2's (``Flight.settled`` was not cleared at the
    migration): one abort, lost, then D2 cut off before it registered, and P held the
    continuation's KV until its lease."""
    client, serving, p, d2, registered = await migrating(sim_factory, scripted_factory, proxy_factory,
                                                         d2_headers_after=0.3)
    r = await client.post("/inference/v1/generate",
                          json={**req(request_id="mg1", sp={"max_tokens": 20, "ignore_eos": True}),
                                "stream": True})
    assert r.status == 200

    await until(lambda: received(d2), "the continuation sent to D2", r)
    assert "kv_transfer_params" in d2.received[0]  # it went through P
    r.close()  # the client goes away before D2 answered its headers
    assert await held_on_p(serving, p) == []
    assert registered == ["mg1"]  # D2 had the request (aborted after it), and took the KV
    assert any("generate-tokens-mg1" in a["request_ids"] for a in d2.aborts)


@pytest.mark.parametrize("how", ["abort", "disconnect"])
async def test_a_request_aborted_while_its_continuation_is_prefilled_leaves_nothing_on_p(
        sim_factory: Any, scripted_factory: ScriptedFactory, proxy_factory: ProxyFactory,
        how: str) -> None:
    """Aborted (the abort endpoint, or the client's going) while P prefills the continuation:
    the client's stream (if still there) ends, and P holds nothing once the proxy is done (here
    the clean-up cuts the continuation's prefill hop, which P aborts)."""
    client, serving, p, _, _ = await migrating(
        sim_factory, scripted_factory, proxy_factory, d2_headers_after=0.0,
        p_settings={"zero_latency": False, "prefill_base_ms": 300.0, "prefill_per_token_ms": 0.0})
    r = await client.post("/inference/v1/generate",
                          json={**req(request_id="mg2", sp={"max_tokens": 20, "ignore_eos": True}),
                                "stream": True})
    assert r.status == 200

    async def continuation_on_p() -> bool:
        return bool((await p.state())["generate_calls"] == 2)
    await until(continuation_on_p, "the continuation's prefill on P", r)
    if how == "abort":
        a = await client.post("/inference/v1/abort_requests", json={"request_ids": ["generate-tokens-mg2"]})
        assert a.status == 200
        raw = await asyncio.wait_for(r.read(), 5)
        assert raw.endswith(b"data: [DONE]\n\n")
    else:
        r.close()
    assert await held_on_p(serving, p) == []


async def test_a_continuation_d2_fails_after_the_client_left_is_released_and_the_request_ends(
        sim_factory: Any, scripted_factory: ScriptedFactory, proxy_factory: ProxyFactory) -> None:
    """The client goes away while D2 has not answered the continuation; then D2 answers 503 (it
    registered nothing). The clean-up stops aborting D2 as the hop ends (before, it waited for a
    first event that never came, aborting D2 again and again up to the decode timeout), and the
    continuation's KV is released through a decode worker (before, P held it until its lease)."""
    p = await sim_factory(role="prefill", zero_latency=True)
    d1 = await sim_factory(role="decode", **D1_SLOW)
    await d1.set_faults(reset_after_tokens=3)

    async def d2_fails(body: dict[str, Any], request: web.Request) -> Any:
        await asyncio.sleep(0.3)
        return web.json_response({"error": {"message": "busy", "type": "ServiceUnavailableError",
                                            "param": None, "code": 503}}, status=503)

    d2 = await scripted_factory(d2_fails)
    client, app = await proxy_factory(
        [p.url], [d1.url, d2.url], first_token_from_prefill=False, abort_grace=0.05,
        decode_timeout=60.0,
        pools=PoolSettings.plain(migrate=True, migrate_prefill_tokens=0, decode_policy="round_robin"))
    serving = app[SERVING]
    r = await client.post("/inference/v1/generate",
                          json={**req(request_id="mg3", sp={"max_tokens": 20, "ignore_eos": True}),
                                "stream": True})
    assert r.status == 200

    await until(lambda: received(d2), "the continuation sent to D2", r)
    r.close()
    assert await held_on_p(serving, p) == []
    ledger = await (await client.get("/debug/kv-leases")).json()
    assert ledger["open"] == []


def token_ids(raw: bytes) -> list[int]:
    """The token ids of a client's stream, in order."""
    return sse.tokens(raw, comments=True)


async def test_a_continuation_whose_kv_fails_is_retried_as_the_continuation_not_the_first_request(
        pd_factory: PDFactory) -> None:
    """D1 breaks after 3 tokens; the continuation's prefill is on P; then the continuation's KV
    will not load on D2 (P refuses pulls): the retry is the continuation again (decode-only,
    D computes its prompt), so the client's stream is the uninterrupted one. Before, the retry
    was the request's first body: the client got its first tokens twice, and more than
    ``max_tokens`` in all, in a stream that ended as if nothing had happened."""
    pd = await pd_factory(prefill={"zero_latency": False, "prefill_base_ms": 300.0}, n_decode=3,
                          pools=PoolSettings.plain(migrate=True, migrate_prefill_tokens=0, decode_attempts=2))
    body = {**req(sp={"max_tokens": 12}), "stream": True}
    r = await pd.client.post("/inference/v1/generate", json=body)
    uninterrupted = token_ids(await r.read())
    assert len(uninterrupted) == 12
    for d in pd.decode:
        await d.set_faults(reset_after_tokens=3)
    r = await pd.client.post("/inference/v1/generate", json=body)
    raw = b""
    while raw.count(b"data: {") < 3:
        raw += await asyncio.wait_for(r.content.readany(), 5)
    for d in pd.decode:  # D1 broke: the continuation is being prefilled on P (300 ms)
        await d.set_faults(reset=True)
    await pd.p.set_faults(refuse_kv_pulls=True)
    raw += await asyncio.wait_for(r.content.read(), 10)
    assert token_ids(raw) == uninterrupted
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 5
    while len(pd.serving.table) or len(pd.serving.tracker):
        assert loop.time() < deadline, "the request never ended"
        await asyncio.sleep(0.02)
    # P refused the pulls, so it keeps the continuation's KV to its lease: the ledger says so
    ledger = await (await pd.client.get("/debug/kv-leases")).json()
    assert ledger["open"] == []
    assert sorted(c["reason"] for c in ledger["closed"]) == ["pulled", "pulled", "unknown"]


async def test_a_client_gone_while_the_continuation_is_prefilled_leaves_no_decode_slot_taken(
        pd_factory: PDFactory) -> None:
    """The decode worker picked for the continuation is given back when the clean-up cancels
    the migration during the continuation's prefill. Before, its in-flight count stayed up for
    good (least-loaded picks then avoided it; with a per-worker cap, a slot was gone)."""
    pd = await pd_factory(prefill={"zero_latency": False, "prefill_base_ms": 600.0},
                          decode={"faults": {"reset_after_tokens": 3}}, n_decode=2,
                          pools=PoolSettings.plain(migrate=True, migrate_prefill_tokens=0))
    r = await pd.client.post("/inference/v1/generate", json={**req(sp={"max_tokens": 30}), "stream": True})
    assert r.status == 200
    got = b""
    while got.count(b"data: ") < 3:  # the client has D1's 3 tokens; D1 resets, the migration starts
        got += await asyncio.wait_for(r.content.readany(), 5)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 5
    while (await pd.p.state())["generate_calls"] < 2:  # the continuation's prefill on P (600 ms)
        assert loop.time() < deadline, "the continuation never went to P"
        await asyncio.sleep(0.01)
    r.close()  # the client goes away
    await pd.quiet(limit=5.0)
    assert [(w.inflight, w.outstanding_tokens) for w in pd.serving.decode_pool] == [(0, 0), (0, 0)]
