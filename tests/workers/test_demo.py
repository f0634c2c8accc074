"""The demo's manual hand-off helpers against a recording stub server (the real run is in tests/e2e)."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from workers.demo import HandoffError, decode_body, manual_handoff, prefill_body

PARAMS = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[1]], "remote_port": 5}


def test_prefill_body_follows_the_spec_and_leaves_the_request_alone() -> None:
    body = {
        "token_ids": [5, 6],
        "sampling_params": {"temperature": 0, "max_tokens": 9, "min_tokens": 3},
        "stream": True,
        "stream_options": {"include_usage": True},
        "output_mode": "text",
        "cache_salt": "s",
    }
    assert prefill_body(body, "r1") == {
        "token_ids": [5, 6],
        "sampling_params": {"temperature": 0, "max_tokens": 1},
        "stream": False,
        "output_mode": "tokens",
        "cache_salt": "s",
        "request_id": "r1",
        "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False},
    }
    assert body["sampling_params"] == {"temperature": 0, "max_tokens": 9, "min_tokens": 3}
    assert "kv_transfer_params" not in body


def test_decode_body_is_the_original_request_with_the_params() -> None:
    body = {"token_ids": [5], "sampling_params": {"max_tokens": 9, "min_tokens": 3}, "output_mode": "text"}
    hop = decode_body(body, "r1", PARAMS)
    assert hop == {**body, "request_id": "r1", "kv_transfer_params": PARAMS}


async def _stub(prefill_reply: dict[str, Any], prefill_status: int = 200) -> tuple[TestServer, list[Any]]:
    seen: list[Any] = []

    async def generate(request: web.Request) -> web.Response:
        body = await request.json()
        seen.append(body)
        if body["kv_transfer_params"].get("do_remote_decode"):
            return web.json_response(prefill_reply, status=prefill_status)
        return web.json_response({"choices": [{"token_ids": [7, 8]}], "kv_transfer_params": None})

    app = web.Application()
    app.router.add_post("/inference/v1/generate", generate)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    return server, seen


async def test_manual_handoff_carries_the_params_unchanged_with_one_request_id() -> None:
    server, seen = await _stub({"kv_transfer_params": PARAMS, "choices": [{"token_ids": [1]}]})
    url = str(server.make_url("")).rstrip("/")
    body = {"token_ids": [3, 4], "sampling_params": {"max_tokens": 2}}
    try:
        async with aiohttp.ClientSession() as session:
            handoff = await manual_handoff(session, url, url, body, "rid")
    finally:
        await server.close()
    assert handoff.token_ids == [7, 8]
    assert handoff.kv_transfer_params == PARAMS
    assert [b["request_id"] for b in seen] == ["rid", "rid"]
    assert seen[1]["kv_transfer_params"] == PARAMS
    assert seen[1]["sampling_params"] == {"max_tokens": 2}


@pytest.mark.parametrize(
    ("reply", "status", "match"),
    [
        ({"kv_transfer_params": None}, 200, "no kv_transfer_params"),
        ({"error": {"message": "bad"}}, 400, "answered 400"),
    ],
)
async def test_manual_handoff_stops_after_a_bad_prefill(
    reply: dict[str, Any], status: int, match: str
) -> None:
    server, seen = await _stub(reply, status)
    url = str(server.make_url("")).rstrip("/")
    try:
        async with aiohttp.ClientSession() as session:
            with pytest.raises(HandoffError, match=match):
                await manual_handoff(session, url, url, {"token_ids": [3], "sampling_params": {}}, "rid")
    finally:
        await server.close()
    assert len(seen) == 1  # no decode hop


async def test_manual_handoff_refuses_streaming_requests() -> None:
    async with aiohttp.ClientSession() as session:
        with pytest.raises(ValueError, match="stream false"):
            await manual_handoff(session, "http://127.0.0.1:1", "http://127.0.0.1:1", {"stream": True}, "r")
