"""Optional OpenTelemetry spans per hop, with W3C ``traceparent`` passed to the workers (see
deploy/README.md). Off, the walk talks to ``NOOP_TRACE``/``NOOP_HOP``, which do nothing and never
import OpenTelemetry. No prompt, output or key is recorded on a span."""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import os
import time
from collections.abc import Callable
from contextvars import Token
from types import TracebackType
from typing import TYPE_CHECKING, Any, Final, Protocol

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.trace import Span, Tracer, TracerProvider

    from proxy.observe.state import RequestRecord
    from proxy.pools import Worker

REQUEST_SPAN: Final = "POST /inference/v1/generate"
INSTRUMENTATION: Final = "pd_proxy"
_BYPASS_HEADER: Final = "X-PD-Decode-Only"
_NS: Final = 1_000_000_000


class StageTimes(Protocol):
    """The points of the walk a trace draws stages between (``proxy.walk.flight.Timing``)."""

    @property
    def received(self) -> float: ...
    @property
    def prefill_start(self) -> float | None: ...
    @property
    def prefill_end(self) -> float | None: ...
    @property
    def decode_start(self) -> float | None: ...


class Traced(Protocol):
    """What a finished request tells its trace (``proxy.walk.flight.Flight``)."""

    @property
    def timing(self) -> StageTimes: ...
    @property
    def record(self) -> RequestRecord: ...
    @property
    def headers(self) -> dict[str, str]: ...


class TracingUnavailable(RuntimeError):
    """``--otel`` was asked for but the OpenTelemetry packages it needs are not installed."""


def _has(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


def otel_installed() -> bool:
    """Whether the OpenTelemetry API can be imported (the ``otel`` extra)."""
    return _has("opentelemetry.trace") and _has("opentelemetry.propagate")


class Hop:
    """One upstream call's span (``with trace.hop(...) as hop:``); this base class does nothing."""

    __slots__ = ()

    def __enter__(self) -> Hop:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        return None

    def outcome(self, status: str) -> None:
        """How a call that does not raise ended (a stream's status)."""


class RequestTrace:
    """One request's trace. This base class is the disabled one: it does nothing."""

    __slots__ = ()
    enabled: bool = False

    def hop(self, name: str, worker: Worker) -> Hop:
        return NOOP_HOP

    def finish(self, flight: Traced, outcome: str, status: int) -> None:
        """End the request span, adding the queue and hand-off spans."""


NOOP_HOP: Final = Hop()
NOOP_TRACE: Final = RequestTrace()


class _LiveHop(Hop):
    __slots__ = ("_done", "_span", "_token")

    def __init__(self, span: Span) -> None:
        self._span = span
        self._token: Token[Context] | None = None
        self._done = False

    def __enter__(self) -> Hop:
        from opentelemetry import context, trace  # noqa: PLC0415

        # Current for the duration of the call, so that the upstream session's hook injects it.
        self._token = context.attach(trace.set_span_in_context(self._span))
        return self

    def outcome(self, status: str) -> None:
        from opentelemetry.trace import Status, StatusCode  # noqa: PLC0415

        self._done = True
        self._span.set_attribute("pd.hop.status", status)
        if status not in ("done", "closed", "ok"):
            self._span.set_status(Status(StatusCode.ERROR, status))

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        from opentelemetry import context  # noqa: PLC0415
        from opentelemetry.trace import Status, StatusCode  # noqa: PLC0415

        span = self._span
        try:
            if isinstance(exc, asyncio.CancelledError):
                span.set_attribute("pd.hop.status", "cancelled")
            elif exc is not None:
                kind = type(exc).__name__
                span.set_attribute("pd.hop.status", kind)
                span.set_attribute("error.type", kind)
                upstream_status = getattr(exc, "upstream_status", None)
                if isinstance(upstream_status, int):
                    span.set_attribute("http.response.status_code", upstream_status)
                # A worker's own message names the hop and the worker, never request content.
                span.set_status(Status(StatusCode.ERROR, str(getattr(exc, "message", kind))))
            elif not self._done:
                span.set_attribute("pd.hop.status", "ok")
        finally:
            if self._token is not None:
                context.detach(self._token)
                self._token = None
            span.end()


class _LiveTrace(RequestTrace):
    __slots__ = ("_attempts", "_context", "_mono0", "_ns0", "_request_id", "_span", "_tracing")
    enabled = True

    def __init__(self, tracing: Tracing, span: Span, context: Context, request_id: str, *,
                 mono0: float, ns0: int) -> None:
        self._tracing = tracing
        self._span = span
        self._context = context
        self._request_id = request_id
        self._mono0 = mono0
        self._ns0 = ns0
        self._attempts: dict[str, int] = {}

    def ns(self, t: float) -> int:
        """A reading of the serving clock as OpenTelemetry time (ns since the epoch)."""
        return self._ns0 + int((t - self._mono0) * _NS)

    def hop(self, name: str, worker: Worker) -> Hop:
        from opentelemetry.trace import SpanKind  # noqa: PLC0415

        attempt = self._attempts.get(name, 0)
        self._attempts[name] = attempt + 1
        span = self._tracing.tracer.start_span(
            name, context=self._context, kind=SpanKind.CLIENT,
            attributes={"pd.request_id": self._request_id, "pd.pool": worker.pool,
                        "pd.worker": worker.url, "pd.attempt": attempt})
        return _LiveHop(span)

    def _stage(self, name: str, start: float | None, end: float | None) -> None:
        if start is None or end is None:
            return
        span = self._tracing.tracer.start_span(
            name, context=self._context, start_time=self.ns(start),
            attributes={"pd.request_id": self._request_id})
        span.end(end_time=self.ns(max(start, end)))

    def finish(self, flight: Traced, outcome: str, status: int) -> None:
        from opentelemetry.trace import Status, StatusCode  # noqa: PLC0415

        t = flight.timing
        self._stage("queue", t.received, t.prefill_start if t.prefill_start is not None else t.decode_start)
        self._stage("handoff", t.prefill_end, t.decode_start)
        record = flight.record
        span = self._span
        span.set_attribute("pd.outcome", outcome)
        span.set_attribute("http.response.status_code", status)
        for key, value in (
            ("pd.prefill_worker", record.prefill_worker.url if record.prefill_worker is not None else None),
            ("pd.decode_worker", record.decode_worker.url if record.decode_worker is not None else None),
            ("pd.decode_only", flight.headers.get(_BYPASS_HEADER)),
            ("pd.abort", record.abort_source),
        ):
            if value is not None:
                span.set_attribute(key, value)
        if status >= 500:
            span.set_status(Status(StatusCode.ERROR, outcome))
        span.end(end_time=self.ns(self._tracing.clock()))


class Tracing:
    """The app's tracing: ``start`` gives each request its trace (``NOOP_TRACE`` when off)."""

    def __init__(self, tracer: Tracer | None = None, *, clock: Callable[[], float] = time.monotonic,
                 owned_provider: TracerProvider | None = None) -> None:
        self._tracer = tracer
        self.clock = clock
        self._owned = owned_provider

    @property
    def enabled(self) -> bool:
        return self._tracer is not None

    @property
    def tracer(self) -> Tracer:
        assert self._tracer is not None
        return self._tracer

    @classmethod
    def create(cls, enabled: bool, provider: TracerProvider | None = None, *,
               clock: Callable[[], float] = time.monotonic) -> Tracing:
        """Raises ``TracingUnavailable`` when ``enabled`` and the packages are missing."""
        if not enabled:
            return cls(clock=clock)
        if not otel_installed():
            raise TracingUnavailable(
                "--otel needs the OpenTelemetry packages: pip install 'pd-proxy[otel]'")
        from opentelemetry import trace  # noqa: PLC0415

        from proxy import __version__  # noqa: PLC0415

        owned = None
        if provider is None:
            provider = trace.get_tracer_provider()
            if not _is_sdk_provider(provider):
                provider = owned = _sdk_provider_from_env()
        return cls(trace.get_tracer(INSTRUMENTATION, __version__, tracer_provider=provider),
                   clock=clock, owned_provider=owned)

    def start(self, headers: Any, request_id: str, t0: float) -> RequestTrace:
        """The trace of one request that arrived at ``t0`` (a reading of ``clock``)."""
        if self._tracer is None:
            return NOOP_TRACE
        from opentelemetry import propagate, trace  # noqa: PLC0415
        from opentelemetry.trace import SpanKind  # noqa: PLC0415

        mono0, ns0 = self.clock(), time.time_ns()
        start = ns0 + int((t0 - mono0) * _NS)
        span = self._tracer.start_span(
            REQUEST_SPAN, context=propagate.extract(headers), kind=SpanKind.SERVER, start_time=start,
            attributes={"pd.request_id": request_id, "http.request.method": "POST",
                        "url.path": "/inference/v1/generate"})
        return _LiveTrace(self, span, trace.set_span_in_context(span), request_id, mono0=mono0, ns0=ns0)

    def hop_header_injector(self) -> Callable[[dict[str, str]], None] | None:
        """What puts the current hop's ``traceparent`` in its headers (``None`` when off)."""
        if self._tracer is None:
            return None
        from opentelemetry import propagate  # noqa: PLC0415

        # Outside a hop there is no valid span and the propagators write nothing.
        return propagate.inject

    def shutdown(self) -> None:
        """Flush and stop a provider this module built (others belong to whoever set them)."""
        owned, self._owned = self._owned, None
        if owned is not None:
            owned.shutdown()  # type: ignore[attr-defined]


DISABLED: Final = Tracing()


def _is_sdk_provider(provider: object) -> bool:
    if not _has("opentelemetry.sdk.trace"):
        return False
    from opentelemetry.sdk.trace import TracerProvider as SdkTracerProvider  # noqa: PLC0415

    return isinstance(provider, SdkTracerProvider)


def _sdk_provider_from_env() -> TracerProvider:
    if not _has("opentelemetry.sdk.trace"):
        raise TracingUnavailable(
            "--otel needs opentelemetry-sdk (pip install 'pd-proxy[otel]'), or a tracer provider "
            "set up by opentelemetry-instrument")
    from opentelemetry.sdk.resources import Resource  # noqa: PLC0415
    from opentelemetry.sdk.trace import TracerProvider as SdkTracerProvider  # noqa: PLC0415
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter  # noqa: PLC0415

    attributes = {} if os.environ.get("OTEL_SERVICE_NAME") else {"service.name": "pd-proxy"}
    provider = SdkTracerProvider(resource=Resource.create(attributes))
    names = [n.strip().lower() for n in os.environ.get("OTEL_TRACES_EXPORTER", "otlp").split(",")]
    for name in names:
        exporter: SpanExporter
        if name in ("", "none"):
            continue
        if name == "console":
            from opentelemetry.sdk.trace.export import ConsoleSpanExporter  # noqa: PLC0415

            exporter = ConsoleSpanExporter()
        elif name == "otlp":
            exporter = _otlp_exporter()
        else:
            raise TracingUnavailable(f"OTEL_TRACES_EXPORTER={name!r}: pd-proxy knows otlp, console, none")
        provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


def _otlp_exporter() -> Any:
    protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
                              os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"))
    module = ("opentelemetry.exporter.otlp.proto.grpc.trace_exporter" if protocol == "grpc"
              else "opentelemetry.exporter.otlp.proto.http.trace_exporter")
    if not _has(module):
        raise TracingUnavailable(
            f"OTEL_TRACES_EXPORTER=otlp ({protocol}) needs opentelemetry-exporter-otlp; install it, "
            "or set OTEL_TRACES_EXPORTER=console or none")
    return importlib.import_module(module).OTLPSpanExporter()


__all__ = ["DISABLED", "NOOP_HOP", "NOOP_TRACE", "Hop", "RequestTrace", "Tracing", "TracingUnavailable",
           "otel_installed"]
