"""Issue 5: aborts and disconnects in every state; nothing stays held anywhere afterwards."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
from typing import Any

import pytest

from proxy.http.app import SERVING
from proxy.pools import PoolSettings
from tests.proxy.conftest import PD, PDFactory, ProxyFactory, req, sse_datas
from tests.proxy.scripted import KV_PARAMS, Scripted, ScriptedFactory, prefill_reply

SLOW_PREFILL = {"zero_latency": False, "prefill_base_ms": 400.0, "prefill_per_token_ms": 0.0}
SLOW_DECODE = {"zero_latency": False, "itl_ms": 20.0, "prefill_base_ms": 0.0, "prefill_per_token_ms": 0.0,
               "transfer_per_block_ms": 0.0}


async def wait_for_state(pd: PD, state: str, limit: float = 3.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit
    while not any(r.phase.value == state for r in pd.serving.table.all()):
        assert loop.time() < deadline, f"never reached {state}"
        await asyncio.sleep(0.01)


async def abort(pd: PD, rid: str, path: str = "/inference/v1/abort_requests", **kw: Any) -> int:
    r = await pd.client.post(path, json={"request_ids": [rid]}, **kw)
    assert await r.read() == b"" or r.status != 200
    return r.status


async def leases(pd: PD) -> dict[str, Any]:
    r = await pd.client.get("/debug/kv-leases")
    data: dict[str, Any] = await r.json()
    return data


def finish_reasons(events: list[Any]) -> list[str]:
    return [c["finish_reason"] for e in events if isinstance(e, dict) for c in e.get("choices", [])
            if c["finish_reason"] is not None]


# ------------------------------------------------------------------ client-call aborts by state


@pytest.mark.parametrize("stream", [False, True])
async def test_abort_while_prefilling(pd_factory: PDFactory, stream: bool) -> None:
    pd = await pd_factory(prefill=SLOW_PREFILL)
    task = asyncio.create_task(pd.client.post("/inference/v1/generate",
                                              json={**req(request_id="a1"), "stream": stream}))
    await wait_for_state(pd, "prefilling")
    await asyncio.sleep(0.05)
    assert await abort(pd, "generate-tokens-a1") == 200
    r = await asyncio.wait_for(task, 5)
    raw = await r.read()
    if stream:
        events = sse_datas(raw)
        assert finish_reasons(events) == ["abort"] and events[-1] == "[DONE]"
    else:
        body = json.loads(raw)
        assert body["choices"][0]["finish_reason"] == "abort" and body["choices"][0]["token_ids"] == []
    await pd.quiet(limit=1.0)


@pytest.mark.parametrize("stream", [False, True])
async def test_an_abort_that_reached_prefill_another_way_ends_the_request_as_aborted(
        pd_factory: PDFactory, stream: bool) -> None:
    """Another proxy process (or this one, before the request arrived) broadcast the client's
    abort to the workers: P ends the prefill with finish_reason "abort". The client gets vLLM's
    aborted answer (it asked for it), not a 502, and no other prefill worker is tried."""
    pd = await pd_factory(prefill=SLOW_PREFILL, n_prefill=2, pools=PoolSettings.plain(prefill_attempts=3))
    task = asyncio.create_task(pd.client.post("/inference/v1/generate",
                                              json={**req(request_id="w1"), "stream": stream}))
    await wait_for_state(pd, "prefilling")
    await asyncio.sleep(0.05)
    for p in pd.prefill:  # the broadcast: every worker
        async with p.session.post(p.url + "/inference/v1/abort_requests",
                                  json={"request_ids": ["generate-tokens-w1"]}) as r:
            assert r.status == 200
    r = await asyncio.wait_for(task, 5)
    raw = await r.read()
    assert r.status == 200, raw
    if stream:
        events = sse_datas(raw)
        assert finish_reasons(events) == ["abort"] and events[-1] == "[DONE]"
    else:
        assert json.loads(raw)["choices"][0]["finish_reason"] == "abort"
    served = [(await p.state())["generate_calls"] for p in pd.prefill]
    assert sorted(served) == [0, 1], served  # not retried on the other prefill worker
    m = await pd.client.get("/metrics")
    assert 'pd_proxy_aborts_total{source="worker",state="prefilling"} 1.0' in await m.text()
    await pd.quiet(limit=1.0)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_hop_that_fails_after_the_client_left_logs_no_unretrieved_error(
        pd_factory: PDFactory, stream: bool, caplog: pytest.LogCaptureFixture) -> None:
    """Seen in the soak: the client aborted while D hung before its headers; the handler
    answered (abort grace), the hop then timed out, and its task (or the stream's headers
    future) ended with an error nobody awaited: asyncio logged it as an ERROR when collected."""
    pd = await pd_factory(decode_timeout=0.8, stream_idle_timeout=0.8, abort_grace=0.05,
                          lease_duration=0.2, prefill={"lease_seconds": 0.2})  # the lease ends first
    await pd.d.set_faults(hang_before_headers=True)
    task = asyncio.create_task(pd.client.post("/inference/v1/generate",
                                              json={**req(request_id="gone1"), "stream": stream}))
    await wait_for_state(pd, "decoding")
    assert await abort(pd, "generate-tokens-gone1") == 200
    r = await asyncio.wait_for(task, 5)
    assert r.status == 200
    await r.read()
    await asyncio.sleep(0.3)  # P's lease ends before the hop does
    assert pd.serving.expire_leases() == 0  # the hop's end tells how the KV ended, not the clock
    await pd.d.set_faults(hang_before_headers=False)
    await pd.quiet(limit=3.0)  # the clean-up outlives the answer
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        gc.collect()
        await asyncio.sleep(0)
    assert not [rec for rec in caplog.records if "never retrieved" in rec.getMessage()]


@pytest.mark.parametrize("stream", [False, True])
async def test_abort_between_hops_frees_prefill_kv(pd_factory: PDFactory, stream: bool) -> None:
    pd = await pd_factory(hold_between_hops=10.0)
    task = asyncio.create_task(pd.client.post("/inference/v1/generate",
                                              json={**req(request_id="kv1"), "stream": stream}))
    await wait_for_state(pd, "kv_held")
    assert (await pd.p.state())["kv_held"], "the prefill worker should hold the KV now"
    assert len((await leases(pd))["open"]) == 1
    assert await abort(pd, "generate-tokens-kv1") == 200
    r = await asyncio.wait_for(task, 5)
    raw = await r.read()
    assert "abort" in (finish_reasons(sse_datas(raw)) if stream else
                       [json.loads(raw)["choices"][0]["finish_reason"]])
    await pd.quiet(limit=1.0)
    ledger = await leases(pd)
    assert ledger["open"] == [] and ledger["closed"][0]["reason"] == "aborted"
    assert (await pd.p.state())["releases"]["expired"] == 0


async def test_abort_while_streaming(pd_factory: PDFactory) -> None:
    pd = await pd_factory(decode=SLOW_DECODE)
    r = await pd.client.post("/inference/v1/generate",
                             json={**req(request_id="st1", sp={"max_tokens": 300, "ignore_eos": True}),
                                   "stream": True})
    seen = b""
    while seen.count(b"\n\n") < 3:
        seen += await r.content.readany()
    assert await abort(pd, "generate-tokens-st1") == 200
    seen += await asyncio.wait_for(r.read(), 5)
    events = sse_datas(seen)
    assert finish_reasons(events) == ["abort"] and events[-1] == "[DONE]"
    assert sum(len(e["choices"][0]["token_ids"]) for e in events[:-1]) < 300
    await pd.quiet(limit=1.0)
    assert (await leases(pd))["closed"][0]["reason"] == "pulled"


async def test_abort_nonstream_while_decoding(pd_factory: PDFactory) -> None:
    pd = await pd_factory(decode=SLOW_DECODE)
    task = asyncio.create_task(pd.client.post(
        "/inference/v1/generate", json=req(request_id="nd1", sp={"max_tokens": 300, "ignore_eos": True})))
    await wait_for_state(pd, "decoding")
    await asyncio.sleep(0.1)
    assert await abort(pd, "generate-tokens-nd1") == 200
    body = await (await asyncio.wait_for(task, 5)).json()
    assert body["choices"][0]["finish_reason"] == "abort"
    assert 0 < len(body["choices"][0]["token_ids"]) < 300
    await pd.quiet(limit=1.0)


async def test_abort_after_the_last_token_is_harmless(pd_factory: PDFactory) -> None:
    pd = await pd_factory()
    status, body, _ = await pd.gen(req(request_id="done1"))
    assert status == 200 and body["choices"][0]["finish_reason"] == "length"
    assert await abort(pd, "generate-tokens-done1") == 200
    assert await abort(pd, "generate-tokens-done1") == 200
    await pd.quiet(limit=1.0)


async def test_duplicate_and_racing_aborts(pd_factory: PDFactory) -> None:
    pd = await pd_factory(decode=SLOW_DECODE)
    for i in range(6):
        rid = f"race{i}"
        task = asyncio.create_task(pd.client.post(
            "/inference/v1/generate", json={**req(request_id=rid, sp={"max_tokens": 3}), "stream": True}))
        await asyncio.sleep(0.01 * i)
        for _ in range(2):
            assert await abort(pd, f"generate-tokens-{rid}") == 200
        r = await asyncio.wait_for(task, 5)
        events = sse_datas(await r.read())
        assert events[-1] == "[DONE]"
        assert finish_reasons(events)[-1] in ("abort", "length")
    await pd.quiet(limit=1.0)


# ------------------------------------------------------------------ disconnects by state


async def _disconnect_when(pd: PD, state: str, body: dict[str, Any], after_bytes: int = 0) -> None:
    async def call() -> None:
        r = await pd.client.post("/inference/v1/generate", json=body)
        try:
            while await r.content.readany():
                pass
        finally:
            r.close()  # a cancelled reader must drop the connection, as a real client would

    task = asyncio.create_task(call())
    await wait_for_state(pd, state)
    if after_bytes:
        await asyncio.sleep(0.1)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


@pytest.mark.parametrize("stream", [False, True])
async def test_disconnect_while_prefilling(pd_factory: PDFactory, stream: bool) -> None:
    pd = await pd_factory(prefill=SLOW_PREFILL)
    await _disconnect_when(pd, "prefilling", {**req(request_id="dp"), "stream": stream})
    await pd.quiet(limit=2.0)
    metrics = await (await pd.client.get("/metrics")).text()
    assert 'pd_proxy_aborts_total{source="disconnect",state="prefilling"} 1.0' in metrics


@pytest.mark.parametrize("stream", [False, True])
async def test_disconnect_during_a_long_prefill_aborts_the_prefill_worker(pd_factory: PDFactory,
                                                                          stream: bool) -> None:
    """The client goes away while P prefills (60 s): P is aborted (again every ``abort_grace``
    until its hop ends: an abort that comes before P registered the request is lost) and answers,
    so nothing is held or running anywhere long before the prefill would have ended (the handler
    is cancelled and the clean-up aborts P)."""
    pd = await pd_factory(prefill={"zero_latency": False, "prefill_base_ms": 60_000.0,
                                   "prefill_per_token_ms": 0.0}, abort_grace=0.2)
    await _disconnect_when(pd, "prefilling", {**req(request_id="dl"), "stream": stream})
    await pd.quiet(limit=20.0)
    metrics = await (await pd.client.get("/metrics")).text()
    assert 'pd_proxy_aborts_total{source="disconnect",state="prefilling"} 1.0' in metrics


@pytest.mark.parametrize("stream", [False, True])
async def test_an_abort_p_dropped_goes_again_soon_while_p_prefills(
        scripted_factory: ScriptedFactory, proxy_factory: ProxyFactory, stream: bool) -> None:
    """The client's abort reaches P before P registered the request (vLLM drops it), then P
    prefills for 2 s. The abort goes again soon after, not at the next ``abort_grace`` (here
    60 s): P ends the prefill aborted, holding no KV, so D is never sent a release of it."""
    p: Scripted
    d: Scripted = await scripted_factory(_release_answer)

    async def prefill(body: dict[str, Any], request: Any) -> dict[str, Any]:
        for _ in range(1000):  # registered only after a first abort came (bounded: 10 s)
            if p.aborts:
                break
            await asyncio.sleep(0.01)
        dropped = len(p.aborts)
        for _ in range(200):  # prefills 2 s unless an abort comes
            if len(p.aborts) > dropped:
                out = prefill_reply(body, kv_transfer_params=None)
                out["choices"][0].update(token_ids=[], finish_reason="abort")
                return out
            await asyncio.sleep(0.01)
        return prefill_reply(body)

    p = await scripted_factory(prefill)
    client, app = await proxy_factory([p.url], [d.url], abort_grace=60.0)
    task = asyncio.create_task(client.post("/inference/v1/generate",
                                           json={**req(request_id="pd1"), "stream": stream}))
    await _until(lambda: bool(p.received), "the prefill hop never reached P")
    a = await client.post("/inference/v1/abort_requests", json={"request_ids": ["generate-tokens-pd1"]})
    assert a.status == 200
    r = await asyncio.wait_for(task, 30)
    raw = await r.read()
    reasons = finish_reasons(sse_datas(raw)) if stream else \
        [c["finish_reason"] for c in json.loads(raw)["choices"]]
    assert r.status == 200 and reasons == ["abort"]
    assert len(p.aborts) >= 2 and d.received == []  # no KV held on P: nothing to release
    await _until(lambda: len(app[SERVING].table) == 0, "the request stayed in the table")


@pytest.mark.parametrize("stream", [False, True])
async def test_disconnect_between_hops_frees_prefill_kv(pd_factory: PDFactory, stream: bool) -> None:
    pd = await pd_factory(hold_between_hops=10.0)
    await _disconnect_when(pd, "kv_held", {**req(request_id="dk"), "stream": stream})
    await pd.quiet(limit=1.0)
    ledger = await leases(pd)
    assert ledger["open"] == [] and ledger["closed"][0]["reason"] == "aborted"


def _prefill_answering_when(released: asyncio.Event) -> Any:
    """A prefill worker that has prefilled (its KV held) but whose answer leaves only once the
    test sets ``released`` (bounded: 10 s). An abort does not change its answer: vLLM ignores
    an abort for a request it already finished."""
    async def reply(body: dict[str, Any], request: Any) -> dict[str, Any]:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(released.wait(), 10.0)
        return prefill_reply(body)
    return reply


async def leases_of(client: Any) -> dict[str, Any]:
    data: dict[str, Any] = await (await client.get("/debug/kv-leases")).json()
    return data


def _release_answer(body: dict[str, Any], request: Any) -> dict[str, Any]:
    out = prefill_reply(body, kv_transfer_params=None)
    out["choices"][0]["token_ids"] = [7]
    return out


def _decode_answering_when(released: asyncio.Event) -> Any:
    """A decode worker that answers a request (it pulled the KV) only once the test sets
    ``released`` (bounded: 10 s), whatever aborts it is sent meanwhile: a worker that ignores them."""
    async def reply(body: dict[str, Any], request: Any) -> dict[str, Any]:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(released.wait(), 10.0)
        out = {**prefill_reply(body), "kv_transfer_params": None}
        out["usage"] = {"prompt_tokens": len(body["token_ids"]), "completion_tokens": 1,
                        "total_tokens": len(body["token_ids"]) + 1, "prompt_tokens_details": None}
        return out
    return reply


async def _until(check: Any, what: str, limit: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit
    while not check():
        assert loop.time() < deadline, what
        await asyncio.sleep(0.01)


async def test_an_aborted_nonstream_request_whose_decode_worker_ignores_it_is_answered_after_the_grace(
        scripted_factory: ScriptedFactory, proxy_factory: ProxyFactory) -> None:
    """Aborted while D holds its non-stream decode hop, and D ignores the abort: the client gets
    vLLM's aborted answer ``abort_grace`` after the abort, the hop goes on (D is aborted again
    until it ends), and once D answers the lease closes ``aborted`` and nothing is left. The hop
    has a task of its own and the handler returns."""
    released = asyncio.Event()
    p: Scripted = await scripted_factory(lambda body, request: prefill_reply(body))
    d: Scripted = await scripted_factory(_decode_answering_when(released))
    client, app = await proxy_factory([p.url], [d.url], abort_grace=0.05)
    serving = app[SERVING]
    call = asyncio.create_task(client.post("/inference/v1/generate", json=req(request_id="ig1")))
    await _until(lambda: d.received, "the decode hop never reached D")
    assert len(serving.tracker) == 1  # the hop's task
    assert (await client.post("/abort_requests", json={"request_ids": ["generate-tokens-ig1"]})).status == 200
    r = await asyncio.wait_for(call, 5)
    body = await r.json()
    assert r.status == 200 and body["choices"][0]["finish_reason"] == "abort"
    assert body["choices"][0]["token_ids"] == []
    await _until(lambda: len(d.aborts) >= 2, "D was not aborted again while its hop went on")
    assert len(serving.table) == 1  # the hop goes on: the request is not forgotten
    released.set()
    await _until(lambda: not len(serving.table) and not len(serving.tracker), "the request never ended")
    ledger = await leases_of(client)
    assert ledger["open"] == [] and [c["reason"] for c in ledger["closed"]] == ["aborted"]
    assert serving.pools.decode.workers[0].inflight == 0
    metrics = await (await client.get("/metrics")).text()
    assert 'pd_proxy_requests_total{outcome="aborted"} 1.0' in metrics


async def test_an_aborted_nonstream_decode_that_never_ends_is_cut_at_its_limit(
        scripted_factory: ScriptedFactory, proxy_factory: ProxyFactory,
        caplog: pytest.LogCaptureFixture) -> None:
    """Aborted, answered after the grace, and D never answers: the hop ends at its limit
    (``decode_timeout``), the lease is ``unknown`` (D may or may not have pulled) and nothing is
    left."""
    released = asyncio.Event()
    p: Scripted = await scripted_factory(lambda body, request: prefill_reply(body))
    d: Scripted = await scripted_factory(_decode_answering_when(released))
    client, app = await proxy_factory([p.url], [d.url], abort_grace=0.05, decode_timeout=0.5)
    serving = app[SERVING]
    call = asyncio.create_task(client.post("/inference/v1/generate", json=req(request_id="ig2")))
    await _until(lambda: d.received, "the decode hop never reached D")
    assert (await client.post("/abort_requests", json={"request_ids": ["generate-tokens-ig2"]})).status == 200
    r = await asyncio.wait_for(call, 5)
    assert r.status == 200 and (await r.json())["choices"][0]["finish_reason"] == "abort"
    await _until(lambda: not len(serving.table) and not len(serving.tracker), "the hop was never cut", 8.0)
    assert not released.is_set()  # D never answered: the hop was cut
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], "the hop's end is no error"
    metrics = await (await client.get("/metrics")).text()
    assert 'pd_proxy_requests_total{outcome="aborted"} 1.0' in metrics  # answered: not a failure
    assert 'pd_proxy_requests_total{outcome="timeout"} 0.0' in metrics
    ledger = await leases_of(client)
    assert ledger["open"] == [] and [c["reason"] for c in ledger["closed"]] == ["unknown"]
    assert serving.pools.decode.workers[0].inflight == 0
    released.set()


async def test_a_client_gone_during_a_nonstream_decode_aborts_d_until_it_answers(
        scripted_factory: ScriptedFactory, proxy_factory: ProxyFactory) -> None:
    """The client goes away while D holds its non-stream decode hop, and D ignores the aborts: D is
    aborted again until it answers; its answer (it pulled the KV) closes the lease ``aborted`` and
    nothing is left."""
    released = asyncio.Event()
    p: Scripted = await scripted_factory(lambda body, request: prefill_reply(body))
    d: Scripted = await scripted_factory(_decode_answering_when(released))
    client, app = await proxy_factory([p.url], [d.url], abort_grace=0.05)
    serving = app[SERVING]

    async def call() -> None:
        async with client.post("/inference/v1/generate", json=req(request_id="gone1")) as r:
            await r.read()

    task = asyncio.create_task(call())
    await _until(lambda: d.received, "the decode hop never reached D")
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    disconnected = serving.metrics.aborts.labels(source="disconnect", state="decoding")
    await _until(lambda: disconnected._value.get() == 1, "the disconnect was never seen")
    await _until(lambda: len(d.aborts) >= 2, "D was not aborted again until its hop ended")
    assert len(serving.table) == 1
    released.set()
    await _until(lambda: not len(serving.table) and not len(serving.tracker), "the request never ended")
    ledger = await leases_of(client)
    assert ledger["open"] == [] and [c["reason"] for c in ledger["closed"]] == ["aborted"]
    assert serving.pools.decode.workers[0].inflight == 0


@pytest.mark.parametrize("stream", [False, True])
async def test_disconnect_while_a_finished_prefill_answers_late_frees_its_kv(
        scripted_factory: ScriptedFactory, proxy_factory: ProxyFactory, stream: bool) -> None:
    """The client goes away while the prefill hop waits for P's answer, and P had finished (its
    KV held, the answer late). The client's going must not cut the hop: its answer still reaches
    the proxy, whose clean-up releases the KV through a decode worker (D pulls, P frees), and the
    lease closes as ``aborted``. A cut hop would leave the KV pinned on P, with no params to
    release it by, until P's own lease ends. A stream takes the same hop (P's first token for
    the client, on by default, changes only its body). aiohttp's server cancels the handler; the
    hop has a task of its own that outlives it (``outlive``)."""
    released = asyncio.Event()
    p: Scripted = await scripted_factory(_prefill_answering_when(released))
    d: Scripted = await scripted_factory(_release_answer)
    client, app = await proxy_factory([p.url], [d.url], abort_grace=0.05)
    serving = app[SERVING]

    async def call() -> None:
        r = await client.post("/inference/v1/generate",
                              json={**req(request_id="late1"), "stream": stream})
        try:
            while await r.content.readany():
                pass
        finally:
            r.close()

    loop = asyncio.get_running_loop()
    deadline = loop.time() + 5.0
    task = asyncio.create_task(call())
    while not p.received:  # the prefill hop is with P
        assert loop.time() < deadline, "the prefill hop never reached P"
        await asyncio.sleep(0.01)
    # the hop's own task (nothing else runs yet)
    assert len(serving.tracker) == 1
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    disconnected = serving.metrics.aborts.labels(source="disconnect", state="prefilling")
    while disconnected._value.get() != 1:  # the handler was told (or cancelled): the client has gone
        assert loop.time() < deadline, "the disconnect was never seen"
        await asyncio.sleep(0.01)
    released.set()  # only now does P's answer (with the KV it holds) leave P

    deadline = loop.time() + 5.0
    while d.received == [] or len(serving.table) or len(serving.tracker):
        assert loop.time() < deadline, \
            f"P's KV was never released: decode asked {d.received}, leases {await leases_of(client)}"
        await asyncio.sleep(0.02)
    [release] = d.received  # one decode request: the release (D pulls, P frees)
    assert len(p.received) == 1 and release["request_id"] == p.received[0]["request_id"]
    params = release["kv_transfer_params"]
    assert params["remote_request_id"] == KV_PARAMS["remote_request_id"]
    assert params["remote_block_ids"] == KV_PARAMS["remote_block_ids"]
    assert release["sampling_params"]["max_tokens"] == 1 and release["stream"] is False
    ledger = await leases_of(client)
    assert ledger["open"] == [] and [c["reason"] for c in ledger["closed"]] == ["aborted"]
    metrics = await (await client.get("/metrics")).text()
    assert 'pd_proxy_kv_leases_closed_total{reason="aborted"} 1.0' in metrics


@pytest.mark.parametrize("stream", [False, True])
async def test_a_failed_kv_release_is_tried_again_while_the_lease_holds(pd_factory: PDFactory,
                                                                         stream: bool) -> None:
    """Seen on real vLLM under load: NIXL's first handshake with P timed out and D answered the
    release 500. The release is tried again (P still holds the blocks), so P frees them now
    rather than at its lease's end."""
    pd = await pd_factory(hold_between_hops=10.0)
    await pd.decode[0].set_faults(fail_next=1, fail_status=500)
    await _disconnect_when(pd, "kv_held", {**req(request_id="dr"), "stream": stream})
    await pd.quiet(limit=2.0)
    ledger = await leases(pd)
    assert ledger["open"] == [] and ledger["closed"][0]["reason"] == "aborted"
    metrics = await (await pd.client.get("/metrics")).text()
    assert f'pd_proxy_upstream_requests_total{{pool="decode",worker="{pd.decode[0].url}"}} 2.0' in metrics


@pytest.mark.parametrize("stream", [False, True])
async def test_disconnect_while_decoding(pd_factory: PDFactory, stream: bool,
                                         caplog: pytest.LogCaptureFixture) -> None:
    pd = await pd_factory(decode=SLOW_DECODE)
    body = {**req(request_id="dd", sp={"max_tokens": 300, "ignore_eos": True}), "stream": stream}
    await _disconnect_when(pd, "decoding", body, after_bytes=1)
    await pd.quiet(limit=1.0)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], "a disconnect is not an error"
    metrics = await (await pd.client.get("/metrics")).text()
    assert 'pd_proxy_aborts_total{source="disconnect",state="decoding"} 1.0' in metrics


async def test_disconnect_before_decode_answers(pd_factory: PDFactory) -> None:
    """Decode request sent but not yet answered: D must still pull (or be aborted) — P freed."""
    pd = await pd_factory(decode={**SLOW_DECODE, "prefill_base_ms": 300.0})
    await _disconnect_when(pd, "decoding", {**req(request_id="db", sp={"max_tokens": 50}), "stream": True})
    await pd.quiet(limit=2.0)


# ------------------------------------------------------------------ the abort endpoint itself


async def test_unknown_ids_are_broadcast(scripted_factory: ScriptedFactory,
                                         proxy_factory: ProxyFactory) -> None:
    workers: list[Scripted] = [await scripted_factory(lambda b, r: prefill_reply(b)) for _ in range(4)]
    client, _ = await proxy_factory([w.url for w in workers[:2]], [w.url for w in workers[2:]])
    r = await client.post("/inference/v1/abort_requests", json={"request_ids": ["generate-tokens-zz"]})
    assert r.status == 200
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 2
    while not all(w.aborts for w in workers):
        assert loop.time() < deadline
        await asyncio.sleep(0.01)
    assert all(w.aborts == [{"request_ids": ["generate-tokens-zz"]}] for w in workers)

    # Without the broadcast: the decision is made before the call answers (the handler runs
    # abort_ids to its end), so a recorder on the broadcast sees the final word, with no waiting.
    client2, app2 = await proxy_factory([workers[0].url], [workers[2].url], abort_unknown_broadcast=False)
    broadcasts: list[list[str]] = []

    async def record(ids: list[str]) -> None:
        broadcasts.append(ids)

    app2[SERVING].aborts.broadcast_abort = record  # type: ignore[method-assign,assignment]
    r = await client2.post("/inference/v1/abort_requests", json={"request_ids": ["generate-tokens-yy"]})
    assert r.status == 200
    assert broadcasts == [] and len(app2[SERVING].tracker) == 0
    assert app2[SERVING].metrics.aborts.labels(source="client_call", state="unknown")._value.get() == 1
    assert len(workers[0].aborts) == 1


@pytest.mark.parametrize(("body", "status", "message"), [
    (b'{"ids": ["x"]}', 400, "Missing 'request_ids' in request body"),
    (b"not json{", 400, "JSON decode error: Expecting value: line 1 column 1 (char 0)"),
    (b'{"request_ids": "generate-tokens-x"}', 200, None),
    (b'{"request_ids": []}', 200, None),
])
async def test_abort_endpoint_contract(pd_factory: PDFactory, body: bytes, status: int,
                                       message: str | None) -> None:
    pd = await pd_factory(abort_unknown_broadcast=False)
    r = await pd.client.post("/inference/v1/abort_requests", data=body,
                             headers={"Content-Type": "application/json"})
    assert r.status == status
    if message is None:
        assert await r.read() == b""
    else:
        assert await r.json() == {"error": {"message": message, "type": "Bad Request", "param": None,
                                            "code": 400}}


async def test_abort_needs_the_key_and_legacy_path(pd_factory: PDFactory) -> None:
    pd = await pd_factory(api_key="k", hold_between_hops=10.0)
    key = {"Authorization": "Bearer k"}
    task = asyncio.create_task(pd.client.post("/inference/v1/generate", json=req(request_id="key1"),
                                              headers=key))
    await wait_for_state(pd, "kv_held")
    assert await abort(pd, "generate-tokens-key1") == 401
    assert await abort(pd, "generate-tokens-key1", path="/abort_requests") == 401
    assert pd.serving.table.get("generate-tokens-key1")[0].abort_source is None
    assert await abort(pd, "generate-tokens-key1", path="/abort_requests", headers=key) == 200
    body = await (await asyncio.wait_for(task, 5)).json()
    assert body["choices"][0]["finish_reason"] == "abort"
    await pd.quiet(limit=1.0)


async def test_legacy_path_can_mirror_vllm(pd_factory: PDFactory) -> None:
    pd = await pd_factory(api_key="k", legacy_abort_mirror_vllm=True, abort_unknown_broadcast=False)
    assert await abort(pd, "generate-tokens-x", path="/abort_requests") == 200
    assert await abort(pd, "generate-tokens-x") == 401


async def test_requests_table_and_debug_views(pd_factory: PDFactory) -> None:
    pd = await pd_factory(hold_between_hops=10.0)
    task = asyncio.create_task(pd.client.post("/inference/v1/generate", json=req(request_id="tb")))
    await wait_for_state(pd, "kv_held")
    table = await (await pd.client.get("/debug/requests")).json()
    assert table["requests"][0]["state"] == "kv_held"
    assert table["requests"][0]["holders"] == [pd.p.url]
    assert (await leases(pd))["open"][0]["worker"] == pd.p.url
    await abort(pd, "generate-tokens-tb")
    await asyncio.wait_for(task, 5)
    await pd.quiet(limit=1.0)
    assert (await (await pd.client.get("/debug/requests")).json())["requests"] == []


@pytest.mark.parametrize("how", ["first_token_from_p", "opened_at_d", "aborted_before_any_token"])
async def test_every_client_stream_has_the_same_headers(pd_factory: PDFactory, how: str) -> None:
    # One constructor for a client's event stream (proxy.sse.relay.event_stream): the stream opened with
    # P's token, the one opened when D answers, and the one of a request aborted before any token.
    if how == "aborted_before_any_token":
        pd = await pd_factory(prefill=SLOW_PREFILL)
    else:
        pd = await pd_factory(first_token_from_prefill=how == "first_token_from_p")
    task = asyncio.create_task(pd.client.post("/inference/v1/generate",
                                              json={**req(request_id="h1"), "stream": True}))
    if how == "aborted_before_any_token":
        await wait_for_state(pd, "prefilling")
        assert await abort(pd, "generate-tokens-h1") == 200
    r = await asyncio.wait_for(task, 5)
    events = sse_datas(await r.read())
    assert r.status == 200 and events[-1] == "[DONE]"
    assert finish_reasons(events) == (["abort"] if how == "aborted_before_any_token" else ["length"])
    assert r.headers["Content-Type"] == "text/event-stream; charset=utf-8"
    assert r.headers["Cache-Control"] == "no-cache"
    assert r.headers["Transfer-Encoding"] == "chunked"
    await pd.quiet(limit=1.0)


async def aborted_while_it_waits_for(
        pool: str, scripted_factory: ScriptedFactory, proxy_factory: ProxyFactory,
        stream: bool) -> tuple[Scripted, Scripted, Any]:
    """A request ("busy") holds the only worker of ``pool`` (each worker's in-flight cap 1);
    another ("vic") comes and waits for one, and is aborted meanwhile; then the worker frees up.
    Returns P, D and the proxy's client once both requests ended, vic with vLLM's aborted answer."""
    free = asyncio.Event()

    def worker(role: str) -> Any:
        async def reply(body: dict[str, Any], request: Any) -> Any:
            if body["request_id"] == "busy" and role == pool:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(free.wait(), 5)
            return prefill_reply(body) if role == "prefill" else prefill_reply(body, kv_transfer_params=None)
        return reply

    p = await scripted_factory(worker("prefill"))
    d = await scripted_factory(worker("decode"))
    client, app = await proxy_factory([p.url], [d.url], first_token_from_prefill=False,
                                      pools=PoolSettings.plain(max_inflight_per_worker=1))
    serving = app[SERVING]
    busy = asyncio.ensure_future(client.post("/inference/v1/generate", json=req(request_id="busy")))
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 5
    while not (p if pool == "prefill" else d).received:
        assert loop.time() < deadline, f"the first request never reached the {pool} worker"
        await asyncio.sleep(0.01)
    victim = asyncio.ensure_future(client.post("/inference/v1/generate",
                                               json={**req(request_id="vic"), "stream": stream}))
    waiting = "kv_held" if pool == "decode" else "prefilling"
    while not any(r.phase.value == waiting and r.base_id == "vic" for r in serving.table.all()):
        assert loop.time() < deadline, f"the second request never waited for a {pool} worker"
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)  # it waits
    a = await client.post("/inference/v1/abort_requests", json={"request_ids": ["generate-tokens-vic"]})
    assert a.status == 200
    free.set()  # the worker frees up: the aborted request gets it
    r = await asyncio.wait_for(victim, 5)
    assert r.status == 200
    assert b'"finish_reason":"abort"' in (await r.read()).replace(b" ", b"")
    await (await busy).read()
    while len(serving.table) or len(serving.tracker):
        assert loop.time() < deadline + 5, "the requests never ended"
        await asyncio.sleep(0.02)
    return p, d, client


@pytest.mark.parametrize("stream", [False, True])
async def test_a_request_aborted_while_it_waits_for_a_decode_worker_never_decodes(
        scripted_factory: ScriptedFactory, proxy_factory: ProxyFactory, stream: bool) -> None:
    """KV_HELD, every decode worker at its in-flight cap: the request waits for one. Aborted
    meanwhile, it gets vLLM's aborted answer once a worker frees up, and D is sent only the
    release of P's KV (one token), not the request. Before, the whole decode hop went to D."""
    _, d, client = await aborted_while_it_waits_for("decode", scripted_factory, proxy_factory, stream)
    vic = [b for b in d.received if b["request_id"] == "vic"]
    assert len(vic) == 1 and vic[0]["sampling_params"]["max_tokens"] == 1 and not vic[0].get("stream")
    assert vic[0]["kv_transfer_params"] == KV_PARAMS  # the release: D pulls, P frees
    ledger = await (await client.get("/debug/kv-leases")).json()
    assert ledger["open"] == [] and len(ledger["closed"]) == 2


@pytest.mark.parametrize("stream", [False, True])
async def test_a_request_aborted_while_it_waits_for_a_prefill_worker_is_never_prefilled(
        scripted_factory: ScriptedFactory, proxy_factory: ProxyFactory, stream: bool) -> None:
    """Every prefill worker at its in-flight cap: the request waits for one. Aborted meanwhile,
    it gets vLLM's aborted answer once a worker frees up, and the prefill hop is never sent (P's
    compute goes to requests that will decode). Before, P prefilled it all the same."""
    p, d, _ = await aborted_while_it_waits_for("prefill", scripted_factory, proxy_factory, stream)
    assert [b["request_id"] for b in p.received] == ["busy"]
    assert [b["request_id"] for b in d.received] == ["busy"]


@pytest.mark.parametrize("stream", [False, True])
async def test_a_decode_worker_queueing_the_request_past_the_lease_still_closes_it_pulled(
        pd_factory: PDFactory, stream: bool) -> None:
    """P's lease is 1 s; D runs one request at a time and is busy for ~2 s, queueing ours, and
    heartbeats P's lease meanwhile (as vLLM does), then pulls. The ledger says ``pulled``.
    Before, the proxy's sweep closed it ``expired`` at 1 s on its own clock, and the pull that
    followed could not change a first reason."""
    pd = await pd_factory(lease_duration=1.0, prefill={"lease_seconds": 1.0},
                          decode={"zero_latency": False, "max_running": 1, "itl_ms": 150.0,
                                  "prefill_base_ms": 0.0, "kv_heartbeat_s": 0.2})
    busy = asyncio.ensure_future(pd.d.session.post(pd.d.url + "/inference/v1/generate", json={
        "token_ids": [5, 6, 7], "sampling_params": {"temperature": 0, "max_tokens": 14}}))
    await asyncio.sleep(0.2)  # D is busy with it
    ours = asyncio.ensure_future(pd.client.post(
        "/inference/v1/generate", json={**req(request_id="hb", sp={"max_tokens": 3}), "stream": stream}))
    # The case: the lease outlives its 1 s while D queues the request. Each read of the ledger
    # expires what has run out by the clock; past 1 s the lease must still be open.
    age = 0.0
    for _ in range(300):  # 30 s at most
        ledger = await leases(pd)
        assert ledger["closed"] == [], "the lease closed while D queued the request"
        if ledger["open"]:
            age = ledger["open"][0]["age_s"]
            if age > 1.2:
                break
        await asyncio.sleep(0.1)
    assert age > 1.2, "D did not queue the request past P's lease"
    r = await ours
    assert r.status == 200
    await r.read()
    await (await busy).read()
    assert (await pd.p.state())["releases"]["pulled"] == 1
    closed = (await leases(pd))["closed"]
    assert [c["reason"] for c in closed] == ["pulled"] and closed[0]["age_s"] > 1.2
    await pd.quiet()
