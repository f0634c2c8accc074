"""A stream's producer that raises (a bug, not a worker's failure) ends its client's answer: a
generic 500 before D answered, the proxy's in-band error event once the client's stream is open
(D answered, or P's token went first); never quoting the exception. The clean-up then frees what
D and P hold, as after any walk that did not finish: the request leaves the table, P's lease is
closed, no task is left behind, nothing is left for asyncio to log. Such a request is counted as
the proxy's own failure (``internal_error``), as is a crash handling D's non-stream answer. A
crash after its client was answered an abort is logged all the same."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from proxy.observe.state import Phase
from proxy.pools import PoolSettings
from proxy.pools.breaker import CircuitState
from proxy.stream.read import DecodeReader
from proxy.upstream.client import Upstream
from proxy.upstream.hop import HopResponse
from proxy.walk.full import FullDecode
from proxy.wire.errors import ProxyError
from tests.proxy.conftest import PD, PDFactory, req, sse_datas

SECRET = "secret prompt text"
INTERNAL = {"error": {"message": "Internal server error", "type": "InternalServerError", "param": None,
                      "code": 500}}
PACED = {"zero_latency": False, "itl_ms": 100.0, "prefill_base_ms": 0.0, "prefill_per_token_ms": 0.0,
         "transfer_per_block_ms": 0.0}
"""A decode worker that sends a token every 100 ms (200 tokens: 20 s unless it is stopped)."""
BOUND = 30.0
"""Every wait for the client's answer: a hang fails the test, not pytest's timeout."""


def crash_at_the_first_attempt(monkeypatch: pytest.MonkeyPatch) -> None:
    """The producer raises before D's stream is opened."""
    async def once(*_: Any, **__: Any) -> Any:
        raise RuntimeError(SECRET)

    monkeypatch.setattr(DecodeReader, "once", once)


def crash_after_the_first_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """The producer reads D's first read of its stream as usual, then raises at the next one
    (every read goes to the reader's sink)."""
    pipe = Upstream.pipe

    async def crashing(self: Upstream, hop: str, worker: str, resp: HopResponse,
                       sink: Callable[[bytes], bool]) -> None:
        reads = 0

        def first_only(data: bytes) -> bool:
            nonlocal reads
            reads += 1
            if reads > 1:
                raise RuntimeError(SECRET)
            return sink(data)

        await pipe(self, hop, worker, resp, first_only)

    monkeypatch.setattr(Upstream, "pipe", crashing)


async def post_stream(pd: PD, body: dict[str, Any]) -> tuple[int, bytes]:
    r = await asyncio.wait_for(pd.client.post("/inference/v1/generate", json={**body, "stream": True}), BOUND)
    return r.status, await asyncio.wait_for(r.read(), BOUND)


async def closed_leases(pd: PD) -> list[str]:
    """The reasons P's leases were closed with; none may be left open."""
    ledger = await (await pd.client.get("/debug/kv-leases")).json()
    assert ledger["open"] == []
    return [lease["reason"] for lease in ledger["closed"]]


@contextlib.contextmanager
def logged(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """The proxy's errors and its access lines captured."""
    with caplog.at_level(logging.ERROR, logger="pd_proxy"), \
            caplog.at_level(logging.INFO, logger="pd_proxy.access"):
        yield


async def counted_as_internal_errors(pd: PD, caplog: pytest.LogCaptureFixture, status: int) -> None:
    """The request is counted as the proxy's own failure (not ``ok``, not ``aborted``), and its
    access line says so, with the status its client got."""
    metrics = await (await pd.client.get("/metrics")).text()
    assert 'pd_proxy_requests_total{outcome="internal_error"} 1.0' in metrics
    for other in ("ok", "aborted", "upstream_error"):
        assert f'pd_proxy_requests_total{{outcome="{other}"}} 0.0' in metrics
    access = [r.getMessage() for r in caplog.records if r.name == "pd_proxy.access"]
    assert len(access) == 1
    fields = access[0].split()
    assert "outcome=internal_error" in fields and f"status={status}" in fields


async def nothing_unretrieved(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        gc.collect()
        await asyncio.sleep(0)
    assert not [rec for rec in caplog.records if "never retrieved" in rec.getMessage()]


async def test_a_crash_before_ds_answer_is_a_generic_500(
        pd_factory: PDFactory, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # D never got the request: P frees its KV at the end of its own (short) lease.
    pd = await pd_factory(first_token_from_prefill=False, prefill={"lease_seconds": 0.5})
    crash_at_the_first_attempt(monkeypatch)
    with logged(caplog):
        status, raw = await post_stream(pd, req(request_id="crash-500"))
        await pd.quiet(limit=BOUND)  # the table and the tracker empty, nothing held on P or D
    assert status == 500 and json.loads(raw) == INTERNAL
    await counted_as_internal_errors(pd, caplog, 500)
    assert "unexpected RuntimeError while serving POST /inference/v1/generate" in caplog.text
    assert SECRET not in caplog.text
    assert await closed_leases(pd) == ["unknown"]  # whether D pulled is not known
    await nothing_unretrieved(caplog)


async def test_a_crash_is_not_charged_to_the_decode_worker(
        pd_factory: PDFactory, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The proxy's own bug in a decode attempt tells nothing about D: D's circuit, which one
    failure would open, stays closed, and the next request is served by it."""
    pd = await pd_factory(first_token_from_prefill=False, prefill={"lease_seconds": 0.5},
                          pools=PoolSettings.plain(breaker_failures=1))
    with monkeypatch.context() as crashing, logged(caplog):
        crash_at_the_first_attempt(crashing)
        status, _ = await post_stream(pd, req(request_id="crash-not-d"))
        await pd.quiet(limit=BOUND)
    assert status == 500
    (d,) = pd.serving.pools.decode.workers
    assert d.breaker.state is CircuitState.CLOSED
    status, raw = await post_stream(pd, req(request_id="after-crash"))
    assert status == 200 and sse_datas(raw)[-1] == "[DONE]"
    await pd.quiet(limit=BOUND)


async def test_a_crash_handling_ds_non_stream_answer_is_a_generic_500(
        pd_factory: PDFactory, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """D answered a non-stream request in full and the proxy raises handling the answer: the
    client gets the generic 500, counted as the proxy's own failure, and nothing is left held."""
    def reply(*_: Any, **__: Any) -> Any:
        raise RuntimeError(SECRET)

    monkeypatch.setattr(FullDecode, "_reply", reply)
    pd = await pd_factory()
    with logged(caplog):
        r = await asyncio.wait_for(
            pd.client.post("/inference/v1/generate", json=req(request_id="crash-full")), BOUND)
        raw = await asyncio.wait_for(r.read(), BOUND)
        await pd.quiet(limit=BOUND)
    assert r.status == 500 and json.loads(raw) == INTERNAL
    assert "unexpected RuntimeError while serving POST /inference/v1/generate" in caplog.text
    assert SECRET not in caplog.text
    await counted_as_internal_errors(pd, caplog, 500)
    assert len(await closed_leases(pd)) == 1  # P's lease closed by the clean-up, none left open
    await nothing_unretrieved(caplog)


async def test_a_crash_after_ds_first_event_ends_the_stream_in_band(
        pd_factory: PDFactory, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    pd = await pd_factory(first_token_from_prefill=False, decode=PACED)
    crash_after_the_first_read(monkeypatch)
    with logged(caplog):
        status, raw = await post_stream(pd, req(request_id="crash-in-band", sp={"max_tokens": 200}))
        # D stops at once (its connection closed, then the clean-up's abort), not after 20 s.
        await pd.quiet(limit=10.0)
    events = sse_datas(raw)
    assert status == 200 and len(events) == 3
    choice = events[0]["choices"][0]
    assert len(choice["token_ids"]) == 1 and choice["finish_reason"] is None  # D's first event
    assert raw.endswith(ProxyError("Internal server error").sse_event() + b"data: [DONE]\n\n")
    assert events[1:] == [INTERNAL, "[DONE]"]
    assert "unexpected RuntimeError while reading a decode stream" in caplog.text
    assert SECRET not in caplog.text and SECRET.encode() not in raw
    assert (await pd.d.state())["generate_calls"] == 1
    metrics = await (await pd.client.get("/metrics")).text()
    assert 'pd_proxy_abort_fanout_total{pool="decode",result="ok"} 1.0' in metrics  # the clean-up's
    await counted_as_internal_errors(pd, caplog, 200)
    assert await closed_leases(pd) == ["pulled"]  # D's first event: it had P's KV
    await nothing_unretrieved(caplog)


async def test_a_crash_after_ps_token_went_first_ends_the_stream_in_band(
        pd_factory: PDFactory, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    pd = await pd_factory(first_token_from_prefill=True, prefill={"lease_seconds": 0.5})
    crash_at_the_first_attempt(monkeypatch)
    with logged(caplog):
        status, raw = await post_stream(pd, req(request_id="crash-after-p"))
        await pd.quiet(limit=BOUND)
    events = sse_datas(raw)
    assert status == 200 and len(events) == 3
    assert len(events[0]["choices"][0]["token_ids"]) == 1  # P's token
    assert raw.endswith(ProxyError("Internal server error").sse_event() + b"data: [DONE]\n\n")
    assert events[1:] == [INTERNAL, "[DONE]"]
    assert "unexpected RuntimeError while reading a decode stream" in caplog.text
    assert SECRET not in caplog.text and SECRET.encode() not in raw
    assert await closed_leases(pd) == ["unknown"]
    await counted_as_internal_errors(pd, caplog, 200)
    await nothing_unretrieved(caplog)


@pytest.mark.parametrize("mode", ["stream", "non-stream"])
async def test_a_crash_after_its_client_was_answered_an_abort_is_logged(
        pd_factory: PDFactory, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        mode: str) -> None:
    """Aborted before D answered, and D did not answer within the grace: the client got vLLM's
    aborted answer and its handler left. The decode hop crashes after that (the stream's
    producer; the non-stream hop's own task, under aiohttp's server): no handler is left to log
    it, so the clean-up does, without its message."""
    crash = asyncio.Event()

    async def crashing(*_: Any, **__: Any) -> Any:
        await asyncio.wait_for(crash.wait(), BOUND)  # D's answer never comes before the crash
        raise RuntimeError(SECRET)

    if mode == "stream":
        monkeypatch.setattr(DecodeReader, "once", crashing)
    else:
        post = Upstream.post_generate_raw

        def decode_crashing(self: Upstream, hop: str, *args: Any, **kwargs: Any) -> Any:
            return crashing() if hop == "decode" else post(self, hop, *args, **kwargs)

        monkeypatch.setattr(Upstream, "post_generate_raw", decode_crashing)
    pd = await pd_factory(first_token_from_prefill=False, abort_grace=0.05, prefill={"lease_seconds": 0.5})
    with logged(caplog):
        call = asyncio.create_task(pd.client.post("/inference/v1/generate",
                                                  json=req(request_id="crash-late", stream=mode == "stream")))
        loop = asyncio.get_running_loop()
        end = loop.time() + BOUND
        while not [r for r in pd.serving.table.all() if r.phase is Phase.DECODING]:
            assert loop.time() < end, "the request never reached its decode"
            await asyncio.sleep(0.01)
        abort = await pd.client.post("/abort_requests", json={"request_ids": ["generate-tokens-crash-late"]})
        assert abort.status == 200
        r = await asyncio.wait_for(call, BOUND)
        raw = await asyncio.wait_for(r.read(), BOUND)
        # vLLM's aborted answer (a stream's or a full one)
        assert r.status == 200 and b'"finish_reason":"abort"' in raw.replace(b" ", b"")
        assert "unexpected" not in caplog.text
        crash.set()
        await pd.quiet(limit=BOUND)
    assert "unexpected RuntimeError while decoding a request whose client was answered an abort" \
        in caplog.text
    assert SECRET not in caplog.text
    await nothing_unretrieved(caplog)
