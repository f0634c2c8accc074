"""proxy.walk.core: what every part of the walk shares (counting a worker call, the queue limit, the
KV lease, decode-only, done, aborts, usage), on a Core built from settings."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from proxy.fleet import BYPASS_HEADER
from proxy.observe.state import Phase
from proxy.pools import Deadline
from proxy.walk.core import error_class
from proxy.wire.errors import (
    UpstreamError,
    UpstreamProtocolError,
    UpstreamStatusError,
    UpstreamTimeout,
    UpstreamUnavailable,
)
from tests.proxy.parts import P_URLS, count, hold, make_core, make_flight, worker


def status(code: int) -> UpstreamStatusError:
    return UpstreamStatusError("decode", "w", code, b"{}", "application/json")


@pytest.mark.parametrize(("error", "label"), [
    (UpstreamTimeout("decode", "w", "timed out"), "timeout"),
    (UpstreamUnavailable("decode", "w", "unreachable"), "connect"),
    (status(400), "http_4xx"),
    (status(503), "http_5xx"),
    (UpstreamProtocolError("decode", "w", "bad JSON"), "protocol"),
])
def test_error_class_names_the_failure(error: UpstreamError, label: str) -> None:
    assert error_class(error) == label


async def test_a_call_is_counted_on_its_worker_and_its_error_by_class() -> None:
    core, _, _ = make_core()
    p = worker(core, P_URLS[0])
    m = core.metrics

    async def ok() -> str:
        assert count(m.inflight, pool="prefill") == 1  # in flight while it runs
        return "reply"

    assert await core.call(p, ok()) == "reply"

    async def fails() -> None:
        raise UpstreamTimeout("prefill", p.url, "timed out")

    with pytest.raises(UpstreamTimeout):
        await core.call(p, fails())
    assert count(m.upstream_requests, pool="prefill", worker=p.url) == 2
    assert count(m.upstream_errors, pool="prefill", worker=p.url, error="timeout") == 1
    assert count(m.inflight, pool="prefill") == 0


async def test_the_queue_limit_is_the_deadline_when_it_comes_first() -> None:
    core, _, clock = make_core(pools={"queue_timeout": 10.0})
    f = make_flight(core)
    assert core.queue_limit(f) == 10.0
    f.deadline = Deadline(clock() + 3.0, clock)
    assert core.queue_limit(f) == 3.0
    f.deadline = Deadline(clock() + 30.0, clock)
    assert core.queue_limit(f) == 10.0
    clock.advance(31.0)
    assert core.queue_limit(f) == 0.0  # passed: no wait at all, never a negative one


async def test_a_lease_is_valid_until_it_closes_or_runs_out() -> None:
    core, _, clock = make_core(lease_duration=30.0)
    f = make_flight(core)
    assert not core.lease_valid(f)  # nothing held yet
    hold(core, f, worker(core, P_URLS[0]))
    assert core.lease_valid(f)
    clock.advance(29.0)
    assert core.lease_valid(f)
    clock.advance(1.0)
    assert not core.lease_valid(f)  # P freed the blocks at its lease's end

    g = make_flight(core, rid="r2")
    hold(core, g, worker(core, P_URLS[0]))
    core.close_lease(g, "pulled")
    core.close_lease(g, "aborted")  # the first reason stands
    assert not core.lease_valid(g) and g.record.kv_params is None
    assert g.record.lease is not None and g.record.lease.reason == "pulled"
    assert count(core.metrics.kv_leases_closed, reason="pulled") == 1
    assert count(core.metrics.kv_leases_closed, reason="aborted") == 0


async def test_leases_run_out_on_the_workers_clock() -> None:
    core, _, clock = make_core(lease_duration=30.0)
    f, g = make_flight(core), make_flight(core, rid="r2")
    hold(core, f, worker(core, P_URLS[0]))
    clock.advance(10.0)
    hold(core, g, worker(core, P_URLS[0]))
    clock.advance(20.0)
    assert core.expire_leases() == 1
    assert f.record.lease is not None and f.record.lease.reason == "expired"
    assert g.record.lease is not None and g.record.lease.end is None
    assert core.leases.open_count == 1


async def test_decode_only_is_named_and_counted_once_and_ends_the_lease_as_unknown() -> None:
    core, _, _ = make_core()
    f = make_flight(core)
    hold(core, f, worker(core, P_URLS[0]))
    core.decode_only(f, "decode_retry")
    core.decode_only(f, "no_usable_pair")  # a second reason changes nothing the client sees
    assert f.headers[BYPASS_HEADER] == "decode_retry"
    assert count(core.metrics.decode_only, reason="decode_retry") == 1
    assert count(core.metrics.decode_only, reason="no_usable_pair") == 0
    assert f.record.kv_params is None and not core.lease_valid(f)
    assert f.record.lease is not None and f.record.lease.reason == "unknown"


async def test_done_cancels_the_forced_end() -> None:
    core, _, _ = make_core()
    f = make_flight(core)
    fired: list[bool] = []
    f.force_end = asyncio.get_running_loop().call_later(0.01, fired.append, True)
    handle = f.force_end
    core.set_done(f)
    assert f.record.phase is Phase.DONE and f.force_end is None and handle.cancelled()
    await asyncio.sleep(0.03)
    assert fired == []


async def test_an_abort_is_counted_once_with_its_first_source_and_state() -> None:
    core, _, _ = make_core()
    f = make_flight(core)
    f.record.phase = Phase.KV_HELD
    assert core.note_abort(f, "client_call")
    assert not core.note_abort(f, "disconnect")
    assert f.record.abort_source == "client_call"
    assert count(core.metrics.aborts, source="client_call", state="kv_held") == 1
    assert count(core.metrics.aborts, source="disconnect", state="kv_held") == 0


def usage(prompt: int, cached: int | None = None, completion: int = 4) -> dict[str, Any]:
    details = None if cached is None else {"cached_tokens": cached}
    return {"prompt_tokens": prompt, "completion_tokens": completion, "prompt_tokens_details": details}


@pytest.mark.parametrize(("kv_blocks", "reply", "suspect"), [
    (2, usage(9, cached=8), False),  # D reports the transferred tokens
    (2, usage(9, cached=0), True),  # D computed the whole prompt
    (0, usage(9), True),  # P advertised no blocks
    (2, usage(9), False),  # D tells nothing: no suspicion
    (None, usage(9, cached=0), False),  # no prefill reply accepted (decode-only)
    (2, usage(3, cached=0), False),  # shorter than one KV block (4 tokens here)
])
async def test_usage_keeps_the_count_and_flags_a_long_prompt_with_no_transfer(
        kv_blocks: int | None, reply: dict[str, Any], suspect: bool) -> None:
    core, _, _ = make_core()
    f = make_flight(core)
    f.kv_blocks = kv_blocks
    core.note_usage(f, reply)
    assert f.completion_tokens == 4
    assert count(core.metrics.suspect_no_transfer) == (1 if suspect else 0)


async def test_usage_of_a_decode_only_or_aborted_request_is_no_suspect() -> None:
    core, _, _ = make_core()
    f, g = make_flight(core), make_flight(core, rid="r2")
    f.kv_blocks = g.kv_blocks = 0
    f.headers[BYPASS_HEADER] = "prefill_error"
    g.abort("client_call")
    core.note_usage(f, usage(9, cached=0))
    core.note_usage(g, usage(9, cached=0))
    core.note_usage(g, None)  # no usage at all: nothing
    assert count(core.metrics.suspect_no_transfer) == 0
    assert f.completion_tokens == g.completion_tokens == 4


async def test_the_upstream_is_there_once_the_app_started() -> None:
    core, upstream, _ = make_core()
    assert core.upstream is upstream  # type: ignore[comparison-overlap]
    core._upstream = None
    with pytest.raises(RuntimeError, match="has not started"):
        _ = core.upstream
