"""The P/D hand-off: kv_transfer_params, KV held on the prefill side, pulls, leases, abort rules."""

from __future__ import annotations

import asyncio
import re
import socket
from typing import Any

import aiohttp

from tests.fixtures_sim import SimFactory, SimWorker
from tests.sim.helpers import ABORT, GEN, body, eventually, post_json, stream_events, stream_tokens

PROMPT = [(i * 37) % 500 + 3 for i in range(40)]  # 40 tokens = 3 blocks of 16
KV_KEYS = [
    "do_remote_prefill",
    "do_remote_decode",
    "remote_block_ids",
    "remote_engine_id",
    "remote_request_id",
    "remote_host",
    "remote_port",
    "tp_size",
    "dcp_size",
    "pp_size",
    "remote_num_tokens",
    "remote_blocks_expiry_time",
    "transfer_mode",
    "remote_prefill_cached_tokens",
]


def prefill_body(rid: str, tokens: list[int] = PROMPT, **extra: Any) -> dict[str, Any]:
    return body(
        tokens,
        max_tokens=1,
        request_id=rid,
        stream=False,
        kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False},
        **extra,
    )


async def do_prefill(
    s: aiohttp.ClientSession, p: SimWorker, rid: str, tokens: list[int] = PROMPT
) -> dict[str, Any]:
    st, res = await post_json(s, p.url + GEN, prefill_body(rid, tokens))
    assert st == 200, res
    kv: dict[str, Any] = res["kv_transfer_params"]
    return kv


def metric_value(text: str, series: str) -> float:
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{series} not found")


async def releases(w: SimWorker) -> dict[str, int]:
    r: dict[str, int] = (await w.state())["releases"]
    return r


async def test_prefill_returns_real_shape_and_holds_blocks(sim_factory: SimFactory) -> None:
    p = await sim_factory(role="prefill", zero_latency=True)
    async with aiohttp.ClientSession() as s:
        kv = await do_prefill(s, p, "pd1")
        async with s.get(p.url + "/metrics") as r:
            metrics_text = await r.text()
    assert list(kv) == KV_KEYS
    assert kv["do_remote_prefill"] is True and kv["do_remote_decode"] is False
    assert len(kv["remote_block_ids"]) == 1 and len(kv["remote_block_ids"][0]) == 3
    assert re.fullmatch(r"generate-tokens-pd1-[0-9a-f]{8}", kv["remote_request_id"])
    assert (kv["remote_host"], kv["remote_port"]) == ("127.0.0.1", p.port)
    assert kv["remote_num_tokens"] == 40 and kv["transfer_mode"] == "pull"
    assert kv["remote_prefill_cached_tokens"] == 0
    state = await p.state()
    assert [h["remote_request_id"] for h in state["kv_held"]] == [kv["remote_request_id"]]
    assert state["kv_held"][0]["blocks"] == 3
    usage = metric_value(metrics_text, 'vllm:kv_cache_usage_perc{engine="0",model_name="tiny-llama"}')
    assert usage == 3 / 4095


async def test_prefix_cache_hit_reports_cached_tokens(sim_factory: SimFactory) -> None:
    p = await sim_factory(role="prefill", zero_latency=True)
    async with aiohttp.ClientSession() as s:
        first = await do_prefill(s, p, "c1")
        again = await do_prefill(s, p, "c2")
    assert again["remote_prefill_cached_tokens"] == 32  # two full blocks; the last token is recomputed
    assert again["remote_block_ids"][0][:2] == first["remote_block_ids"][0][:2]


async def test_aggregated_equals_pd_equals_continuation(sim_factory: SimFactory) -> None:
    agg = await sim_factory(role="aggregated", zero_latency=True)
    p = await sim_factory(role="prefill", zero_latency=True)
    d = await sim_factory(role="decode", zero_latency=True)
    async with aiohttp.ClientSession() as s:
        _, a = await post_json(s, agg.url + GEN, body(PROMPT, max_tokens=12))
        expected = a["choices"][0]["token_ids"]
        kv = await do_prefill(s, p, "eq")
        _, dec = await post_json(
            s, d.url + GEN, body(PROMPT, max_tokens=12, request_id="eq", kv_transfer_params=kv)
        )
        kv2 = await do_prefill(s, p, "eq2")
        evs = await stream_events(
            s, d.url + GEN, body(PROMPT, max_tokens=12, request_id="eq2", stream=True, kv_transfer_params=kv2)
        )
        _, cont = await post_json(s, agg.url + GEN, body(PROMPT + expected[:5], max_tokens=7))
    assert dec["choices"][0]["token_ids"] == expected
    assert dec["kv_transfer_params"] is None
    assert stream_tokens(evs) == expected
    assert cont["choices"][0]["token_ids"] == expected[5:]
    assert await releases(p) == {"pulled": 2, "aborted": 0, "expired": 0}
    assert (await p.state())["kv_blocks_used"] == 0


async def test_lease_expiry_frees_and_counts(sim_factory: SimFactory) -> None:
    p = await sim_factory(role="prefill", zero_latency=True, lease_seconds=0.2)
    async with aiohttp.ClientSession() as s:
        await do_prefill(s, p, "exp")

        async def expired() -> bool:
            return (await releases(p))["expired"] == 1

        assert await eventually(expired)
        async with s.get(p.url + "/metrics") as r:
            text = await r.text()
    assert 'vllm:nixl_num_kv_expired_reqs_total{engine="0",model_name="tiny-llama"} 1.0' in text
    assert (await p.state())["kv_held"] == []


async def test_abort_to_prefill_while_prefilling_frees_at_once(sim_factory: SimFactory) -> None:
    p = await sim_factory(role="prefill", prefill_base_ms=30_000.0)
    async with aiohttp.ClientSession() as s:
        task = asyncio.ensure_future(post_json(s, p.url + GEN, prefill_body("pa")))

        async def prefilling() -> bool:
            return any(r["state"] == "prefilling" for r in (await p.state())["inflight"])

        assert await eventually(prefilling)
        await post_json(s, p.url + ABORT, {"request_ids": ["generate-tokens-pa"]})
        st, res = await task
    assert st == 200
    assert res["kv_transfer_params"] is None and res["choices"][0]["finish_reason"] == "abort"
    state = await p.state()
    assert state["kv_held"] == [] and state["kv_blocks_used"] == 0


async def test_abort_to_prefill_after_it_finished_has_no_effect(sim_factory: SimFactory) -> None:
    p = await sim_factory(role="prefill", zero_latency=True)
    async with aiohttp.ClientSession() as s:
        kv = await do_prefill(s, p, "pf")
        await post_json(s, p.url + ABORT, {"request_ids": ["generate-tokens-pf", kv["remote_request_id"]]})
        await asyncio.sleep(0.05)
    state = await p.state()
    assert [h["remote_request_id"] for h in state["kv_held"]] == [kv["remote_request_id"]]


async def test_decode_aborted_before_pull_tells_prefill(sim_factory: SimFactory) -> None:
    p = await sim_factory(role="prefill", zero_latency=True)
    d = await sim_factory(role="decode", max_running=1, itl_ms=5.0, prefill_base_ms=0.0)
    async with aiohttp.ClientSession() as s:
        blocker = asyncio.ensure_future(
            post_json(s, d.url + GEN, body(max_tokens=400, request_id="blk", sp={"ignore_eos": True}))
        )
        kv = await do_prefill(s, p, "dq")
        queued = asyncio.ensure_future(
            post_json(s, d.url + GEN, body(PROMPT, max_tokens=4, request_id="dq", kv_transfer_params=kv))
        )

        async def waiting() -> bool:
            return bool((await d.state())["waiting"] == 1)

        assert await eventually(waiting)
        await post_json(s, d.url + ABORT, {"request_ids": ["generate-tokens-dq"]})

        async def freed() -> bool:
            return (await releases(p))["aborted"] == 1

        assert await eventually(freed)
        st, res = await queued
        assert (
            st == 200
            and res["choices"][0]["finish_reason"] == "abort"
            and res["choices"][0]["token_ids"] == []
        )
        await post_json(s, d.url + ABORT, {"request_ids": ["generate-tokens-blk"]})
        await blocker
    assert (await p.state())["kv_held"] == []


async def test_decode_disconnect_before_pull_tells_prefill(sim_factory: SimFactory) -> None:
    p = await sim_factory(role="prefill", zero_latency=True)
    d = await sim_factory(role="decode", max_running=1, itl_ms=5.0, prefill_base_ms=0.0)
    async with aiohttp.ClientSession() as s:
        blocker = asyncio.ensure_future(
            post_json(s, d.url + GEN, body(max_tokens=400, request_id="blk2", sp={"ignore_eos": True}))
        )
        kv = await do_prefill(s, p, "dd")
        queued = asyncio.ensure_future(
            post_json(s, d.url + GEN, body(PROMPT, max_tokens=4, kv_transfer_params=kv))
        )

        async def waiting() -> bool:
            return bool((await d.state())["waiting"] == 1)

        assert await eventually(waiting)
        queued.cancel()

        async def freed() -> bool:
            return (await releases(p))["aborted"] == 1

        assert await eventually(freed)
        await post_json(s, d.url + ABORT, {"request_ids": ["generate-tokens-blk2"]})
        await blocker


async def test_decode_rejected_with_400_does_not_tell_prefill(sim_factory: SimFactory) -> None:
    p = await sim_factory(role="prefill", zero_latency=True)
    d = await sim_factory(role="decode", zero_latency=True)
    async with aiohttp.ClientSession() as s:
        kv = await do_prefill(s, p, "rej")
        st, _ = await post_json(
            s, d.url + GEN, body(PROMPT, request_id="rej", kv_transfer_params=kv, sp={"max_tokens": 0})
        )
        await asyncio.sleep(0.05)
    assert st == 400
    assert len((await p.state())["kv_held"]) == 1


async def test_prefill_stream_hop_pins_blocks_without_params(sim_factory: SimFactory) -> None:
    p = await sim_factory(role="prefill", zero_latency=True)
    async with aiohttp.ClientSession() as s:
        b = prefill_body("ps")
        b["stream"] = True
        evs = await stream_events(s, p.url + GEN, b)
    assert len(evs) == 2 and "kv_transfer_params" not in evs[0]
    assert len((await p.state())["kv_held"]) == 1


async def test_unreachable_prefill_is_a_500(sim_factory: SimFactory) -> None:
    d = await sim_factory(role="decode", zero_latency=True)
    with socket.socket() as sock:  # a port that is closed by the time D dials it
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    kv = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [[1, 2]],
        "remote_engine_id": "no-such-engine",
        "remote_request_id": "generate-tokens-nope",
        "remote_host": "127.0.0.1",
        "remote_port": port,
        "tp_size": 1,
        "dcp_size": 1,
        "pp_size": 1,
        "remote_num_tokens": 40,
        "remote_blocks_expiry_time": None,
        "transfer_mode": "pull",
        "remote_prefill_cached_tokens": 0,
    }
    async with aiohttp.ClientSession() as s:
        st, res = await post_json(s, d.url + GEN, body(PROMPT, kv_transfer_params=kv))
        evs = await stream_events(s, d.url + GEN, body(PROMPT, kv_transfer_params=kv, stream=True))
        async with s.get(d.url + "/metrics") as r:
            text = await r.text()
    assert (st, res) == (
        500,
        {
            "error": {
                "message": "Internal server error",
                "type": "InternalServerError",
                "param": None,
                "code": 500,
            }
        },
    )
    assert evs[0] == res and evs[1] == "[DONE]"
    assert 'vllm:nixl_num_failed_transfers_total{engine="0",model_name="tiny-llama"} 2.0' in text
    assert (await d.state())["inflight"] == []


async def test_reused_kv_params_are_accepted(sim_factory: SimFactory) -> None:
    p = await sim_factory(role="prefill", zero_latency=True)
    d = await sim_factory(role="decode", zero_latency=True)
    async with aiohttp.ClientSession() as s:
        kv = await do_prefill(s, p, "ru")
        st1, a = await post_json(s, d.url + GEN, body(PROMPT, kv_transfer_params=kv))
        st2, b = await post_json(s, d.url + GEN, body(PROMPT, kv_transfer_params=kv))
    assert st1 == st2 == 200
    assert a["choices"][0]["token_ids"] == b["choices"][0]["token_ids"]


async def test_decode_aborted_during_pull_frees_prefill(sim_factory: SimFactory) -> None:
    p = await sim_factory(role="prefill", prefill_base_ms=0.0, transfer_per_block_ms=20_000.0)
    d = await sim_factory(role="decode", zero_latency=True)
    async with aiohttp.ClientSession() as s:
        kv = await do_prefill(s, p, "dp")
        task = asyncio.ensure_future(
            post_json(s, d.url + GEN, body(PROMPT, request_id="dp", kv_transfer_params=kv))
        )

        async def pulling() -> bool:
            return any(r["state"] == "pulling" for r in (await d.state())["inflight"])

        assert await eventually(pulling)
        await post_json(s, d.url + ABORT, {"request_ids": ["generate-tokens-dp"]})
        st, res = await task

        async def freed() -> bool:
            return (await releases(p))["aborted"] == 1

        assert await eventually(freed)
    assert st == 200 and res["choices"][0]["finish_reason"] == "abort"
    assert (await p.state())["kv_held"] == [] and (await d.state())["kv_blocks_used"] == 0


async def test_text_mode_pd_equals_aggregated(sim_factory: SimFactory) -> None:
    agg = await sim_factory(zero_latency=True)
    p = await sim_factory(role="prefill", zero_latency=True)
    d = await sim_factory(role="decode", zero_latency=True)
    async with aiohttp.ClientSession() as s:
        _, a = await post_json(
            s, agg.url + GEN, body(PROMPT, max_tokens=10, output_mode="text", stream=False)
        )
        kv = await do_prefill(s, p, "tx")
        evs = await stream_events(
            s,
            d.url + GEN,
            body(PROMPT, max_tokens=10, output_mode="text", stream=True, kv_transfer_params=kv),
        )
    text = "".join(e["choices"][0]["text"] for e in evs if isinstance(e, dict) and e["choices"])
    assert stream_tokens(evs) == a["choices"][0]["token_ids"]
    assert text == a["choices"][0]["text"]


async def test_params_naming_another_engine_fail_the_pull(sim_factory: SimFactory) -> None:
    p = await sim_factory(role="prefill", zero_latency=True)
    d = await sim_factory(role="decode", zero_latency=True)
    async with aiohttp.ClientSession() as s:
        kv = await do_prefill(s, p, "eng")
        st, res = await post_json(
            s, d.url + GEN, body(PROMPT, kv_transfer_params={**kv, "remote_engine_id": "other"})
        )
    assert st == 500 and res["error"]["message"] == "Internal server error"
    assert len((await p.state())["kv_held"]) == 1


async def test_decode_acts_on_kv_params_in_extra_args_as_vllm(sim_factory: SimFactory) -> None:
    """vLLM's engine reads ``sampling_params.extra_args["kv_transfer_params"]``; the top-level field
    (copied there by its server) wins when not null. pd-sim does the same: a decode request whose
    params come only through extra_args pulls P's KV."""
    agg = await sim_factory(role="aggregated", zero_latency=True)
    p = await sim_factory(role="prefill", zero_latency=True)
    d = await sim_factory(role="decode", zero_latency=True)
    async with aiohttp.ClientSession() as s:
        _, a = await post_json(s, agg.url + GEN, body(PROMPT, max_tokens=6))
        kv = await do_prefill(s, p, "xa")
        st, dec = await post_json(s, d.url + GEN, body(PROMPT, max_tokens=6, request_id="xa",
                                                       sp={"extra_args": {"kv_transfer_params": kv}}))
        assert st == 200, dec
        assert dec["choices"][0]["token_ids"] == a["choices"][0]["token_ids"]
        assert await releases(p) == {"pulled": 1, "aborted": 0, "expired": 0}
        # The top-level field wins over extra_args (here: stale params in extra_args are ignored).
        kv2 = await do_prefill(s, p, "xb")
        st, dec = await post_json(s, d.url + GEN, body(
            PROMPT, max_tokens=6, request_id="xb", kv_transfer_params=kv2,
            sp={"extra_args": {"kv_transfer_params": {**kv2, "remote_port": 1}}}))
        assert st == 200, dec
        assert await releases(p) == {"pulled": 2, "aborted": 0, "expired": 0}
