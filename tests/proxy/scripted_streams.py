"""The streamed decode's parts on their own: a ``Core`` whose upstream is scripted in process (each
decode stream is a list of reads, every split the test wants, and how it ends), a streamed flight,
and the events a vLLM decode worker sends. No sockets: what ``proxy.stream.read`` and
``proxy.stream.answer`` do with each answer is all that is tested.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

from proxy.config.settings import ProxySettings
from proxy.observe.metrics import ProxyMetrics
from proxy.observe.state import RequestRecord
from proxy.pools import PoolSettings
from proxy.sse.relay import StreamBuffer
from proxy.upstream.client import Upstream
from proxy.walk.core import Core
from proxy.walk.flight import Flight, Timing
from proxy.wire.errors import UpstreamError
from proxy.wire.protocol import engine_request_id, parse_generate_body
from tests.sse import tokens

BASE_ID = "r1"
PROMPT = [260, 262, 264]
KV_PARAMS: dict[str, Any] = {"do_remote_prefill": True, "do_remote_decode": False,
                             "remote_block_ids": [[1]], "remote_engine_id": "eng",
                             "remote_request_id": "rr", "remote_host": "127.0.0.1", "remote_port": 5600,
                             "tp_size": 1}
DONE = b"data: [DONE]\n\n"


def chunk(*tokens: int, finish: str | None = None, mode: str | None = "tokens",
          usage: dict[str, Any] | None = None) -> bytes:
    """One stream event as vLLM sends it (``mode`` None: a server that predates output_mode);
    no tokens and a ``usage``: the include_usage chunk (no choices)."""
    d: dict[str, Any] = {"request_id": engine_request_id(BASE_ID), "created": 1, "model": "m"}
    d["choices"] = [] if usage is not None and not tokens else \
        [{"index": 0, "token_ids": list(tokens), "finish_reason": finish}]
    if usage is not None:
        d["usage"] = usage
    if mode is not None:
        d["output_mode"] = mode
    return b"data: " + json.dumps(d, separators=(",", ":")).encode() + b"\n\n"


def error_event(code: int, message: str = "KV load failed") -> bytes:
    """vLLM's in-band error event."""
    err = {"error": {"message": message, "type": "InternalServerError", "param": None, "code": code}}
    return b"data: " + json.dumps(err, separators=(",", ":")).encode() + b"\n\n"


def tokens_of(raw: bytes) -> list[int]:
    """Every generated token id in a run of stream events."""
    return tokens(raw, comments=True)


# The ways the same events can arrive: one read (the fast path, one block), one byte per read
# (every event completes in a read of its own, [DONE] too), and behind a keep-alive comment (not
# plain: the event-by-event path).
def one_read(events: list[bytes]) -> list[bytes]:
    return [b"".join(events)]


def byte_reads(events: list[bytes]) -> list[bytes]:
    return [bytes([b]) for b in b"".join(events)]


def after_comment(events: list[bytes]) -> list[bytes]:
    return [b": keep-alive\n\n" + b"".join(events)]


SPLITS = {"one_read": one_read, "byte_reads": byte_reads, "after_comment": after_comment}


@dataclass
class Answer:
    """One decode stream: its reads, then ``broken`` raised (a reset) if given."""

    reads: list[bytes]
    broken: UpstreamError | None = None
    taken: int = 0
    """Reads the proxy took."""
    closed: bool = False
    released: bool = False
    """Given back for keep-alive (read to its end) rather than closed."""

    def close(self) -> None:
        self.closed = True

    def release(self) -> None:
        self.released = True


@dataclass
class ScriptedUpstream:
    """``Upstream`` for the decode hop: each ``open`` takes the next answer (an ``UpstreamError``
    is raised there: nothing answered), and records the worker and body it was sent."""

    answers: list[Answer | UpstreamError]
    opened: list[tuple[str, dict[str, Any]]] = field(default_factory=list)

    async def open(self, hop: str, worker: str, body: dict[str, Any], *, request_id: str,
                   total: float | None, sock_read: float | None = None, stream: bool = False) -> Answer:
        self.opened.append((worker, body))
        if not self.answers:
            raise AssertionError(f"no answer scripted for a hop to {worker}")
        answer = self.answers.pop(0)
        if isinstance(answer, UpstreamError):
            raise answer
        return answer

    async def pipe(self, hop: str, worker: str, resp: Answer, sink: Callable[[bytes], bool]) -> None:
        """The answer's reads to ``sink`` one by one (as ``Upstream.pipe``), until it says stop;
        then the scripted failure, if any."""
        for piece in resp.reads:
            resp.taken += 1
            if not sink(piece):
                return
        if resp.broken is not None:
            raise resp.broken


def make_core(upstream: ScriptedUpstream, *, n_decode: int = 1, pools: PoolSettings | None = None,
              **settings: Any) -> Core:
    s = ProxySettings(prefill_urls=("http://127.0.0.1:9",),
                      decode_urls=tuple(f"http://127.0.0.1:{10 + i}" for i in range(n_decode)),
                      pools=pools or PoolSettings.plain(retry_base_delay=0.0), **settings)
    core = Core(s, ProxyMetrics())
    core.attach(cast(Upstream, upstream))
    return core


def make_flight(core: Core, *, usage: bool = False, output_mode: str = "tokens",
                max_tokens: int = 8) -> Flight:
    """A streamed request as the walk hands it to the decode."""
    body: dict[str, Any] = {"token_ids": PROMPT, "stream": True, "output_mode": output_mode,
                            "sampling_params": {"temperature": 0, "max_tokens": max_tokens}}
    if usage:
        body["stream_options"] = {"include_usage": True}
    req, data = parse_generate_body(json.dumps(body).encode(), "application/json")
    f = Flight(RequestRecord(BASE_ID, engine_request_id(BASE_ID), stream=True), req, data,
               Timing(core.clock()))
    f.headers_ready = asyncio.get_running_loop().create_future()
    return f


def decode_body(kv: bool) -> dict[str, Any]:
    """The decode hop's body: with P's KV params, or decode-only."""
    body: dict[str, Any] = {"token_ids": PROMPT, "stream": True, "request_id": BASE_ID,
                            "sampling_params": {"temperature": 0, "max_tokens": 8}}
    if kv:
        body["kv_transfer_params"] = dict(KV_PARAMS)
    return body


async def drain(buffer: StreamBuffer) -> bytes:
    """Everything queued in ``buffer`` for the client (the buffer is finished first if the
    producer has not: ``take`` would wait on an open, empty buffer)."""
    buffer.finish(done=False)
    items, _ = await buffer.take(merge=False)
    return b"".join(items)


def sample(core: Core, name: str, **labels: str) -> float:
    """The value of one series of ``core``'s metrics (0 when it was never made)."""
    value = core.metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value
