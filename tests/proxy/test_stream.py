"""StreamDecode: the producer (attempt after attempt into the client's buffer: a retry before D's
first byte, a migration after it, else the client's stream ends with the error) and the client
side (a write bounded for a client that stopped reading, TPOT), against a scripted upstream."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any, cast

import pytest
from aiohttp import web

from proxy.fleet import BYPASS_HEADER
from proxy.pools import Outcome, PoolSettings, Worker
from proxy.sse.relay import StreamBuffer
from proxy.stream.answer import StreamDecode
from proxy.walk.aborts import Aborts
from proxy.walk.cleanup import Cleanup
from proxy.walk.core import Core
from proxy.walk.decode import DecodeEngine
from proxy.walk.flight import Flight
from proxy.walk.prefill import Prefill
from proxy.wire.errors import UpstreamError, UpstreamUnavailable
from tests.proxy.scripted_streams import (
    BASE_ID,
    DONE,
    KV_PARAMS,
    PROMPT,
    Answer,
    ScriptedUpstream,
    chunk,
    decode_body,
    error_event,
    make_core,
    make_flight,
    sample,
    tokens_of,
)

EVENTS = [chunk(1), chunk(2, 3), chunk(4, finish="length")]


def make_stream(core: Core) -> StreamDecode:
    """The streamed decode with the parts it works with, as ``Serving`` wires them."""
    aborts, prefill = Aborts(core), Prefill(core)
    return StreamDecode(core, DecodeEngine(core), aborts, Cleanup(core, aborts, prefill), prefill)


class Producing:
    """A ``StreamDecode`` whose decode workers answer as scripted; ``produce`` run to its end."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, *answers: Answer | UpstreamError,
                 n_decode: int = 1, max_tokens: int = 8, **pools: Any) -> None:
        self.upstream = ScriptedUpstream(list(answers))
        self.core = make_core(self.upstream, n_decode=n_decode,
                              pools=PoolSettings.plain(retry_base_delay=0.0, **pools))
        self.stream = make_stream(self.core)
        self.f: Flight = make_flight(self.core, max_tokens=max_tokens)
        self.buffer = StreamBuffer(self.core.settings.slow_reader_max_bytes)
        self.released: list[tuple[str, Outcome]] = []
        release = self.core.decode_pool.release

        def record(worker: Worker, outcome: Outcome, tokens: int = 0) -> None:
            self.released.append((worker.url, outcome))
            release(worker, outcome, tokens)

        monkeypatch.setattr(self.core.decode_pool, "release", record)

    @property
    def urls(self) -> list[str]:
        return [w.url for w in self.core.decode_pool.workers]

    def hold_lease(self) -> None:
        self.core.leases.hold(self.f.record, "http://127.0.0.1:9", dict(KV_PARAMS))

    async def produce(self, *, kv: bool = False) -> None:
        w = await self.core.decode_pool.acquire(self.f.ctx)
        self.f.record.decode_worker = w
        await self.stream.produce(self.f, w, decode_body(kv), self.buffer)

    async def relayed(self) -> bytes:
        """What the client gets: the events, then the buffer's error event if any."""
        assert self.buffer.closed  # the producer finished the client's stream
        items, finished = await self.buffer.take(merge=False)
        assert finished
        return b"".join(items)

    def opened(self) -> list[str]:
        return [url for url, _ in self.upstream.opened]


def message(event: bytes | None) -> str:
    assert event is not None
    text = json.loads(event[6:])["error"]["message"]
    assert isinstance(text, str)
    return text


def refused(url: str = "w") -> UpstreamUnavailable:
    return UpstreamUnavailable("decode", url, "connection refused")


async def test_a_stream_that_ends_with_done_ends_the_clients(monkeypatch: pytest.MonkeyPatch) -> None:
    p = Producing(monkeypatch, Answer([*EVENTS, DONE]))
    await p.produce()
    assert tokens_of(await p.relayed()) == [1, 2, 3, 4]
    assert p.buffer.ended_with_done and p.buffer.error_event is None
    assert p.released == [(p.urls[0], Outcome.SUCCESS)]


async def test_an_open_failure_with_no_retry_left_fails_the_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    error = refused()
    p = Producing(monkeypatch, error)
    await p.produce()
    # Nothing was sent: the handler answers with the error (its status), not a 200 stream.
    assert p.f.headers_ready is not None and p.f.headers_ready.exception() is error
    assert not p.buffer.closed and p.f.settled.is_set()
    assert len(p.opened()) == 1


async def test_an_open_failure_goes_to_another_decode_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    p = Producing(monkeypatch, refused(), Answer([*EVENTS, DONE]), n_decode=2, decode_attempts=2)
    await p.produce()
    assert sorted(p.opened()) == p.urls  # the retry went to the other one
    assert tokens_of(await p.relayed()) == [1, 2, 3, 4] and p.buffer.ended_with_done
    assert p.f.headers_ready is not None and p.f.headers_ready.exception() is None
    assert sample(p.core, "pd_proxy_retries_total", hop="decode") == 1


async def test_a_kv_failure_is_retried_with_the_same_kv_while_the_lease_holds(
        monkeypatch: pytest.MonkeyPatch) -> None:
    p = Producing(monkeypatch, Answer([error_event(500), DONE]), Answer([*EVENTS, DONE]),
                  n_decode=2, decode_attempts=2)
    p.hold_lease()
    await p.produce(kv=True)
    (_, first), (_, second) = p.upstream.opened
    assert second is first and "kv_transfer_params" in second  # P still holds the same KV
    relayed = await p.relayed()
    assert tokens_of(relayed) == [1, 2, 3, 4] and b'"error"' not in relayed  # no seam for the client
    assert p.buffer.ended_with_done


async def test_a_kv_failure_after_the_lease_ended_is_retried_decode_only(
        monkeypatch: pytest.MonkeyPatch) -> None:
    p = Producing(monkeypatch, Answer([error_event(500), DONE]), Answer([*EVENTS, DONE]),
                  n_decode=2, decode_attempts=2)
    await p.produce(kv=True)  # no lease held: P's KV may be gone
    assert "kv_transfer_params" not in p.upstream.opened[1][1]
    assert p.f.headers[BYPASS_HEADER] == "decode_retry"
    assert p.buffer.ended_with_done


async def test_a_kv_failure_with_no_retry_left_ends_the_stream_with_ds_event(
        monkeypatch: pytest.MonkeyPatch) -> None:
    event = error_event(500)
    p = Producing(monkeypatch, Answer([event, DONE]))
    await p.produce(kv=True)
    # D answered (200 and its headers): the client's stream carries D's error event.
    assert p.f.headers_ready is not None and p.f.headers_ready.exception() is None
    assert await p.relayed() == b"" and p.buffer.error_event == event
    assert not p.buffer.ended_with_done


async def test_a_broken_stream_that_may_not_migrate_ends_with_the_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    p = Producing(monkeypatch, Answer(EVENTS[:2]), n_decode=2)  # migration off
    await p.produce()
    assert tokens_of(await p.relayed()) == [1, 2, 3]
    assert "stream ended without [DONE]" in message(p.buffer.error_event)
    assert len(p.opened()) == 1 and not p.buffer.ended_with_done
    assert p.released == [(p.urls[0], Outcome.FAILURE)]


async def test_a_broken_stream_migrates_and_the_client_sees_no_seam(monkeypatch: pytest.MonkeyPatch) -> None:
    p = Producing(monkeypatch, Answer([chunk(1), chunk(2)]), Answer([chunk(3, 4), chunk(5, finish="length"),
                                                                     DONE]),
                  n_decode=2, migrate=True, max_tokens=5)
    p.core.decode_pool.workers[1].begin()  # busier: only the broken worker's exclusion picks it
    await p.produce()
    assert tokens_of(await p.relayed()) == [1, 2, 3, 4, 5]
    assert p.buffer.ended_with_done and p.buffer.error_event is None
    # The continuation: the prompt and what the client already has, for the tokens still due.
    worker, body = p.upstream.opened[1]
    assert worker != p.upstream.opened[0][0] and p.f.record.decode_worker is not None \
        and p.f.record.decode_worker.url == worker
    assert body["token_ids"] == [*PROMPT, 1, 2] and body["sampling_params"]["max_tokens"] == 3
    assert body["request_id"] == BASE_ID and "kv_transfer_params" not in body
    assert sample(p.core, "pd_proxy_migrations_total") == 1
    assert [o for _, o in p.released] == [Outcome.FAILURE, Outcome.SUCCESS]


async def test_a_protocol_error_is_never_migrated(monkeypatch: pytest.MonkeyPatch) -> None:
    p = Producing(monkeypatch, Answer([b"data: <html>\n\n", DONE]), Answer([*EVENTS, DONE]),
                  n_decode=2, migrate=True)
    await p.produce()
    assert len(p.opened()) == 1  # a worker that broke the protocol is not followed elsewhere
    assert "not JSON" in message(p.buffer.error_event)


async def test_a_stream_broken_after_its_last_token_ends_cleanly(monkeypatch: pytest.MonkeyPatch) -> None:
    p = Producing(monkeypatch, Answer([chunk(1), chunk(2, finish="length")]), n_decode=2, migrate=True,
                  max_tokens=2)
    await p.produce()
    # Nothing is left to generate: the client's stream ends as if [DONE] had come.
    assert tokens_of(await p.relayed()) == [1, 2]
    assert p.buffer.ended_with_done and p.buffer.error_event is None
    assert len(p.opened()) == 1


async def test_write_client_closes_a_client_that_stopped_reading() -> None:
    core = make_core(ScriptedUpstream([]), slow_reader_timeout=0.01)
    stream = make_stream(core)
    aborted: list[bool] = []
    # the client's window is shut: what was written before still waits in the transport's buffer
    request = SimpleNamespace(transport=SimpleNamespace(
        abort=lambda: aborted.append(True), get_write_buffer_size=lambda: 70_000,
        get_write_buffer_limits=lambda: (16384, 65536)))

    async def write(data: bytes) -> None:
        await asyncio.Event().wait()  # and the write never returns

    resp = SimpleNamespace(write=write)
    with pytest.raises(ConnectionResetError):
        await stream.client.write_client(cast(web.Request, request), cast(web.StreamResponse, resp),
                                         b"data: x\n\n")
    assert aborted == [True]


@pytest.mark.parametrize(("buffered", "size", "timed"), [
    (0, 100, False), (0, 65536 - 16384, False), (0, 65536 - 16384 + 1, True), (1, 100, True)])
async def test_only_a_write_that_could_wait_for_the_client_is_timed(
        monkeypatch: pytest.MonkeyPatch, buffered: int, size: int, timed: bool) -> None:
    """A write into an empty transport buffer that stays under its high-water mark (with room for
    framing and the head) cannot pause writing, so it cannot wait: no timer. Any other is bounded
    by ``slow_reader_timeout``."""
    core = make_core(ScriptedUpstream([]), slow_reader_timeout=5.0)
    stream = make_stream(core)
    timers: list[float | None] = []
    timeout = asyncio.timeout

    def counted(delay: float | None) -> asyncio.Timeout:
        timers.append(delay)
        return timeout(delay)

    monkeypatch.setattr(asyncio, "timeout", counted)
    request = SimpleNamespace(transport=SimpleNamespace(
        abort=lambda: None, get_write_buffer_size=lambda: buffered,
        get_write_buffer_limits=lambda: (16384, 65536)))
    written: list[tuple[bytes, bool]] = []

    async def write(data: bytes) -> None:
        written.append((data, False))

    async def write_eof(data: bytes) -> None:
        written.append((data, True))

    resp = SimpleNamespace(write=write, write_eof=write_eof)
    data = b"x" * size
    client, to = cast(web.Request, request), cast(web.StreamResponse, resp)
    await stream.client.write_client(client, to, data)
    await stream.client.write_client(client, to, b"end", eof=True)
    assert written == [(data, False), (b"end", True)]
    # the first write is timed as the case says; the stream's end (3 bytes) only when the buffer holds bytes
    assert timers == [5.0] * (int(timed) + int(buffered > 0))


@pytest.mark.parametrize(("tokens", "samples"), [(5, 1), (1, 0), (None, 0)])
async def test_tpot_is_observed_when_usage_gave_the_token_count(tokens: int | None, samples: int) -> None:
    core = make_core(ScriptedUpstream([]))
    stream = make_stream(core)
    f = make_flight(core)
    f.completion_tokens = tokens
    stream.client._observe_stream(f, 10.0, 11.0)
    assert sample(core, "pd_proxy_tpot_seconds_count") == samples
    if samples:
        assert sample(core, "pd_proxy_tpot_seconds_sum") == pytest.approx(0.25)  # 1 s over 4 gaps
