"""Each pd-sim fault, set at start-up (flags / settings) or at run time (POST /sim/faults)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import aiohttp
import pytest

from tests.fixtures_sim import SimFactory, SimProcess
from tests.sim.helpers import GEN, body, eventually, post_json, stream_events, stream_tokens
from tests.sim.test_pd import PROMPT, do_prefill, metric_value, prefill_body
from workers.sim.cli import _parser, settings_from_args
from workers.sim.settings import Faults


async def test_fail_next_n_with_status_then_recover(sim_factory: SimFactory) -> None:
    w = await sim_factory(zero_latency=True)
    faults = await w.set_faults(fail_next=2, fail_status=503)
    assert faults["fail_next"] == 2
    async with aiohttp.ClientSession() as s:
        r1 = await post_json(s, w.url + GEN, body())
        r2 = await post_json(s, w.url + GEN, body(stream=True))
        st3, ok = await post_json(s, w.url + GEN, body())
    assert (
        r1
        == r2
        == (
            503,
            {
                "error": {
                    "message": "Service Unavailable",
                    "type": "ServiceUnavailableError",
                    "param": None,
                    "code": 503,
                }
            },
        )
    )
    assert st3 == 200 and ok["choices"][0]["finish_reason"] == "length"
    state = await w.state()
    assert state["faults"]["fail_next"] == 0 and state["generate_calls"] == 3


async def test_fail_with_500_uses_vllms_message(sim_factory: SimFactory) -> None:
    w = await sim_factory(zero_latency=True, faults={"fail_next": 1})
    async with aiohttp.ClientSession() as s:
        st, res = await post_json(s, w.url + GEN, body())
    assert (st, res["error"]["message"], res["error"]["type"]) == (
        500,
        "Internal server error",
        "InternalServerError",
    )


async def test_drop_kv_params_still_holds_blocks(sim_factory: SimFactory) -> None:
    p = await sim_factory(role="prefill", zero_latency=True)
    await p.set_faults(drop_kv_params=True)
    async with aiohttp.ClientSession() as s:
        st, res = await post_json(s, p.url + GEN, prefill_body("drop"))
    assert st == 200 and res["kv_transfer_params"] is None
    assert len((await p.state())["kv_held"]) == 1


@pytest.mark.parametrize("stream", [False, True])
async def test_hang_before_headers(sim_factory: SimFactory, stream: bool) -> None:
    w = await sim_factory(zero_latency=True)
    await w.set_faults(hang_before_headers=True)
    async with aiohttp.ClientSession() as s:
        task = asyncio.ensure_future(post_json(s, w.url + GEN, body(stream=stream)))

        async def hung(n: int) -> bool:
            return bool((await w.state())["hung_before_headers"] == n)

        assert await eventually(lambda: hung(1))
        assert not task.done()  # no headers, no answer
        task.cancel()  # the client gives up
        assert await eventually(lambda: hung(0))
    await w.set_faults(hang_before_headers=False)
    async with aiohttp.ClientSession() as s:
        assert (await post_json(s, w.url + GEN, body()))[0] == 200


async def test_hang_after_headers(sim_factory: SimFactory) -> None:
    w = await sim_factory(zero_latency=True)
    await w.set_faults(hang_after_headers=True)
    async with aiohttp.ClientSession() as s, s.post(w.url + GEN, json=body(stream=True)) as r:
        assert r.status == 200
        assert r.headers["content-type"] == "text/event-stream; charset=utf-8"
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(r.content.readany(), 0.3)

    async def released() -> bool:
        st = await w.state()
        return not st["inflight"] and st["running"] == 0

    assert await eventually(released)  # the client left: nothing held


async def test_reset_after_k_tokens(sim_factory: SimFactory) -> None:
    w = await sim_factory(zero_latency=True, faults={"reset_after_tokens": 3})
    async with aiohttp.ClientSession() as s, s.post(w.url + GEN, json=body(max_tokens=10, stream=True)) as r:
        got = b""
        with pytest.raises(aiohttp.ClientPayloadError):
            async for chunk in r.content.iter_any():
                got += chunk
    assert got.count(b"data: ") == 3 and b"[DONE]" not in got
    assert (await w.state())["inflight"] == []


async def test_in_band_error_after_k_tokens(sim_factory: SimFactory) -> None:
    w = await sim_factory(zero_latency=True)
    await w.set_faults(error_after_tokens=2)
    async with aiohttp.ClientSession() as s:
        evs = await stream_events(s, w.url + GEN, body(max_tokens=10, stream=True))
    assert len(evs) == 4
    assert all(e["choices"][0]["token_ids"] for e in evs[:2])
    assert evs[2] == {
        "error": {
            "message": "Internal server error",
            "type": "InternalServerError",
            "param": None,
            "code": 500,
        }
    }
    assert evs[3] == "[DONE]"


async def test_fault_set_mid_stream_applies(sim_factory: SimFactory) -> None:
    w = await sim_factory(itl_ms=20.0, prefill_base_ms=0.0)
    async with aiohttp.ClientSession() as s, s.post(w.url + GEN, json=body(max_tokens=200, stream=True)) as r:
        await r.content.readuntil(b"\n\n")
        await w.set_faults(error_after_tokens=0)
        rest = (await r.read()).decode()
    assert '"type":"InternalServerError"' in rest.replace(" ", "") and rest.endswith("data: [DONE]\n\n")


async def test_slow_chunks(sim_factory: SimFactory) -> None:
    w = await sim_factory(zero_latency=True, faults={"chunk_delay_ms": 30.0})
    async with aiohttp.ClientSession() as s:
        evs = await stream_events(s, w.url + GEN, body(max_tokens=4, stream=True))
        async with s.get(w.url + "/metrics") as r:
            text = await r.text()
    assert len(evs) == 5
    # 4 chunks delayed by 30 ms each: the sim's own e2e latency cannot be below 0.12 s
    assert (
        metric_value(text, 'vllm:e2e_request_latency_seconds_sum{engine="0",model_name="tiny-llama"}') >= 0.12
    )


async def test_refuse_kv_pulls(sim_factory: SimFactory) -> None:
    p = await sim_factory(role="prefill", zero_latency=True, faults={"refuse_kv_pulls": True})
    d = await sim_factory(role="decode", zero_latency=True)
    async with aiohttp.ClientSession() as s:
        kv = await do_prefill(s, p, "ref")
        st, res = await post_json(s, d.url + GEN, body(PROMPT, kv_transfer_params=kv))
    assert st == 500 and res["error"]["type"] == "InternalServerError"
    assert len((await p.state())["kv_held"]) == 1  # P keeps them until the lease ends


async def test_first_token_mismatch_makes_ds_first_token_differ_from_ps(sim_factory: SimFactory) -> None:
    p = await sim_factory(role="prefill", zero_latency=True)
    d = await sim_factory(role="decode", zero_latency=True)
    agg = await sim_factory(zero_latency=True)

    async def pd(rid: str) -> tuple[int, list[int]]:
        """P's token, and D's stream with P's KV."""
        st, pre = await post_json(s, p.url + GEN, prefill_body(rid))
        assert st == 200
        events = await stream_events(s, d.url + GEN, body(PROMPT, max_tokens=4, request_id=rid, stream=True,
                                                          kv_transfer_params=pre["kv_transfer_params"]))
        return pre["choices"][0]["token_ids"][0], stream_tokens(events)

    async with aiohttp.ClientSession() as s:
        _, full = await post_json(s, agg.url + GEN, body(PROMPT, max_tokens=4))
        expected = full["choices"][0]["token_ids"]
        assert await pd("same") == (expected[0], expected)  # without the fault: P's token, D's stream
        await d.set_faults(first_token_mismatch=True)
        first, toks = await pd("differs")
        assert first == expected[0] and toks[0] != first
        # D goes on from its own first token, as the model would after prompt + that token
        _, cont = await post_json(s, agg.url + GEN, body([*PROMPT, toks[0]], max_tokens=3))
        assert toks[1:] == cont["choices"][0]["token_ids"]
        # a decode-only request (no KV from a prefill worker) is left alone
        _, only = await post_json(s, d.url + GEN, body(PROMPT, max_tokens=4))
        assert only["choices"][0]["token_ids"] == expected
    assert (await d.state())["faults"]["first_token_mismatch"] is True


async def test_bad_fault_updates_are_rejected(sim_factory: SimFactory) -> None:
    w = await sim_factory(zero_latency=True)
    async with aiohttp.ClientSession() as s:
        st1, e1 = await post_json(s, w.url + "/sim/faults", {"nope": 1})
        st2, _ = await post_json(s, w.url + "/sim/faults", {"fail_status": 200})
        st3, e3 = await post_json(s, w.url + "/sim/faults", {"exit": True})  # not for in-process workers
        st4, cleared = await post_json(s, w.url + "/sim/faults", {"reset": True})
    assert (st1, st2, st3, st4) == (400, 400, 400, 200)
    assert "unknown fault" in e1["error"]["message"] and "exit" in e3["error"]["message"]
    assert cleared == Faults().to_dict()


async def test_exit_fault_ends_the_process(sim_process_factory: Callable[..., Awaitable[SimProcess]]) -> None:
    proc: SimProcess = await sim_process_factory("--zero-latency")
    async with aiohttp.ClientSession() as s:
        st, _ = await post_json(s, proc.url + "/sim/faults", {"exit": True})
    assert st == 200
    assert await asyncio.wait_for(proc.process.wait(), 10) == 3


def test_fault_flags_parse() -> None:
    args = _parser().parse_args(
        [
            "--role",
            "prefill",
            "--fail-next",
            "2",
            "--fail-status",
            "502",
            "--drop-kv-params",
            "--hang-after-headers",
            "--reset-after-tokens",
            "4",
            "--error-after-tokens",
            "5",
            "--chunk-delay-ms",
            "7",
            "--refuse-kv-pulls",
            "--first-token-mismatch",
            "--lease-seconds",
            "0.5",
            "--zero-latency",
            "--tokens-only",
        ]
    )
    s = settings_from_args(args)
    assert s.faults == Faults(
        fail_next=2,
        fail_status=502,
        drop_kv_params=True,
        hang_after_headers=True,
        reset_after_tokens=4,
        error_after_tokens=5,
        chunk_delay_ms=7.0,
        refuse_kv_pulls=True,
        first_token_mismatch=True,
    )
    assert (s.role, s.lease_seconds, s.zero_latency, s.tokens_only, s.enable_scale_out) == (
        "prefill",
        0.5,
        True,
        True,
        False,
    )


def test_first_token_mismatch_is_in_the_help() -> None:
    text = " ".join(_parser().format_help().split())
    assert "--first-token-mismatch decode role: a request with the prefill worker's KV starts with " \
        "another token than the one the prefill worker generated" in text


async def test_exit_after_requests_flag_crashes_mid_traffic(
    sim_process_factory: Callable[..., Awaitable[SimProcess]],
) -> None:
    proc = await sim_process_factory("--zero-latency", "--exit-after-requests", "1")
    async with aiohttp.ClientSession() as s:
        assert (await post_json(s, proc.url + GEN, body()))[0] == 200
        with pytest.raises(aiohttp.ClientError):
            await post_json(s, proc.url + GEN, body())
    assert await asyncio.wait_for(proc.process.wait(), 10) == 3
