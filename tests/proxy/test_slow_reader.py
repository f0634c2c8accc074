"""A client that reads slowly: merged chunks, exact concatenation, and the byte cap."""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Any

from proxy.cli import parse_args
from tests.fixtures_sim import SimFactory
from tests.proxy.conftest import PDFactory, req, sse_datas

BIG = {"max_model_len": 8192}


def small_sndbuf_socket(host: str, port: int, family: socket.AddressFamily) -> socket.socket:
    """The proxy's listening socket with a small, fixed send buffer (inherited by accepted
    connections), so that a lagging client backs up into the proxy instead of the kernel."""
    s = socket.socket(family, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8192)
    s.bind((host, port))
    return s


SMALL = {"socket_factory": small_sndbuf_socket}


def dechunk(body: bytes) -> bytes:
    out = bytearray()
    i = 0
    while True:
        j = body.index(b"\r\n", i)
        size = int(body[i:j].split(b";")[0], 16)
        if size == 0:
            return bytes(out)
        out += body[j + 2 : j + 2 + size]
        i = j + 2 + size + 2


async def slow_stream(host: str, port: int, body: dict[str, Any], pause: float) -> bytes:
    """POST a stream with a tiny receive buffer, stop reading for ``pause`` s, then read it all."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    await loop.sock_connect(sock, (host, port))
    reader, writer = await asyncio.open_connection(sock=sock, limit=4096)
    payload = json.dumps({**body, "stream": True}).encode()
    head_lines = (b"POST /inference/v1/generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Connection: close\r\nContent-Length: " + str(len(payload)).encode() + b"\r\n\r\n")
    writer.write(head_lines + payload)
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert b" 200 " in head.split(b"\r\n")[0]
    await asyncio.sleep(pause)
    rest = await asyncio.wait_for(reader.read(), 60)
    writer.close()
    return dechunk(rest)


async def test_slow_reader_gets_merged_chunks_with_exact_concatenation(
        pd_factory: PDFactory, sim_factory: SimFactory) -> None:
    pd = await pd_factory(prefill=BIG, decode=BIG, server_kwargs=SMALL)
    body = req(request_id="slow", sp={"max_tokens": 4000, "ignore_eos": True})
    assert pd.client.port is not None
    raw = await slow_stream(pd.client.host, pd.client.port, body, pause=1.0)
    events = sse_datas(raw)
    agg = await sim_factory(role="aggregated", zero_latency=True, **BIG)
    r = await agg.session.post(agg.url + "/inference/v1/generate", json={**body, "stream": True})
    want = sse_datas(await r.read())
    got_tokens = [t for e in events[:-1] for t in e["choices"][0]["token_ids"]]
    want_tokens = [t for e in want[:-1] for t in e["choices"][0]["token_ids"]]
    assert got_tokens == want_tokens and len(got_tokens) == 4000
    assert events[-1] == "[DONE]"
    assert [e["choices"][0]["finish_reason"] for e in events[:-1]][-1] == "length"
    assert len(events) < len(want), "a lagging client should have received merged chunks"
    await pd.quiet(limit=2.0)


async def test_byte_cap_ends_the_stream_with_a_clear_reason(pd_factory: PDFactory) -> None:
    pd = await pd_factory(prefill=BIG, decode={**BIG, "zero_latency": False, "itl_ms": 0.2,
                                                "prefill_base_ms": 0.0, "prefill_per_token_ms": 0.0},
                          slow_reader_max_bytes=5_000, server_kwargs=SMALL)
    body = req(request_id="cap", sp={"max_tokens": 8000, "ignore_eos": True})
    assert pd.client.port is not None
    raw = await slow_stream(pd.client.host, pd.client.port, body, pause=1.0)
    events = sse_datas(raw)
    assert events[-1] == "[DONE]"
    assert "read too slowly" in events[-2]["error"]["message"]
    tokens = [t for e in events[:-2] for t in e["choices"][0]["token_ids"]]
    assert 0 < len(tokens) < 8000
    await pd.quiet(limit=2.0)


FAST_DECODE = {**BIG, "zero_latency": False, "itl_ms": 0.2, "prefill_base_ms": 0.0,
               "prefill_per_token_ms": 0.0}


async def test_process_budget_ends_slow_streams_and_frees_everything(pd_factory: PDFactory) -> None:
    """Two clients that stop reading share the process's budget (each far under its own cap):
    past the budget the stream holding the most is ended with a clear reason (its decode worker
    aborted), a client that reads is served meanwhile, and nothing stays held."""
    pd = await pd_factory(prefill=BIG, decode=FAST_DECODE, slow_reader_max_bytes=10_000_000,
                          slow_reader_total_bytes=40_000, server_kwargs=SMALL)
    assert pd.client.port is not None
    long = {"max_tokens": 8000, "ignore_eos": True}
    slow = [asyncio.ensure_future(slow_stream(pd.client.host, pd.client.port,
                                              req(request_id=f"slow{i}", sp=long), pause=1.5))
            for i in range(2)]
    status, events, _ = await pd.stream(req(request_id="reads", sp={"max_tokens": 40, "ignore_eos": True}))
    assert status == 200 and events[-1] == "[DONE]"
    assert sum(len(e["choices"][0]["token_ids"]) for e in events[:-1]) == 40
    ended = 0
    for raw in await asyncio.gather(*slow):
        got = sse_datas(raw)
        assert got[-1] == "[DONE]"
        tokens = [t for e in got[:-1] if "choices" in e for t in e["choices"][0]["token_ids"]]
        if "error" in got[-2]:
            assert "buffers for slow clients are full" in got[-2]["error"]["message"]
            assert len(tokens) < 8000
            ended += 1
        else:
            assert len(tokens) == 8000
    assert ended >= 1
    metrics = (await (await pd.client.get("/metrics")).text()).splitlines()
    assert f'pd_proxy_slow_reader_ended_total{{limit="total"}} {float(ended)}' in metrics
    await pd.quiet(limit=5.0)
    assert pd.serving.stream_budget.used == 0 and len(pd.serving.stream_budget) == 0
    assert "pd_proxy_slow_reader_buffered_bytes 0.0" in (await (await pd.client.get("/metrics")).text())


def test_default_bounds_for_slow_readers() -> None:
    s = parse_args(["--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"])
    assert s.slow_reader_max_bytes == 1 << 20 and s.slow_reader_total_bytes == 256 << 20
    s = parse_args(["--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2",
                    "--slow-reader-max-bytes", "5000", "--slow-reader-total-bytes", "0"])
    assert s.slow_reader_max_bytes == 5000 and s.slow_reader_total_bytes == 0
