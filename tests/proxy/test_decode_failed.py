"""P's KV after the decode hop failed with no retry left, whoever hears of the failure: the
handler, the stream's producer, or the clean-up once the client had gone. In every case the KV is
released through a one-token decode with P's params (D's 4xx: the same decode worker, which
registered nothing; a 5xx: another one), as `test_failures.py` checks with the client there, and
the lease ends with it: never left open, never said freed when it was not."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest
from aiohttp import web

from proxy.http.app import SERVING
from proxy.http.serving import Serving
from tests.proxy.conftest import ProxyFactory, req
from tests.proxy.scripted import KV_PARAMS, Scripted, ScriptedFactory, SSEBytes, prefill_reply

KV_FAILED = (b'data: {"error":{"message":"KV load failed","type":"InternalServerError",'
             b'"param":null,"code":500}}\n\n')


def is_release(body: dict[str, Any]) -> bool:
    return body["sampling_params"].get("max_tokens") == 1 and not body.get("stream")


def released(workers: list[Scripted]) -> list[Scripted]:
    """The decode workers that were sent a release of P's KV (one-token decode, P's params)."""
    return [w for w in workers
            if any(is_release(b) and b.get("kv_transfer_params") == KV_PARAMS for b in w.received)]


async def settled(serving: Serving, limit: float = 8.0) -> None:
    """Until the request left the table and every task of the proxy ended (bounded)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit
    while len(serving.table) or len(serving.tracker):
        assert loop.time() < deadline, f"the request never ended: {serving.table.all()}"
        await asyncio.sleep(0.02)


def gone_count(serving: Serving) -> float:
    value = serving.metrics.registry.get_sample_value(
        "pd_proxy_aborts_total", {"source": "disconnect", "state": "decoding"})
    return value or 0.0


@pytest.mark.parametrize("mode", ["nonstream", "stream", "stream_ps_token_first"])
@pytest.mark.parametrize("status", [400, 503])
async def test_d_fails_the_hop_after_the_client_left_and_ps_kv_is_still_released(
        scripted_factory: ScriptedFactory, proxy_factory: ProxyFactory, mode: str,
        status: int) -> None:
    """The client goes away while the decode hop waits for D; then D refuses it (400: it
    registered nothing) or fails it (503). Before, no release was sent: P held the KV until its
    lease, and a stream's lease was closed ``aborted`` as if it had been freed."""
    refuse = asyncio.Event()

    async def decode(body: dict[str, Any], request: web.Request) -> Any:
        if is_release(body):
            return prefill_reply(body, kv_transfer_params=None)  # D pulls, P frees
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(refuse.wait(), 5)
        return web.json_response({"error": {"message": "no", "type": "BadRequestError", "param": None,
                                            "code": status}}, status=status)

    p = await scripted_factory(lambda body, request: prefill_reply(body))
    ds = [await scripted_factory(decode) for _ in range(2 if status == 503 else 1)]
    client, app = await proxy_factory([p.url], [ds[0].url], abort_grace=0.05,
                                      first_token_from_prefill=mode == "stream_ps_token_first")
    serving = app[SERVING]
    for d in ds[1:]:  # the other decode worker joins once the first has the hop
        serving.pools.decode.add(d.url, "test")
    stream = mode != "nonstream"

    async def call() -> None:
        r = await client.post("/inference/v1/generate",
                              json={**req(request_id="g1", sp={"max_tokens": 8}), "stream": stream})
        try:
            while await r.content.readany():
                pass
        finally:
            r.close()  # cancelled: the connection is closed

    task = asyncio.ensure_future(call())
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 5
    while not ds[0].received:
        assert loop.time() < deadline, "the decode hop never came"
        await asyncio.sleep(0.01)
    task.cancel()  # the client goes away
    with contextlib.suppress(asyncio.CancelledError):
        await task
    while gone_count(serving) != 1:
        assert loop.time() < deadline, "the proxy never saw the client go"
        await asyncio.sleep(0.01)
    refuse.set()
    await settled(serving)
    ledger = await (await client.get("/debug/kv-leases")).json()
    assert ledger["open"] == []
    assert [c["reason"] for c in ledger["closed"]] == ["aborted"]  # released
    assert released(ds) == [ds[0] if status == 400 else ds[1]]


async def test_a_stream_whose_ds_first_event_is_a_kv_failure_with_no_retry_left_releases_ps_kv(
        scripted_factory: ScriptedFactory, proxy_factory: ProxyFactory) -> None:
    """D's first event is a server error on the hop with P's params (its KV load failed) and no
    decode attempt is left: the client's stream ends with the error, and P's KV is released
    through another decode worker, as after a 5xx answer. Before, the lease stayed open (the
    ledger's sweep would have called it expired) and nothing was released."""
    def decode(body: dict[str, Any], request: web.Request) -> Any:
        return prefill_reply(body, kv_transfer_params=None) if is_release(body) else SSEBytes([KV_FAILED])

    p = await scripted_factory(lambda body, request: prefill_reply(body))
    d1 = await scripted_factory(decode)
    client, app = await proxy_factory([p.url], [d1.url], first_token_from_prefill=False)
    serving = app[SERVING]
    d2 = await scripted_factory(decode)
    serving.pools.decode.add(d2.url, "test")
    r = await client.post("/inference/v1/generate", json={**req(request_id="kf1"), "stream": True})
    assert r.status == 200
    assert b"KV load failed" in await r.read()
    await settled(serving)
    ledger = await (await client.get("/debug/kv-leases")).json()
    assert ledger["open"] == []
    assert [c["reason"] for c in ledger["closed"]] == ["aborted"]
    assert released([d1, d2]) == [d2]
