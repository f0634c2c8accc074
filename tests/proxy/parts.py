"""The parts of the request walk (``proxy.walk.core.Part``) driven directly: a ``Core`` built from
settings on a fake clock, an upstream that records every call and answers what the test scripts,
and a request (``proxy.walk.flight.Flight``) as the walk makes it. No socket is opened."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

from kv_transfer.handoff import decode_body
from proxy.config.settings import ProxySettings
from proxy.observe.metrics import ProxyMetrics
from proxy.observe.state import Phase, RequestRecord
from proxy.pools import PoolSettings, Worker
from proxy.upstream.client import Upstream
from proxy.walk.aborts import Aborts
from proxy.walk.cleanup import Cleanup
from proxy.walk.core import Core
from proxy.walk.decode import DecodeEngine
from proxy.walk.flight import Flight, Timing
from proxy.walk.full import FullDecode
from proxy.walk.prefill import Prefill
from proxy.wire.protocol import compact_json, engine_request_id, parse_generate_body
from tests.proxy.pools.helpers import FakeClock
from tests.proxy.scripted import KV_PARAMS, prefill_reply

P_URLS = ("http://127.0.0.1:9101", "http://127.0.0.1:9102")
D_URLS = ("http://127.0.0.1:9201", "http://127.0.0.1:9202")
PROMPT = [11, 12, 13, 14, 15, 16, 17, 18, 19]


@dataclass
class Call:
    hop: str
    worker: str
    body: dict[str, Any]
    request_id: str
    total: float

    @property
    def is_release(self) -> bool:
        """A KV release (``kv_transfer.handoff.release_body``): one token, P's params."""
        return self.hop == "decode" and self.body["sampling_params"].get("max_tokens") == 1 \
            and "kv_transfer_params" in self.body


Answer = Any
"""What a scripted call gives: a dict (D's bytes are its compact JSON), bytes (D's own bytes,
parsed), an exception (raised), an awaitable (awaited, then taken as an answer), or a callable of
the ``Call`` (called, then taken as an answer)."""


def decode_reply(body: dict[str, Any], **extra: Any) -> dict[str, Any]:
    out = {**prefill_reply(body), "kv_transfer_params": None}
    out["usage"] = {"prompt_tokens": len(body["token_ids"]), "completion_tokens": 4,
                    "total_tokens": len(body["token_ids"]) + 4, "prompt_tokens_details": None}
    out.update(extra)
    return out


@dataclass
class FakeUpstream:
    """``proxy.upstream.client.Upstream`` as the parts use it (generate hops, aborts), no network."""

    calls: list[Call] = field(default_factory=list)
    aborts: list[tuple[str, list[str]]] = field(default_factory=list)
    scripts: dict[str, list[Answer]] = field(default_factory=dict)
    on_abort: Callable[[str, list[str]], None] | None = None
    _called: asyncio.Event = field(default_factory=asyncio.Event)

    def script(self, hop: str, *answers: Answer) -> None:
        """The next calls of ``hop`` ("prefill" or "decode", releases included) answer these, in
        order; once they are used up, a prefill gets P's usual reply and a decode D's."""
        self.scripts.setdefault(hop, []).extend(answers)

    async def sent(self, n: int = 1) -> None:
        """Until ``n`` generate calls were made."""
        while len(self.calls) < n:
            self._called.clear()
            await self._called.wait()

    def to(self, hop: str) -> list[str]:
        return [c.worker for c in self.calls if c.hop == hop]

    @property
    def releases(self) -> list[Call]:
        return [c for c in self.calls if c.is_release]

    async def _answer(self, call: Call) -> tuple[dict[str, Any], bytes]:
        queue = self.scripts.get(call.hop)
        answer: Answer
        if queue:
            answer = queue.pop(0)
        else:
            answer = prefill_reply(call.body) if call.hop == "prefill" else decode_reply(call.body)
        while True:
            if callable(answer):
                answer = answer(call)
            elif isinstance(answer, asyncio.Future) or asyncio.iscoroutine(answer):
                answer = await answer
            else:
                break
        if isinstance(answer, BaseException):
            raise answer
        if isinstance(answer, bytes):
            return json.loads(answer), answer
        return answer, compact_json(answer)

    async def post_generate_raw(self, hop: str, worker: str, body: dict[str, Any], *, request_id: str,
                                total: float) -> tuple[dict[str, Any], bytes]:
        call = Call(hop, worker, body, request_id, total)
        self.calls.append(call)
        self._called.set()
        return await self._answer(call)

    async def post_generate(self, hop: str, worker: str, body: dict[str, Any], *, request_id: str,
                            total: float) -> dict[str, Any]:
        return (await self.post_generate_raw(hop, worker, body, request_id=request_id, total=total))[0]

    async def abort(self, worker: str, request_ids: list[str], *, limit: float) -> bool:
        self.aborts.append((worker, list(request_ids)))
        if self.on_abort is not None:
            self.on_abort(worker, request_ids)
        return True


class BoundRng:
    """The pools' rng for the backoff (``RetryPolicy.delay``: full jitter): records each pause's
    upper bound and pauses not at all."""

    def __init__(self) -> None:
        self.bounds: list[float] = []

    def uniform(self, a: float, b: float) -> float:
        self.bounds.append(b)
        return 0.0


def make_core(n_prefill: int = 1, n_decode: int = 1, *, pools: dict[str, Any] | None = None,
              **settings: Any) -> tuple[Core, FakeUpstream, FakeClock]:
    """A ``Core`` over ``n_prefill`` and ``n_decode`` workers (the pools' plain walk, KV blocks of
    4 tokens, unless ``pools`` and ``settings`` say otherwise), its upstream attached."""
    settings.setdefault("kv_block_size", 4)
    s = ProxySettings(prefill_urls=P_URLS[:n_prefill], decode_urls=D_URLS[:n_decode],
                      pools=PoolSettings.plain(**(pools or {})), **settings)
    clock = FakeClock()
    core = Core(s, ProxyMetrics(), clock)
    core.pools.rng = BoundRng()  # type: ignore[assignment]
    upstream = FakeUpstream()
    core.attach(cast(Upstream, upstream))
    return core, upstream, clock


def make_flight(core: Core, *, rid: str = "r1", stream: bool = False, **body: Any) -> Flight:
    """A request as ``Serving`` makes it (parsed, in the table), in PREFILLING."""
    sp = {"temperature": 0, "max_tokens": 8, **body.pop("sp", {})}
    data = {"token_ids": body.pop("token_ids", PROMPT), "sampling_params": sp, "stream": stream, **body}
    request, parsed = parse_generate_body(json.dumps(data).encode(), "application/json")
    record = RequestRecord(rid, engine_request_id(rid), stream=stream)
    f = Flight(record, request, parsed, Timing(core.clock()))
    core.table.add(f)
    return f


def worker(core: Core, url: str) -> Worker:
    for pool in (core.prefill_pool, core.decode_pool):
        found = pool.get(url)
        if found is not None:
            return found
    raise KeyError(url)


def hold(core: Core, f: Flight, p: Worker, params: dict[str, Any] | None = None) -> dict[str, Any]:
    """P holds ``f``'s KV (what ``Prefill.accept_reply`` does with a good reply): KV_HELD, lease open."""
    kv = dict(params or KV_PARAMS)
    f.record.prefill_worker = p
    f.record.phase = Phase.KV_HELD
    f.kv_blocks = core.leases.hold(f.record, p.url, kv)
    return kv


def count(metric: Any, **labels: str) -> float:
    """A counter's value (a child's, with ``labels``)."""
    child = metric.labels(**labels) if labels else metric
    return float(child._value.get())


@dataclass
class Walk:
    """Every part of the walk over one ``Core``, wired as ``Serving`` wires them."""

    core: Core
    aborts: Aborts
    prefill: Prefill
    cleanup: Cleanup
    engine: DecodeEngine
    full: FullDecode

    @classmethod
    def over(cls, core: Core) -> Walk:
        aborts, prefill, engine = Aborts(core), Prefill(core), DecodeEngine(core)
        cleanup = Cleanup(core, aborts, prefill)
        return cls(core, aborts, prefill, cleanup, engine, FullDecode(core, engine, aborts, cleanup))


async def decoding(core: Core, f: Flight, kv: dict[str, Any] | None = None,
                   url: str = D_URLS[0]) -> tuple[Worker, dict[str, Any]]:
    """``f`` as the walk leaves it for a decode: D picked (counted on it), DECODING, the decode
    hop's body (with ``kv``, P's params, or decode-only)."""
    d = await core.decode_pool.acquire(exclude=[w for w in core.decode_pool if w.url != url])
    f.record.decode_worker = d
    f.record.phase = Phase.DECODING
    f.timing.decode_start = core.clock()
    return d, decode_body(f.data, f.record.base_id, kv)


async def finished(value: Any) -> asyncio.Task[Any]:
    """A task that ended with ``value`` (raised when it is an exception)."""
    async def run() -> Any:
        if isinstance(value, BaseException):
            raise value
        return value

    task = asyncio.get_running_loop().create_task(run())
    await asyncio.wait({task})
    return task


def sample(core: Core, name: str, **labels: str) -> float:
    """One sample of the proxy's registry (0 when it has none)."""
    return core.metrics.registry.get_sample_value(name, labels) or 0.0
