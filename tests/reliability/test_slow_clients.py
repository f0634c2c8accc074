"""Slow clients: one that sends its request head byte by byte, and one that never reads its
stream. Neither holds anything for long, and neither slows other clients (they complete; no
timing is asserted)."""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Any

import pytest

from tests.reliability.harness import GENERATE, World, sse_events, start_world

pytestmark = pytest.mark.timeout(60)

PROMPT = [3 + (5 * i) % 500 for i in range(40)]
FAST_DECODE: dict[str, Any] = {"zero_latency": False, "itl_ms": 0.2, "prefill_base_ms": 0.0,
                               "prefill_per_token_ms": 0.0, "transfer_per_block_ms": 0.0,
                               "max_model_len": 20000}


def body(max_tokens: int, stream: bool = True) -> dict[str, Any]:
    return {"token_ids": PROMPT, "stream": stream,
            "sampling_params": {"temperature": 0, "max_tokens": max_tokens, "ignore_eos": True}}


def small_sndbuf_socket() -> socket.socket:
    """A listening socket whose accepted connections inherit a small send buffer, so that a
    client that does not read backs up into the proxy quickly instead of into the kernel."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8192)
    s.bind(("127.0.0.1", 0))
    return s


async def others_complete(w: World, n: int = 5) -> None:
    """Well-formed clients get whole answers (the slow client does not stop them)."""
    for stream in (False, True):
        for _ in range(n):
            async with w.session.post(w.url + GENERATE, json=body(8, stream)) as r:
                raw = await r.read()
                assert r.status == 200, raw[:200]
                if stream:
                    events = sse_events(raw)
                    assert events[-1] == "[DONE]"
                    assert events[-2]["choices"][0]["finish_reason"] == "length"
                else:
                    assert json.loads(raw)["choices"][0]["finish_reason"] == "length"


async def test_head_sent_byte_by_byte_is_cut_off_and_others_are_served() -> None:
    w = await start_world(server_kwargs={"keepalive_timeout": 0.5})
    try:
        port = int(w.url.rsplit(":", 1)[1])
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        head = (f"POST {GENERATE} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                "X-Padding: " + "a" * 200 + "\r\n").encode()

        async def trickle() -> None:
            for i in range(len(head)):
                writer.write(head[i:i + 1])
                await writer.drain()
                await asyncio.sleep(0.02)

        sender = asyncio.get_running_loop().create_task(trickle())
        await others_complete(w)
        # The server closes the connection before the head is complete (bounded wait).
        try:
            data = await asyncio.wait_for(reader.read(), 10)
        except ConnectionResetError:
            data = b""  # closed with our unread bytes pending: a reset
        assert data == b""
        assert not sender.done() or sender.exception() is not None
        sender.cancel()
        await asyncio.gather(sender, return_exceptions=True)
        writer.close()
        await w.wait_clean()
    finally:
        await w.close()
    await w.assert_no_tasks_after_close()


async def test_client_that_never_reads_is_cut_off_and_frees_everything() -> None:
    sock = small_sndbuf_socket()
    w = await start_world(decode=[FAST_DECODE], prefill=[{"max_model_len": 20000}],
                          slow_reader_max_bytes=20_000, slow_reader_timeout=1.0, server_kwargs={"sock": sock})
    try:
        port = int(w.url.rsplit(":", 1)[1])
        client = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client.setblocking(False)
        loop = asyncio.get_running_loop()
        await loop.sock_connect(client, ("127.0.0.1", port))
        payload = json.dumps(body(15_000)).encode()
        await loop.sock_sendall(client, (
            f"POST {GENERATE} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n").encode() + payload)
        # ...and never reads. Others are served meanwhile.
        await others_complete(w)
        # The proxy ends that stream (it cannot deliver its reason to a client that reads
        # nothing): the request leaves the table, the decode worker's request ends, KV is freed.
        await w.wait_clean(limit=15.0)
        metrics = await (await w.session.get(w.url + "/metrics")).text()
        assert 'pd_proxy_aborts_total{source="disconnect",state="decoding"} 1.0' in metrics
        client.close()
    finally:
        await w.close()
    await w.assert_no_tasks_after_close()
