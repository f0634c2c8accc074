"""A generate body in UTF-16 or UTF-32 (with or without a BOM) is read as vLLM's server reads it
(``json.loads`` decodes it) and then checked exactly as the same body sent in UTF-8: client
transfer params are refused and reach no worker, a lone surrogate is the UTF-8 body's 400 (no 500,
no traceback), and a valid body reaches the workers as UTF-8."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest
from aiohttp import web

from tests.proxy.conftest import ProxyFactory
from tests.proxy.scripted import Scripted, ScriptedFactory, prefill_reply

GENERATE = "/inference/v1/generate"
JSON = {"Content-Type": "application/json"}
ENCODINGS = ["utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-32-le", "utf-32-be"]
"""Python's "utf-16" and "utf-32" write a BOM; the -le/-be ones write none."""
KV = {"remote_host": "10.9.9.9", "remote_port": 5600, "remote_engine_id": "victim",
      "remote_block_ids": [[1, 2]], "do_remote_prefill": True}
PLACES: dict[str, dict[str, Any]] = {
    "kv_transfer_params": {"kv_transfer_params": KV},
    "ec_transfer_params": {"ec_transfer_params": KV},
    "sampling_params.extra_args.kv_transfer_params":
        {"sampling_params": {"extra_args": {"kv_transfer_params": KV}}},
    "sampling_params.extra_args.ec_transfer_params":
        {"sampling_params": {"extra_args": {"ec_transfer_params": KV}}},
}


async def _workers(scripted_factory: ScriptedFactory, proxy_factory: ProxyFactory,
                   raw: list[bytes] | None = None) -> tuple[Any, Scripted, Scripted]:
    async def keep(b: dict[str, Any], r: web.Request, kv: bool) -> dict[str, Any]:
        if raw is not None:
            raw.append(await r.read())
        return prefill_reply(b) if kv else {**prefill_reply(b), "kv_transfer_params": None}

    p: Scripted = await scripted_factory(lambda b, r: keep(b, r, True))
    d: Scripted = await scripted_factory(lambda b, r: keep(b, r, False))
    client, _ = await proxy_factory([p.url], [d.url])
    return client, p, d


@pytest.mark.parametrize("encoding", ENCODINGS)
@pytest.mark.parametrize("place", list(PLACES))
@pytest.mark.parametrize("stream", [False, True])
async def test_transfer_params_in_any_encoding_are_refused_before_any_hop(
        scripted_factory: ScriptedFactory, proxy_factory: ProxyFactory,
        encoding: str, place: str, stream: bool) -> None:
    client, p, d = await _workers(scripted_factory, proxy_factory)
    body: dict[str, Any] = {"token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 2}, "stream": stream}
    extra = PLACES[place]
    if "sampling_params" in extra:
        body["sampling_params"] = {**body["sampling_params"], **extra["sampling_params"]}
    else:
        body.update(extra)
    r = await client.post(GENERATE, data=json.dumps(body).encode(encoding), headers=JSON)
    answer = await r.json()
    assert r.status == 400, answer
    assert answer == {"error": {
        "message": f"{place} is set by the proxy for each hop and cannot come from a client: "
                   "remove it from the request.",
        "type": "BadRequestError", "param": place, "code": 400}}
    assert p.received == [] and d.received == [], "a hop reached a worker"


@pytest.mark.parametrize("encoding", ["utf-8", *ENCODINGS])
@pytest.mark.parametrize("surrogate", ["raw", "escaped"])
async def test_a_lone_surrogate_in_any_encoding_is_the_utf8_bodys_400(
        scripted_factory: ScriptedFactory, proxy_factory: ProxyFactory, caplog: pytest.LogCaptureFixture,
        encoding: str, surrogate: str) -> None:
    client, p, d = await _workers(scripted_factory, proxy_factory)
    text = '{"token_ids":[5,6],"sampling_params":{"max_tokens":2},"model":"a%sb"}'
    body = (text % ("\ud800" if surrogate == "raw" else "\\ud800")).encode(encoding, "surrogatepass")
    as_utf8 = (text % ("\ud800" if surrogate == "raw" else "\\ud800")).encode("utf-8", "surrogatepass")
    with caplog.at_level(logging.INFO):
        r = await client.post(GENERATE, data=body, headers=JSON)
        answer = await r.json()
        want = await client.post(GENERATE, data=as_utf8, headers=JSON)
        assert (r.status, answer) == (want.status, await want.json())
    assert r.status == 400 and answer["error"]["code"] == 400, answer
    assert "lone surrogate" in answer["error"]["message"]
    # (the pools' background learners may warn about these test workers: not the request's doing)
    assert not [rec for rec in caplog.records
                if rec.levelno >= logging.WARNING and not rec.name.startswith("proxy.pools")], caplog.text
    assert p.received == [] and d.received == []


@pytest.mark.parametrize("encoding", ["utf-8-sig", *ENCODINGS])
async def test_a_valid_body_in_any_encoding_reaches_the_workers_as_utf8(
        scripted_factory: ScriptedFactory, proxy_factory: ProxyFactory, encoding: str) -> None:
    raw: list[bytes] = []
    client, _, d = await _workers(scripted_factory, proxy_factory, raw)
    body: dict[str, Any] = {"token_ids": [5, 6, 7], "request_id": "r-1", "model": "caf\u00e9 \U0001f600",
            "sampling_params": {"max_tokens": 2, "extra_args": {"k\u00e9y": "\u00e9\U0001f600"}}}
    r = await client.post(GENERATE, data=json.dumps(body, ensure_ascii=False).encode(encoding), headers=JSON)
    assert r.status == 200, await r.text()
    assert len(raw) == 2
    for hop in raw:  # strict UTF-8, no BOM, the client's text
        assert not hop.startswith(b"\xef\xbb\xbf")
        sent = json.loads(hop.decode("utf-8"))
        assert sent["model"] == body["model"] and sent["token_ids"] == body["token_ids"]
        assert sent["sampling_params"]["extra_args"] == body["sampling_params"]["extra_args"]
    assert d.received[0]["sampling_params"] == body["sampling_params"]


@pytest.mark.parametrize("encoding", ENCODINGS)
async def test_a_large_body_in_any_encoding_is_checked_as_utf8(
        scripted_factory: ScriptedFactory, proxy_factory: ProxyFactory, encoding: str) -> None:
    """Over 1 MiB as sent (the large-body path), transfer params are refused as in UTF-8."""
    client, p, d = await _workers(scripted_factory, proxy_factory)
    body = {"token_ids": [7] * 200_000,
            "sampling_params": {"max_tokens": 2, "extra_args": {"kv_transfer_params": KV}}}
    data = json.dumps(body).encode(encoding)
    assert len(data) > 1 << 20
    r = await client.post(GENERATE, data=data, headers=JSON)
    answer = await r.json()
    assert r.status == 400 and answer["error"]["param"] == "sampling_params.extra_args.kv_transfer_params"
    assert p.received == [] and d.received == []
