"""The per-request access line: fields present, no prompt/output content, no keys."""

from __future__ import annotations

import io
import json
import logging
from typing import Any

import pytest

from proxy.cli import parse_args
from proxy.config.logs import ACCESS_LOG, configure_access_log, log_access
from tests import sse
from tests.proxy.conftest import PDFactory, req
from tests.proxy.test_aborts import SLOW_DECODE, _disconnect_when

KEY = "sk-very-secret-key-0123456789"
PROMPT = [311, 317, 331, 337, 347, 353, 359, 367]
HOPS = ("queue_ms", "prefill_ms", "handoff_ms", "decode_ttft_ms", "total_ms")


def access_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "pd_proxy.access"]


def assert_no_content(caplog: pytest.LogCaptureFixture, outputs: list[int]) -> None:
    text = "\n".join(r.getMessage() for r in caplog.records) + caplog.text
    assert KEY not in text
    for sep in (", ", ",", " "):
        assert sep.join(map(str, PROMPT[:3])) not in text
        if len(outputs) >= 3:
            assert sep.join(map(str, outputs[:3])) not in text


@pytest.mark.parametrize("stream", [False, True])
async def test_json_access_line(pd_factory: PDFactory, caplog: pytest.LogCaptureFixture,
                                stream: bool) -> None:
    caplog.set_level(logging.INFO)
    pd = await pd_factory(api_key=KEY, upstream_api_key=KEY, log_format="json")
    auth = {"Authorization": f"Bearer {KEY}"}
    body = {**req(token_ids=PROMPT, request_id="log1", sp={"max_tokens": 6, "ignore_eos": True}),
            "stream": stream}
    r = await pd.client.post("/inference/v1/generate", json=body, headers=auth)
    assert r.status == 200
    raw = await r.read()
    outputs = sse.tokens(raw, comments=True) if stream else json.loads(raw)["choices"][0]["token_ids"]
    assert len(outputs) == 6
    lines = access_lines(caplog)
    assert len(lines) == 1
    entry: dict[str, Any] = json.loads(lines[0])
    assert entry["request_id"] == "log1"
    assert entry["prefill"] == pd.p.url and entry["decode"] == pd.d.url
    assert entry["outcome"] == "ok" and entry["status"] == 200 and entry["stream"] is stream
    for hop in HOPS:
        assert isinstance(entry[hop], float) and entry[hop] >= 0
    assert entry["total_ms"] >= entry["prefill_ms"]
    assert_no_content(caplog, outputs)


async def test_text_access_line_for_errors(pd_factory: PDFactory, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    pd = await pd_factory(prefill={"lease_seconds": 0.5})
    await pd.d.set_faults(fail_next=1, fail_status=503)
    status, _, _ = await pd.gen(req(token_ids=PROMPT, request_id="bad1"))
    assert status == 502
    status, _, _ = await pd.gen({"token_ids": PROMPT, "sampling_params": {"max_tokens": -1}},
                                headers={"X-Request-Id": "inv1"})
    assert status == 400
    lines = access_lines(caplog)
    assert len(lines) == 2
    fields = [dict(kv.split("=", 1) for kv in line.split(" ")) for line in lines]
    assert fields[0]["request_id"] == "bad1" and fields[0]["outcome"] == "upstream_error"
    assert fields[0]["status"] == "502" and fields[0]["decode"] == pd.d.url
    assert all(hop in fields[0] for hop in HOPS)
    assert fields[1]["request_id"] == "inv1" and fields[1]["outcome"] == "client_error"
    assert fields[1]["status"] == "400"
    assert_no_content(caplog, [])


async def test_disconnect_is_logged_as_aborted(pd_factory: PDFactory,
                                               caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    pd = await pd_factory(decode=SLOW_DECODE, log_format="json")
    body = {**req(token_ids=PROMPT, request_id="gone", sp={"max_tokens": 300, "ignore_eos": True}),
            "stream": True}
    await _disconnect_when(pd, "decoding", body, after_bytes=1)
    await pd.quiet(limit=2.0)
    entries = [json.loads(line) for line in access_lines(caplog)]
    assert len(entries) == 1
    assert entries[0]["request_id"] == "gone" and entries[0]["outcome"] == "aborted"
    assert entries[0]["abort"] == "disconnect"
    assert_no_content(caplog, [])


def test_cli_log_format_and_block_size() -> None:
    s = parse_args(["--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2",
                    "--log-format", "json", "--kv-block-size", "16"])
    assert s.log_format == "json" and s.kv_block_size == 16
    s = parse_args(["--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"])
    assert s.log_format == "text" and s.kv_block_size is None  # each worker's own (proxy.pools.blocks)


def test_json_lines_are_bare_json() -> None:
    out = io.StringIO()
    handler = configure_access_log("json", out)
    assert handler is not None and configure_access_log("text") is None
    ACCESS_LOG.setLevel(logging.INFO)
    try:
        log_access({"request_id": "r1", "outcome": "ok", "status": 200}, "json")
    finally:
        ACCESS_LOG.removeHandler(handler)
        ACCESS_LOG.propagate = True
        ACCESS_LOG.setLevel(logging.NOTSET)
    entry = json.loads(out.getvalue().strip())
    assert entry["request_id"] == "r1" and entry["status"] == 200 and isinstance(entry["ts"], float)
