"""OpenTelemetry spans per hop (``proxy.observe.tracing``), against pd-sim workers with the SDK's in-memory
exporter: span names, parents and attributes, the ``traceparent`` each worker received, failures,
a client that goes away, and the disabled mode (nothing created, nothing sent)."""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

import proxy.cli
import proxy.observe.tracing
from proxy.config.settings import ProxySettings
from proxy.http.app import SERVING, build_app
from proxy.observe.tracing import NOOP_HOP, NOOP_TRACE, REQUEST_SPAN, Tracing, TracingUnavailable
from proxy.pools import PoolSettings
from tests.fixtures_sim import SimFactory, SimWorker
from tests.proxy.conftest import req

GEN = "/inference/v1/generate"
CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"


@dataclass
class Traced:
    client: TestClient[web.Request, web.Application]
    app: web.Application
    p: SimWorker
    d: SimWorker
    exporter: InMemorySpanExporter

    async def spans(self, request_id: str, *, want: Sequence[str] = (),
                    limit: float = 3.0) -> list[ReadableSpan]:
        """The finished spans of one request, once its request span (and ``want``) ended."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + limit
        while True:
            spans = [s for s in self.exporter.get_finished_spans()
                     if (s.attributes or {}).get("pd.request_id") == request_id]
            names = {s.name for s in spans}
            if REQUEST_SPAN in names and set(want) <= names:
                return spans
            if loop.time() > deadline:
                raise AssertionError(f"spans of {request_id}: {sorted(names)}")
            await asyncio.sleep(0.01)


TracedFactory = Callable[..., Awaitable[Traced]]


@pytest.fixture
def traced(sim_factory: SimFactory, aiohttp_client: Any) -> TracedFactory:
    async def make(*, otel: bool = True, decode: dict[str, Any] | None = None, **settings: Any) -> Traced:
        p = await sim_factory(role="prefill", zero_latency=True)
        d = await sim_factory(role="decode", **(decode or {"zero_latency": True}))
        exporter = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        settings.setdefault("pools", PoolSettings.plain())
        app = build_app(ProxySettings(prefill_urls=(p.url,), decode_urls=(d.url,), otel=otel, **settings),
                        tracer_provider=provider)
        client = await aiohttp_client(app, server_kwargs={"handler_cancellation": True})
        return Traced(client, app, p, d, exporter)

    return make


def one(spans: Sequence[ReadableSpan], name: str) -> ReadableSpan:
    found = [s for s in spans if s.name == name]
    assert len(found) == 1, [s.name for s in spans]
    return found[0]


def attrs(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})


def traceparent_of(span: ReadableSpan) -> str:
    ctx = span.get_span_context()
    assert ctx is not None
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{ctx.trace_flags:02x}"


async def received(worker: SimWorker, request_id: str) -> list[str]:
    return [r["traceparent"] for r in (await worker.state())["traceparents"]
            if r["request_id"] == f"generate-tokens-{request_id}"]


async def generated_on(worker: SimWorker) -> float:
    """The tokens ``worker`` generated so far (its vLLM counter)."""
    async with aiohttp.ClientSession() as session, session.get(worker.url + "/metrics") as r:
        text = await r.text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:generation_tokens_total{"))


def check_tree(spans: Sequence[ReadableSpan]) -> ReadableSpan:
    """One request span; every other span its direct child in the same trace."""
    root = one(spans, REQUEST_SPAN)
    assert root.kind is SpanKind.SERVER
    root_ctx = root.get_span_context()
    assert root_ctx is not None
    for s in spans:
        if s is root:
            continue
        ctx = s.get_span_context()
        assert ctx is not None and ctx.trace_id == root_ctx.trace_id, s.name
        assert s.parent is not None and s.parent.span_id == root_ctx.span_id, s.name
    return root


@pytest.mark.parametrize("stream", [True, False])
async def test_one_request_gives_a_span_per_hop_and_each_worker_gets_its_hops_traceparent(
        traced: TracedFactory, stream: bool) -> None:
    t = await traced()
    r = await t.client.post(GEN, json=req(stream=stream), headers={"X-Request-Id": "t1"})
    assert r.status == 200
    await r.read()
    spans = await t.spans("t1", want=("queue", "prefill", "handoff", "decode"))
    root = check_tree(spans)
    assert sorted(s.name for s in spans) == sorted([REQUEST_SPAN, "queue", "prefill", "handoff", "decode"])
    a = attrs(root)
    assert a["pd.outcome"] == "ok" and a["http.response.status_code"] == 200
    assert (a["pd.prefill_worker"], a["pd.decode_worker"]) == (t.p.url, t.d.url)
    assert "pd.decode_only" not in a and "pd.abort" not in a
    assert root.status.status_code is StatusCode.UNSET
    prefill, decode = one(spans, "prefill"), one(spans, "decode")
    assert (prefill.kind, decode.kind) == (SpanKind.CLIENT, SpanKind.CLIENT)
    assert attrs(prefill) == {"pd.request_id": "t1", "pd.pool": "prefill", "pd.worker": t.p.url,
                                  "pd.attempt": 0, "pd.hop.status": "ok"}
    assert attrs(decode)["pd.worker"] == t.d.url and attrs(decode)["pd.pool"] == "decode"
    assert attrs(decode)["pd.hop.status"] == ("done" if stream else "ok")
    assert one(spans, "queue").kind is SpanKind.INTERNAL
    # W3C traceparent on each hop: same trace, the hop's own span as the parent
    assert await received(t.p, "t1") == [traceparent_of(prefill)]
    assert await received(t.d, "t1") == [traceparent_of(decode)]


async def test_the_clients_traceparent_is_the_parent(traced: TracedFactory) -> None:
    t = await traced()
    headers = {"X-Request-Id": "t2", "traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"}
    r = await t.client.post(GEN, json=req(), headers=headers)
    assert r.status == 200
    root = one(await t.spans("t2"), REQUEST_SPAN)
    ctx = root.get_span_context()
    assert ctx is not None and f"{ctx.trace_id:032x}" == CLIENT_TRACE
    assert root.parent is not None and f"{root.parent.span_id:016x}" == CLIENT_SPAN
    (tp,) = await received(t.d, "t2")
    assert tp.split("-")[1] == CLIENT_TRACE


async def test_a_failed_prefill_is_an_error_span_with_its_status(traced: TracedFactory) -> None:
    t = await traced()
    await t.p.set_faults(fail_next=1, fail_status=503)
    r = await t.client.post(GEN, json=req(), headers={"X-Request-Id": "t3"})
    assert r.status == 502
    spans = await t.spans("t3", want=("prefill",))
    root = check_tree(spans)
    assert attrs(root)["pd.outcome"] == "upstream_error"
    assert attrs(root)["http.response.status_code"] == 502
    assert root.status.status_code is StatusCode.ERROR
    prefill = one(spans, "prefill")
    assert prefill.status.status_code is StatusCode.ERROR
    assert attrs(prefill)["http.response.status_code"] == 503
    assert attrs(prefill)["error.type"] == "UpstreamStatusError"
    assert not [s for s in spans if s.name == "decode"]  # no decode hop was made


async def test_each_retry_is_its_own_hop_span_and_carries_its_own_traceparent(traced: TracedFactory) -> None:
    t = await traced(pools=PoolSettings())  # retries on (and short prompts bypass the prefill pool)
    await t.p.set_faults(fail_next=1, fail_status=503)
    long_prompt = [3 + i % 500 for i in range(200)]
    r = await t.client.post(GEN, json=req(token_ids=long_prompt), headers={"X-Request-Id": "t7"})
    assert r.status == 200
    spans = await t.spans("t7", want=("decode",))
    check_tree(spans)
    prefills = sorted((s for s in spans if s.name == "prefill"), key=lambda s: attrs(s)["pd.attempt"])
    assert [attrs(s)["pd.attempt"] for s in prefills] == [0, 1]
    assert [s.status.status_code for s in prefills] == [StatusCode.ERROR, StatusCode.UNSET]
    assert [attrs(s)["pd.hop.status"] for s in prefills] == ["UpstreamStatusError", "ok"]
    # pd-sim records a traceparent before its fault answers: one per call, each its own span's
    assert await received(t.p, "t7") == [traceparent_of(s) for s in prefills]


async def test_decode_only_fallback_is_on_the_request_span(traced: TracedFactory) -> None:
    t = await traced(prefill_failure_policy="decode-only")
    await t.p.set_faults(fail_next=1, fail_status=500)
    r = await t.client.post(GEN, json=req(), headers={"X-Request-Id": "t4"})
    assert r.status == 200
    spans = await t.spans("t4", want=("decode",))
    root = check_tree(spans)
    assert attrs(root)["pd.decode_only"] == "prefill_error"
    assert attrs(one(spans, "prefill"))["pd.hop.status"] == "UpstreamStatusError"
    assert attrs(one(spans, "decode"))["pd.hop.status"] == "ok"


async def test_a_client_that_goes_away_ends_the_request_and_the_decode_span(traced: TracedFactory) -> None:
    t = await traced(decode={"itl_ms": 20.0, "prefill_base_ms": 0.0, "prefill_per_token_ms": 0.0})
    body = req(stream=True, sp={"max_tokens": 200, "ignore_eos": True})
    async with aiohttp.ClientSession() as s:
        resp = await s.post(f"http://127.0.0.1:{t.client.port}{GEN}", json=body,
                            headers={"X-Request-Id": "t5"})
        assert resp.status == 200
        await resp.content.readany()  # the first event, then hang up
        resp.close()
    spans = await t.spans("t5", want=("decode",))
    root = check_tree(spans)
    assert attrs(root)["pd.outcome"] == "aborted"
    assert attrs(root)["pd.abort"] == "disconnect"
    # D's stream ends on the proxy's abort (vLLM's last chunk, finish_reason "abort", and [DONE])
    # and is read to that end ("done", not cut off: "cancelled"), long before its 200 tokens.
    assert attrs(one(spans, "decode"))["pd.hop.status"] == "done"
    assert (await t.d.state())["inflight"] == []  # D let it go (aborted), after far fewer than 200
    assert await generated_on(t.d) < 200


async def test_disabled_creates_no_span_and_sends_no_traceparent(traced: TracedFactory) -> None:
    t = await traced(otel=False)
    serving = t.app[SERVING]
    assert not serving.tracing.enabled
    assert serving.upstream.session.trace_configs == []
    for stream in (True, False):
        r = await t.client.post(GEN, json=req(stream=stream), headers={"X-Request-Id": "t6"})
        assert r.status == 200
        await r.read()
    assert t.exporter.get_finished_spans() == ()
    assert await received(t.p, "t6") == [] and await received(t.d, "t6") == []
    assert (await t.d.state())["generate_calls"] == 2
    # the walk's hooks are shared constants: no object per request or per hop
    assert serving.tracing.start({}, "x", 0.0) is NOOP_TRACE
    assert NOOP_TRACE.hop("prefill", serving.prefill_pool.workers[0]) is NOOP_HOP


def test_otel_asked_without_the_packages_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(proxy.observe.tracing, "otel_installed", lambda: False)
    with pytest.raises(TracingUnavailable, match=r"pd-proxy\[otel\]"):
        Tracing.create(True)
    assert not Tracing.create(False).enabled  # off needs nothing
    monkeypatch.setattr(proxy.cli, "otel_installed", lambda: False)
    with pytest.raises(SystemExit):
        proxy.cli.parse_args(["--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2", "--otel"])


def test_the_flag_turns_it_on() -> None:
    s = proxy.cli.parse_args(["--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2", "--otel"])
    assert s.otel
    assert not proxy.cli.parse_args(["--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"]).otel


@pytest.mark.parametrize("exporter", ["none", "console", "none,console"])
def test_a_provider_is_built_from_the_otel_variables(monkeypatch: pytest.MonkeyPatch, exporter: str) -> None:
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", exporter)
    monkeypatch.setenv("OTEL_SERVICE_NAME", "pd-proxy-test")
    tracing = Tracing.create(True)
    assert tracing.enabled
    span = tracing.tracer.start_span("x")
    assert span.is_recording()
    resource = span.resource  # type: ignore[attr-defined]
    span.end()
    assert resource.attributes["service.name"] == "pd-proxy-test"
    tracing.shutdown()


@pytest.mark.parametrize(("env", "message"), [
    ({"OTEL_TRACES_EXPORTER": "zipkin"}, "otlp, console, none"),
    pytest.param({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"},
                 "opentelemetry-exporter-otlp",
                 marks=pytest.mark.skipif(importlib.util.find_spec("opentelemetry.exporter") is not None,
                                          reason="an OTLP exporter is installed here")),
])
def test_an_exporter_that_cannot_be_built_is_a_clear_error(
        monkeypatch: pytest.MonkeyPatch, env: dict[str, str], message: str) -> None:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(TracingUnavailable, match=message):
        Tracing.create(True)
