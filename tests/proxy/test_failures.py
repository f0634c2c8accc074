"""Upstream failures, the prefill-failure policy, the output_mode echo, keys and health."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator
from typing import Any

import pytest

from proxy.pools import PoolSettings
from proxy.pools.breaker import CircuitState
from tests.proxy.conftest import PDFactory, ProxyFactory, req, sse_datas
from tests.proxy.scripted import KV_PARAMS, Scripted, ScriptedFactory, SSEBytes, prefill_reply


@pytest.fixture
def dead_url() -> Iterator[str]:
    """A loopback port nobody listens on: bound, not listening, for the whole test, so that a
    connection to it is refused and no server of the test (bound to port 0) is given it (a port
    let go before use once went to the proxy under test, which then answered its own prefill hop)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{s.getsockname()[1]}"


async def test_prefill_5xx_is_a_502_naming_the_prefill_worker(pd_factory: PDFactory) -> None:
    pd = await pd_factory()
    await pd.p.set_faults(fail_next=1, fail_status=503)
    status, body, _ = await pd.gen(req())
    assert status == 502
    assert body["error"]["message"].startswith(f"prefill worker {pd.p.url}: answered HTTP 503")
    assert body["error"]["code"] == 502
    await pd.quiet()


async def test_prefill_4xx_passes_through_unchanged(pd_factory: PDFactory) -> None:
    pd = await pd_factory()
    await pd.p.set_faults(fail_next=1, fail_status=429)
    r = await pd.client.post("/inference/v1/generate", json=req())
    raw = await r.read()
    await pd.p.set_faults(fail_next=1, fail_status=429)
    direct = await pd.p.session.post(pd.p.url + "/inference/v1/generate", json=req())
    assert r.status == 429 == direct.status
    assert raw == await direct.read()
    await pd.quiet()


async def test_prefill_timeout_is_a_504(pd_factory: PDFactory) -> None:
    pd = await pd_factory(prefill_timeout=0.3)
    await pd.p.set_faults(hang_before_headers=True)
    status, body, _ = await pd.gen(req())
    assert status == 504
    assert body["error"]["type"] == "GatewayTimeoutError"
    assert f"prefill worker {pd.p.url}" in body["error"]["message"]
    await pd.p.set_faults(hang_before_headers=False)
    await pd.quiet()


async def test_unreachable_prefill_is_a_502(proxy_factory: ProxyFactory, sim_factory: Any,
                                            dead_url: str) -> None:
    d = await sim_factory(role="decode", zero_latency=True)
    client, _ = await proxy_factory([dead_url], [d.url])
    r = await client.post("/inference/v1/generate", json=req())
    body = await r.json()
    assert r.status == 502 and f"prefill worker {dead_url}: unreachable" in body["error"]["message"]


async def test_missing_kv_params_fails_by_default(pd_factory: PDFactory) -> None:
    pd = await pd_factory()
    await pd.p.set_faults(drop_kv_params=True)
    status, body, _ = await pd.gen(req())
    assert status == 502
    assert "kv_transfer_params is null" in body["error"]["message"]
    assert pd.p.url in body["error"]["message"]
    metrics = await (await pd.client.get("/metrics")).text()
    assert "pd_proxy_prefill_missing_kv_params_total 1.0" in metrics


@pytest.mark.parametrize("fault", ["drop_kv_params", "fail"])
async def test_decode_only_fallback_is_counted_and_visible(pd_factory: PDFactory, sim_factory: Any,
                                                           fault: str) -> None:
    # Without params the proxy cannot free what P holds: it waits for P's (short) lease.
    pd = await pd_factory(prefill_failure_policy="decode-only", prefill={"lease_seconds": 0.5})
    if fault == "fail":
        await pd.p.set_faults(fail_next=1, fail_status=500)
    else:
        await pd.p.set_faults(drop_kv_params=True)
    status, body, headers = await pd.gen(req(request_id="fb"))
    assert status == 200
    reason = "missing_kv_params" if fault == "drop_kv_params" else "prefill_error"
    assert headers["X-PD-Decode-Only"] == reason
    agg = await sim_factory(role="aggregated", zero_latency=True)
    resp = await agg.session.post(agg.url + "/inference/v1/generate", json=req(request_id="fb"))
    direct = await resp.json()
    assert body["choices"] == direct["choices"]
    metrics = await (await pd.client.get("/metrics")).text()
    assert f'pd_proxy_decode_only_total{{reason="{reason}"}} 1.0' in metrics
    await pd.quiet()


async def test_decode_5xx_with_a_second_decode_worker_releases_the_kv(pd_factory: PDFactory) -> None:
    pd = await pd_factory(n_decode=2)
    await pd.decode[0].set_faults(fail_next=1, fail_status=503)  # the first pick of the pool
    status, body, _ = await pd.gen(req())
    assert status == 502 and f"decode worker {pd.decode[0].url}" in body["error"]["message"]
    await pd.quiet(limit=1.0)  # P's lease is 30 s: freed by the release through decode[1]
    ledger = await (await pd.client.get("/debug/kv-leases")).json()
    assert ledger["closed"][0]["reason"] == "aborted"


async def test_decode_5xx_is_a_502_naming_the_decode_worker(pd_factory: PDFactory) -> None:
    pd = await pd_factory(prefill={"lease_seconds": 0.3})
    await pd.d.set_faults(fail_next=1, fail_status=500)
    status, body, _ = await pd.gen(req())
    assert status == 502 and f"decode worker {pd.d.url}" in body["error"]["message"]


@pytest.mark.parametrize("stream", [False, True])
async def test_decode_4xx_passes_through_and_kv_is_still_released(pd_factory: PDFactory,
                                                                  stream: bool) -> None:
    # P's lease is 30 s: only the proxy's release frees the KV in time
    pd = await pd_factory(first_token_from_prefill=False)
    await pd.d.set_faults(fail_next=1, fail_status=400)
    r = await pd.client.post("/inference/v1/generate", json={**req(), "stream": stream})
    assert r.status == 400
    assert (await r.json())["error"]["code"] == 400
    await pd.quiet(limit=1.0)
    ledger = await (await pd.client.get("/debug/kv-leases")).json()
    assert ledger["closed"][0]["reason"] == "aborted"


async def test_decode_4xx_after_the_prefill_workers_token_ends_in_band(pd_factory: PDFactory) -> None:
    """The client has P's token (the headers are out): D's 400 becomes the stream's error event,
    with D's status as its code, and P's KV is still released."""
    pd = await pd_factory()
    await pd.d.set_faults(fail_next=1, fail_status=400)
    status, events, _ = await pd.stream(req(sp={"max_tokens": 10}))
    assert status == 200 and len(events[0]["choices"][0]["token_ids"]) == 1
    assert events[1]["error"]["code"] == 400 and events[2:] == ["[DONE]"]
    await pd.quiet(limit=1.0)
    ledger = await (await pd.client.get("/debug/kv-leases")).json()
    assert ledger["closed"][0]["reason"] == "aborted"


async def test_decode_stream_reset_becomes_in_band_error(pd_factory: PDFactory) -> None:
    pd = await pd_factory()
    await pd.d.set_faults(reset_after_tokens=3)
    status, events, _ = await pd.stream(req(sp={"max_tokens": 10}))
    assert status == 200
    tokens = [t for e in events[:-2] for t in e["choices"][0]["token_ids"]]
    assert len(tokens) == 3
    assert "error" in events[-2] and f"decode worker {pd.d.url}" in events[-2]["error"]["message"]
    assert events[-1] == "[DONE]"
    await pd.d.set_faults(reset_after_tokens=None)
    await pd.quiet()


async def test_decode_in_band_error_is_relayed(pd_factory: PDFactory) -> None:
    pd = await pd_factory()
    await pd.d.set_faults(error_after_tokens=2)
    status, events, _ = await pd.stream(req(sp={"max_tokens": 10}))
    direct_err = [e for e in events if isinstance(e, dict) and "error" in e]
    assert status == 200 and len(direct_err) == 1
    assert events[-1] == "[DONE]"
    chunks = [e for e in events if isinstance(e, dict) and "choices" in e]
    assert sum(len(e["choices"][0]["token_ids"]) for e in chunks) == 2
    await pd.d.set_faults(error_after_tokens=None)
    await pd.quiet()


async def test_stream_without_done_becomes_in_band_error(scripted_factory: ScriptedFactory,
                                                         proxy_factory: ProxyFactory,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    def chunk(token: int) -> bytes:
        return (b'data: {"request_id":"generate-tokens-x","usage":null,"output_mode":"tokens","choices":'
                b'[{"index":0,"finish_reason":null,"stop_reason":null,"token_ids":[%d],"logprobs":null}]}'
                b'\n\n' % token)
    p: Scripted = await scripted_factory(lambda b, r: prefill_reply(b))  # P's token: 7
    d: Scripted = await scripted_factory(lambda b, r: SSEBytes([chunk(7), chunk(5), b"data: {\"trunc"]))
    client, _ = await proxy_factory([p.url], [d.url])
    r = await client.post("/inference/v1/generate", json={**req(), "stream": True})
    events = sse_datas(await r.read())
    assert [e["choices"][0]["token_ids"] for e in events[:2]] == [[7], [5]]
    assert "stream ended without [DONE]" in events[2]["error"]["message"]
    assert events[3] == "[DONE]" and len(events) == 4
    # The client-visible error is in the log, with why it was not migrated (migration is off here)
    ended = [m.getMessage() for m in caplog.records if "stream ended with an error" in m.getMessage()]
    assert len(ended) == 1 and "not migrated: this request cannot migrate" in ended[0], ended


async def test_decode_stream_headers_timeout_is_a_504(pd_factory: PDFactory) -> None:
    pd = await pd_factory(stream_idle_timeout=0.3, prefill={"lease_seconds": 0.3},
                          first_token_from_prefill=False)
    await pd.d.set_faults(hang_before_headers=True)
    r = await pd.client.post("/inference/v1/generate", json={**req(), "stream": True})
    body = await r.json()
    assert r.status == 504 and f"decode worker {pd.d.url}" in body["error"]["message"]
    await pd.d.set_faults(hang_before_headers=False)


async def test_decode_stream_headers_timeout_after_the_prefill_workers_token_is_in_band(
        pd_factory: PDFactory) -> None:
    pd = await pd_factory(stream_idle_timeout=0.3, prefill={"lease_seconds": 0.3})
    await pd.d.set_faults(hang_before_headers=True)
    status, events, _ = await pd.stream(req())
    assert status == 200 and len(events[0]["choices"][0]["token_ids"]) == 1
    err = events[1]["error"]
    assert err["code"] == 504 and err["type"] == "GatewayTimeoutError"
    assert f"decode worker {pd.d.url}" in err["message"] and events[2:] == ["[DONE]"]
    await pd.d.set_faults(hang_before_headers=False)


async def test_endless_upstream_event_is_cut(scripted_factory: ScriptedFactory,
                                             proxy_factory: ProxyFactory) -> None:
    p: Scripted = await scripted_factory(lambda b, r: prefill_reply(b))
    d: Scripted = await scripted_factory(lambda b, r: SSEBytes([b"data: " + b"x" * 4000] * 3))
    client, _ = await proxy_factory([p.url], [d.url], slow_reader_max_bytes=5000)
    r = await client.post("/inference/v1/generate", json={**req(), "stream": True})
    events = sse_datas(await r.read())  # P's token first (first_token_from_prefill), then the cut
    assert [e for e in events[:-2] if "error" in e] == []
    assert "larger than the byte cap" in events[-2]["error"]["message"] and events[-1] == "[DONE]"


async def test_stream_idle_timeout_becomes_in_band_error(pd_factory: PDFactory) -> None:
    pd = await pd_factory(stream_idle_timeout=0.3)
    await pd.d.set_faults(hang_after_headers=True)
    status, events, _ = await pd.stream(req())
    assert status == 200 and len(events) == 3  # P's token, the timeout, [DONE]
    assert events[-2]["error"]["type"] == "GatewayTimeoutError" and events[-1] == "[DONE]"
    await pd.d.set_faults(hang_after_headers=False)


@pytest.mark.parametrize("stream", [False, True])
async def test_output_mode_echo_is_checked(scripted_factory: ScriptedFactory, proxy_factory: ProxyFactory,
                                           stream: bool) -> None:
    """A decode server that predates output_mode answers tokens with no echo."""
    old = prefill_reply({"request_id": "x", "token_ids": [1]})
    old.pop("output_mode")
    old_chunk = b'data: {"request_id":"generate-tokens-x","choices":[{"index":0,"token_ids":[5]}]}\n\n'
    p: Scripted = await scripted_factory(lambda b, r: prefill_reply(b))
    d: Scripted = await scripted_factory(
        lambda b, r: SSEBytes([old_chunk, b"data: [DONE]\n\n"]) if b.get("stream") else old)
    client, _ = await proxy_factory([p.url], [d.url])
    r = await client.post("/inference/v1/generate", json={**req(output_mode="text"), "stream": stream})
    if stream:
        events = sse_datas(await r.read())
        assert r.status == 200
        assert "output_mode" in events[0]["error"]["message"] and events[-1] == "[DONE]"
        assert not any("choices" in e for e in events if isinstance(e, dict))
    else:
        body = await r.json()
        assert r.status == 502 and "output_mode None for a 'text' request" in body["error"]["message"]


async def test_api_key_guards_inference_like_vllm(pd_factory: PDFactory) -> None:
    pd = await pd_factory(api_key="k1")
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "k1"}):
        r = await pd.client.post("/inference/v1/generate", json=req(), headers=headers)
        assert r.status == 401 and await r.read() == b'{"error":"Unauthorized"}'
        r = await pd.client.get("/debug/kv-leases", headers=headers)
        assert r.status == 401
    r = await pd.client.post("/inference/v1/generate", json=req(), headers={"Authorization": "bearer k1"})
    assert r.status == 200
    assert (await pd.client.get("/health")).status == 200
    assert (await pd.client.get("/metrics")).status == 200
    assert (await pd.client.get("/debug/kv-leases", headers={"Authorization": "Bearer k1"})).status == 200


async def test_upstream_api_key_is_sent(pd_factory: PDFactory) -> None:
    pd = await pd_factory(prefill={"api_key": "up"}, decode={"api_key": "up"}, upstream_api_key="up")
    status, _, _ = await pd.gen(req())
    assert status == 200
    pd2 = await pd_factory(prefill={"api_key": "up"}, decode={"api_key": "up"})
    r = await pd2.client.post("/inference/v1/generate", json=req())
    assert r.status == 401  # the prefill worker's 401 passes through


async def test_health_reports_pools(pd_factory: PDFactory, proxy_factory: ProxyFactory,
                                    dead_url: str) -> None:
    admin = {"Authorization": "Bearer adm"}
    pd = await pd_factory(pools=PoolSettings.plain(admin_key="adm"))
    r = await pd.client.get("/health", headers=admin)
    body = await r.json()
    assert r.status == 200 and body["status"] == "ok"
    assert body["pools"]["prefill"][0]["url"] == pd.p.url and body["pools"]["decode"][0]["healthy"]
    # The dead decode worker is seen by the active probes; /health reports their last verdict.
    client, _ = await proxy_factory([pd.p.url], [dead_url], pools=PoolSettings.plain(
        admin_key="adm", active_health=True, health_interval=0.05, health_fail_threshold=1))
    for _ in range(400):  # bounded: 20 s
        r = await client.get("/health", headers=admin)
        if r.status == 503:
            break
        await asyncio.sleep(0.05)
    body = await r.json()
    assert r.status == 503 and body["status"] == "degraded"
    assert body["pools"]["decode"][0]["healthy"] is False
    assert body["workers"]["decode"] == {"total": 1, "available": 0}


async def test_one_client_session_per_app(pd_factory: PDFactory) -> None:
    pd = await pd_factory()
    session = pd.serving.upstream.session
    for _ in range(3):
        await pd.gen(req())
    assert pd.serving.upstream.session is session
    assert not session.closed


def _late_prefill(worker_aborts: list[Any], *, finished: bool) -> Any:
    """A prefill worker whose answer comes only once it was sent an abort (bounded: 20 s):
    ``finished`` = it had prefilled (its KV held, the answer late), else vLLM's aborted answer."""
    async def reply(body: dict[str, Any], request: Any) -> dict[str, Any]:
        for _ in range(2000):
            if worker_aborts:
                break
            await asyncio.sleep(0.01)
        if finished:
            return prefill_reply(body)
        out = prefill_reply(body, kv_transfer_params=None)
        out["choices"][0]["finish_reason"] = "abort"
        return out
    return reply


def _decode_answer(body: dict[str, Any], request: Any) -> dict[str, Any]:
    out = prefill_reply(body, kv_transfer_params=None)
    out["choices"][0]["token_ids"] = [7, 8, 9]
    return out


async def test_a_prefill_hop_past_its_timeout_is_aborted_and_a_late_kv_is_taken(
        scripted_factory: ScriptedFactory, proxy_factory: ProxyFactory) -> None:
    """At its timeout the prefill hop is not cut: P is sent an abort and has the abort grace to
    answer. P had finished (its answer was late): the KV it holds is taken, not left on P with
    no params to release it by (the request goes on to the decode worker with P's params)."""
    p: Scripted = await scripted_factory(lambda b, r: None)
    p.reply = _late_prefill(p.aborts, finished=True)
    d: Scripted = await scripted_factory(_decode_answer)
    client, _ = await proxy_factory([p.url], [d.url], prefill_timeout=0.3)
    r = await client.post("/inference/v1/generate", json=req())
    assert r.status == 200 and (await r.json())["choices"][0]["token_ids"] == [7, 8, 9]
    assert [a["request_ids"] for a in p.aborts] == [[f"generate-tokens-{p.received[0]['request_id']}"]]
    assert d.received[0]["kv_transfer_params"]["remote_request_id"] == KV_PARAMS["remote_request_id"]


async def test_a_prefill_hop_past_its_timeout_that_p_aborts_is_a_504(
        scripted_factory: ScriptedFactory, proxy_factory: ProxyFactory) -> None:
    p: Scripted = await scripted_factory(lambda b, r: None)
    p.reply = _late_prefill(p.aborts, finished=False)
    d: Scripted = await scripted_factory(_decode_answer)
    client, _ = await proxy_factory([p.url], [d.url], prefill_timeout=0.3)
    r = await client.post("/inference/v1/generate", json=req())
    body = await r.json()
    assert r.status == 504 and body["error"]["type"] == "GatewayTimeoutError"
    assert f"prefill worker {p.url}" in body["error"]["message"]
    assert len(p.aborts) == 1 and d.received == []


@pytest.mark.parametrize("cut", ["deadline", "abort"])
async def test_prefill_hops_cut_short_by_the_request_do_not_open_ps_circuit(
        pd_factory: PDFactory, cut: str) -> None:
    """P needs 400 ms. Requests whose own deadline (300 ms: the prefill hop gets half) or whose
    client's abort cuts the prefill hop short are not P's failures: with a breaker that opens
    after 2, P still serves the next request. Before, two such requests opened P's circuit and
    a patient client got a 503 (no prefill worker)."""
    slow = {"zero_latency": False, "prefill_base_ms": 400.0, "prefill_per_token_ms": 0.0}
    pd = await pd_factory(prefill=slow, pools=PoolSettings.plain(breaker_failures=2))
    p = pd.serving.prefill_pool.workers[0]
    for i in range(3):
        if cut == "deadline":
            await pd.gen(req(), headers={"X-PD-Deadline-Ms": "300"})
        else:
            call = asyncio.ensure_future(pd.gen(req(request_id=f"cut{i}")))
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 5
            while (await pd.p.state())["generate_calls"] < i + 1:
                assert loop.time() < deadline, "the prefill hop never came"
                await asyncio.sleep(0.01)
            r = await pd.client.post("/inference/v1/abort_requests",
                                     json={"request_ids": [f"generate-tokens-cut{i}"]})
            assert r.status == 200
            await call
    assert p.breaker.state is CircuitState.CLOSED
    status, body, _ = await pd.gen(req())
    assert status == 200 and body["choices"][0]["finish_reason"] == "length"
    await pd.quiet()
