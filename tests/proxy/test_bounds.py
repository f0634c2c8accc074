"""Bounded by default: the in-flight limit, the prompt-length cap, and large bodies taken through
the whole walk (parsed in slices, forwarded as the client wrote them)."""

from __future__ import annotations

import json
from typing import Any

from proxy.cli import parse_args
from proxy.config.settings import ProxySettings
from proxy.pools import PoolSettings
from proxy.wire.large_body import LARGE_BODY_BYTES
from tests import sse
from tests.proxy.conftest import PDFactory, req

URLS = ["--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"]


def test_defaults_bound_inflight_requests_and_prompt_length() -> None:
    s = parse_args(URLS)
    assert s.pools.max_inflight == 1024 and s.pools.max_queue > 0
    assert s.max_prompt_tokens == 1_048_576
    assert PoolSettings().max_inflight == 1024 and ProxySettings(("a",), ("b",)).max_prompt_tokens == 1 << 20
    off = parse_args([*URLS, "--max-inflight", "0", "--max-prompt-tokens", "0"])
    assert off.pools.max_inflight is None and off.max_prompt_tokens == 0
    some = parse_args([*URLS, "--max-inflight", "7", "--max-prompt-tokens", "99"])
    assert some.pools.max_inflight == 7 and some.max_prompt_tokens == 99


async def test_default_inflight_limit_reaches_admission(pd_factory: PDFactory) -> None:
    pd = await pd_factory(pools=PoolSettings.plain(max_inflight=PoolSettings().max_inflight))
    assert pd.serving.pools.admission.max_inflight == 1024


def assert_prompt_refused(status: int, payload: Any, limit: int) -> None:
    assert status == 400, payload
    err = payload["error"]
    assert err["type"] == "BadRequestError" and err["param"] == "token_ids" and err["code"] == 400
    assert f"at most {limit} tokens" in err["message"]


async def test_prompt_over_the_cap_is_a_400_before_any_hop(pd_factory: PDFactory) -> None:
    pd = await pd_factory(max_prompt_tokens=8)
    status, payload, _ = await pd.gen(req(token_ids=[300 + i for i in range(9)]))
    assert_prompt_refused(status, payload, 8)
    status, _, _ = await pd.gen(req(token_ids=[300 + i for i in range(8)]))
    assert status == 200
    assert (await pd.p.state())["generate_calls"] == 1 and (await pd.d.state())["generate_calls"] == 1
    await pd.quiet()


def pretty_body(ids: list[int], pad: int, **fields: Any) -> bytes:
    """A generate body written with ``json.dumps(indent=pad)``: large for its token count."""
    return json.dumps({"sampling_params": {"temperature": 0, "max_tokens": 4}, **fields, "token_ids": ids},
                      indent=pad).encode()


LONG = {"max_model_len": 40_000, "num_kv_blocks": 10_000}


async def test_large_body_prompt_over_the_cap_is_a_400_before_any_hop(pd_factory: PDFactory) -> None:
    pd = await pd_factory(prefill=LONG, decode=LONG, max_prompt_tokens=20_000)
    raw = pretty_body([300 + i % 200 for i in range(20_001)], 60)
    assert len(raw) > LARGE_BODY_BYTES
    r = await pd.client.post("/inference/v1/generate", data=raw, headers={"Content-Type": "application/json"})
    assert_prompt_refused(r.status, await r.json(), 20_000)
    assert (await pd.p.state())["generate_calls"] == 0 and (await pd.d.state())["generate_calls"] == 0
    await pd.quiet()


async def test_large_body_runs_the_walk_with_the_clients_token_ids(pd_factory: PDFactory) -> None:
    """A body over ``LARGE_BODY_BYTES`` (parsed in slices) reaches both workers with its ids as
    sent, streamed and not, and the reply is the one a small body gets."""
    pd = await pd_factory(prefill=LONG, decode=LONG)
    ids = [3 + (i * 7) % 500 for i in range(20_000)]
    for stream in (False, True):
        raw = pretty_body(ids, 60, return_token_ids=True, request_id=f"big-{stream}", stream=stream)
        assert len(raw) > LARGE_BODY_BYTES
        r = await pd.client.post("/inference/v1/generate", data=raw,
                                 headers={"Content-Type": "application/json"})
        body = await r.read()
        assert r.status == 200, body[:300]
        if stream:
            events = sse.json_events(body, comments=True)
            assert events[0]["prompt_token_ids"] == ids
            assert sum(len(e["choices"][0]["token_ids"]) for e in events) == 4
        else:
            reply = json.loads(body)
            assert reply["prompt_token_ids"] == ids and reply["usage"]["prompt_tokens"] == len(ids)
            assert len(reply["choices"][0]["token_ids"]) == 4
            assert reply["kv_transfer_params"] is None  # D pulled P's KV: a two-hop walk
    assert (await pd.p.state())["generate_calls"] == 2 and (await pd.d.state())["generate_calls"] == 2
    await pd.quiet()


async def test_large_body_with_bad_token_ids_is_vllms_400(pd_factory: PDFactory) -> None:
    pd = await pd_factory()
    raw = pretty_body([300] * 20_000 + [-1], 60)
    r = await pd.client.post("/inference/v1/generate", data=raw, headers={"Content-Type": "application/json"})
    err = (await r.json())["error"]
    assert r.status == 400 and err["param"] == "body.token_ids" and "negative" in err["message"]
    raw = pretty_body([300] * 20_000, 60).replace(b"300", b"3x0", 1)
    r = await pd.client.post("/inference/v1/generate", data=raw, headers={"Content-Type": "application/json"})
    err = (await r.json())["error"]
    assert r.status == 400 and err["type"] == "Bad Request" and "JSON decode error" in err["message"]
    assert (await pd.p.state())["generate_calls"] == 0
    await pd.quiet()
