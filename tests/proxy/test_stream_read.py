"""DecodeReader: one decode stream read into the client's buffer, against a scripted upstream. Each
way a stream ends has its ``Status``; the first event is checked; the usage chunk is noted."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from proxy.pools import Worker
from proxy.sse.first_token import FirstToken
from proxy.sse.first_token_filter import FirstTokenFilter
from proxy.sse.relay import StreamBuffer
from proxy.stream.read import DecodeReader, Status
from proxy.walk.core import Core
from proxy.walk.flight import Flight
from proxy.wire.errors import UpstreamStatusError, UpstreamUnavailable
from tests.proxy.scripted_streams import (
    DONE,
    KV_PARAMS,
    SPLITS,
    Answer,
    ScriptedUpstream,
    chunk,
    decode_body,
    drain,
    error_event,
    make_core,
    make_flight,
    sample,
    tokens_of,
)

Split = Callable[[list[bytes]], list[bytes]]
Result = tuple[Status, bytes | None, Any]


class Reading:
    """One decode stream read by a ``DecodeReader`` over a scripted upstream."""

    def __init__(self, *answers: Answer | UpstreamUnavailable, usage: bool = False,
                 output_mode: str = "tokens", **settings: Any) -> None:
        self.upstream = ScriptedUpstream(list(answers))
        self.core: Core = make_core(self.upstream, **settings)
        self.reader = DecodeReader(self.core)
        self.worker: Worker = self.core.decode_pool.workers[0]
        self.f: Flight = make_flight(self.core, usage=usage, output_mode=output_mode)
        self.buffer = StreamBuffer(self.core.settings.slow_reader_max_bytes)

    async def once(self, *, kv: bool = False) -> Result:
        return await self.reader.once(self.f, self.worker, decode_body(kv), self.buffer, None)

    def errors(self, error: str) -> float:
        return sample(self.core, "pd_proxy_upstream_errors_total", pool="decode", worker=self.worker.url,
                      error=error)

    def inflight(self) -> float:
        return sample(self.core, "pd_proxy_inflight_requests", pool="decode")


def error_message(event: bytes | None) -> str:
    assert event is not None and event.startswith(b"data: ") and event.endswith(b"\n\n")
    message = json.loads(event[6:])["error"]["message"]
    assert isinstance(message, str)
    return message


EVENTS = [chunk(1), chunk(2, 3), chunk(4, finish="length")]


@pytest.mark.parametrize("split", SPLITS.values(), ids=SPLITS.keys())
async def test_done_relays_every_event_and_keeps_the_connection(split: Split) -> None:
    answer = Answer(split([*EVENTS, DONE]))
    r = Reading(answer)
    assert await r.once() == (Status.DONE, None, None)
    relayed = await drain(r.buffer)
    assert tokens_of(relayed) == [1, 2, 3, 4] and DONE not in relayed
    assert answer.released  # read to its end: the connection goes back to the pool
    assert r.f.headers_ready is not None and r.f.headers_ready.done() and r.f.settled.is_set()
    assert r.inflight() == 0
    assert sample(r.core, "pd_proxy_upstream_requests_total", pool="decode", worker=r.worker.url) == 1


@pytest.mark.parametrize("split", SPLITS.values(), ids=SPLITS.keys())
async def test_no_done_is_broken_with_a_protocol_error_event(split: Split) -> None:
    answer = Answer(split(EVENTS))
    r = Reading(answer)
    status, error, exc = await r.once()
    assert status is Status.BROKEN and exc is None
    assert "stream ended without [DONE]" in error_message(error)
    assert tokens_of(await drain(r.buffer)) == [1, 2, 3, 4]  # what came is relayed; the error follows
    assert r.errors("protocol") == 1
    assert not answer.released  # not read to [DONE]: closed, never reused


async def test_a_reset_mid_way_is_broken_with_the_failure() -> None:
    reset = UpstreamUnavailable("decode", "w", "connection reset")
    r = Reading(Answer([EVENTS[0]], broken=reset))
    status, error, exc = await r.once()
    assert (status, exc) == (Status.BROKEN, reset)
    assert error == reset.sse_event()
    assert r.errors("connect") == 1 and r.errors("protocol") == 0


async def test_an_error_event_mid_way_is_broken_with_ds_event() -> None:
    event = error_event(500, "engine died")
    r = Reading(Answer([EVENTS[0], event + EVENTS[1] + DONE]))
    status, error, _ = await r.once(kv=True)  # not the first event: no longer a KV failure
    assert (status, error) == (Status.BROKEN, event)
    assert tokens_of(await drain(r.buffer)) == [1]  # nothing after the error event
    assert r.errors("error_event") == 1


@pytest.mark.parametrize("split", SPLITS.values(), ids=SPLITS.keys())
async def test_garbage_first_is_protocol_and_nothing_is_relayed(split: Split) -> None:
    r = Reading(Answer(split([b"data: <html>oops</html>\n\n", *EVENTS, DONE])))
    status, error, _ = await r.once()
    assert status is Status.PROTOCOL
    assert "not JSON" in error_message(error)
    assert await drain(r.buffer) == b""
    assert r.errors("protocol") == 1


@pytest.mark.parametrize(("mode", "said"), [("text", "'text'"), (None, "None")])
async def test_the_first_event_must_answer_the_requested_output_mode(mode: str | None, said: str) -> None:
    r = Reading(Answer([chunk(1, mode=mode), DONE]))
    status, error, _ = await r.once()
    assert status is Status.PROTOCOL
    assert f"answered output_mode {said} for a 'tokens' request" in error_message(error)
    assert await drain(r.buffer) == b""


async def test_an_event_larger_than_the_byte_cap_is_protocol() -> None:
    r = Reading(Answer([EVENTS[0], b"data: " + b"7" * 300, b"7" * 300]), slow_reader_max_bytes=256)
    status, error, _ = await r.once()
    assert status is Status.PROTOCOL
    assert "larger than the byte cap" in error_message(error)


@pytest.mark.parametrize("split", SPLITS.values(), ids=SPLITS.keys())
async def test_a_server_error_event_first_on_a_kv_hop_is_kv_failed(split: Split) -> None:
    event = error_event(503)
    r = Reading(Answer(split([event, DONE])))
    status, error, exc = await r.once(kv=True)
    assert status is Status.KV_FAILED and error == event
    # As ambiguous as a 5xx before the first byte: the decode engine decides whom it blames.
    assert isinstance(exc, UpstreamStatusError) and exc.upstream_status == 503
    assert await drain(r.buffer) == b""  # nothing reached the client: another worker may take it
    assert r.f.timing.first_token is None  # not a first token
    assert r.errors("error_event") == 1


@pytest.mark.parametrize(("code", "kv"), [(503, False), (400, True)])
async def test_an_error_event_first_is_only_a_kv_failure_when_kv_was_pulled_and_it_is_5xx(
        code: int, kv: bool) -> None:
    event = error_event(code)
    r = Reading(Answer([event, DONE]))
    status, error, exc = await r.once(kv=kv)
    assert (status, error, exc) == (Status.BROKEN, event, None)


async def test_an_open_failure_is_open_failed_and_sends_no_headers() -> None:
    refused = UpstreamUnavailable("decode", "w", "connection refused")
    r = Reading(refused)
    status, error, exc = await r.once()
    assert (status, error, exc) == (Status.OPEN_FAILED, refused.sse_event(), refused)
    assert r.f.headers_ready is not None and not r.f.headers_ready.done()
    assert r.errors("connect") == 1 and r.inflight() == 0


async def test_a_buffer_closed_for_a_slow_client_is_closed_and_reading_stops() -> None:
    events = [chunk(i) for i in range(40)]
    answer = Answer([*events, DONE])  # one event per read
    r = Reading(answer, slow_reader_max_bytes=1024)
    assert await r.once() == (Status.CLOSED, None, None)
    assert r.buffer.overflowed == "stream"
    assert answer.taken < len(events)  # D's stream is left at once (its clean-up aborts it)


@pytest.mark.parametrize("split", SPLITS.values(), ids=SPLITS.keys())
async def test_usage_is_noted_from_the_last_chunk(split: Split) -> None:
    usage = {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    r = Reading(Answer(split([*EVENTS, chunk(usage=usage), DONE])), usage=True)
    assert (await r.once())[0] is Status.DONE
    assert r.f.completion_tokens == 4


def _choice_event(index: int, *tokens: int) -> bytes:
    d = {"request_id": "generate-tokens-r1", "choices": [{"index": index, "token_ids": list(tokens),
                                                          "finish_reason": None}], "output_mode": "tokens"}
    return b"data: " + json.dumps(d, separators=(",", ":")).encode() + b"\n\n"


async def test_token_1_is_taken_out_of_each_choices_first_event_in_a_later_read() -> None:
    """Two choices, P's token 4 first in each: D's first event of choice 1 comes in a later read
    than choice 0's. Token 1 is taken out of both first events; the other events go on as D sent
    them."""
    events = [_choice_event(0, 4, 5), _choice_event(0, 6), _choice_event(1, 4, 7), _choice_event(1, 9)]
    r = Reading(Answer([*events, DONE]))
    r.f.first_filter = FirstTokenFilter([FirstToken(0, 4, None), FirstToken(1, 4, None)])
    assert (await r.once())[0] is Status.DONE
    assert await drain(r.buffer) == b"".join([_choice_event(0, 5), events[1], _choice_event(1, 7), events[3]])


async def test_usage_is_not_noted_without_done() -> None:
    usage = {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    r = Reading(Answer([*EVENTS, chunk(usage=usage)]), usage=True)
    assert (await r.once())[0] is Status.BROKEN
    assert r.f.completion_tokens is None


async def test_the_first_event_ends_the_lease_as_pulled_and_times_the_first_token() -> None:
    r = Reading(Answer([EVENTS[0]]))
    r.core.leases.hold(r.f.record, "http://127.0.0.1:9", dict(KV_PARAMS))
    r.f.timing.decode_start = r.core.clock()
    await r.once(kv=True)
    lease = r.f.record.lease
    assert lease is not None and lease.reason == "pulled"  # D had the request: it pulled the KV
    assert r.f.record.kv_params is None
    assert r.f.timing.first_token is not None
    assert r.core.metrics.registry.get_sample_value(
        "pd_proxy_stage_seconds_count", {"stage": "decode_first_token"}) == 1


@pytest.mark.parametrize(("reads", "reason"), [([DONE], "pulled"), ([b"data: {"], "unknown")])
async def test_a_stream_that_ends_before_any_event_ends_the_lease_too(reads: list[bytes],
                                                                     reason: str) -> None:
    r = Reading(Answer(reads))
    r.core.leases.hold(r.f.record, "http://127.0.0.1:9", dict(KV_PARAMS))
    await r.once(kv=True)
    lease = r.f.record.lease
    assert lease is not None and lease.reason == reason
    assert r.f.settled.is_set()
