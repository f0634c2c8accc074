"""The least a Python two-hop P/D proxy can do per request: a yardstick, not a product.

    python benchmarks/internals/bare_proxy.py --port P --prefill URL --decode URL

One process on uvloop (asyncio if uvloop is missing), bare ``asyncio.Protocol`` on both sides and
no HTTP library: it reads a ``POST`` with a ``Content-Length`` body, ``json.loads`` it, sends the
prefill hop (``max_tokens: 1``, ``stream: false``, ``kv_transfer_params: {do_remote_decode}``) to
the one prefill worker over a kept-alive connection, reads the worker's ``kv_transfer_params`` out
of its reply, sends the decode hop with them to the one decode worker, and relays the decode
worker's reply: the body of a ``Content-Length`` reply in one write, a chunked one chunk by chunk
as it arrives. One task per request, no validation, no error handling worth the name, no metrics,
no logs, no timeouts, no retries, no aborts, no KV settling: everything pd-proxy does beyond the
two hops is left out. vllm-router in front of the same workers does about as much.

``benchmarks/compare_routers.py --router-cmd`` runs it in the router's slot, so its CPU per
request sits beside pd-proxy's and vllm-router's in one run (benchmarks/README.md gives the
command): what the Python interpreter costs per request before any feature.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections import deque
from typing import Any, cast
from urllib.parse import urlsplit

_END = b"\r\n\r\n"


class _Upstream(asyncio.Protocol):
    """One kept-alive connection to a worker; one request at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.head_done = False
        self.length = -1
        self.chunked = False
        self.done: asyncio.Future[bytes] | None = None
        self.sink: Any = None  # callable(bytes) for a relayed chunked body

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def begin(self, request: bytes, sink: Any = None) -> asyncio.Future[bytes]:
        assert self.transport is not None
        self.buf.clear()
        self.head_done = False
        self.length = -1
        self.chunked = False
        self.sink = sink
        self.done = asyncio.get_running_loop().create_future()
        self.transport.write(request)
        return self.done

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if not self.head_done:
            end = self.buf.find(_END)
            if end < 0:
                return
            head = bytes(self.buf[:end]).lower()
            del self.buf[: end + 4]
            self.head_done = True
            self.length = content_length(head)
            self.chunked = self.length < 0
        if self.chunked:
            if self.sink is not None and self.buf:
                self.sink(bytes(self.buf))
                finished = self.buf.endswith(b"0\r\n\r\n")
                self.buf.clear()
                if finished and self.done is not None:
                    self.done.set_result(b"")
            elif self.buf.endswith(b"0\r\n\r\n") and self.done is not None:
                self.done.set_result(_dechunk(bytes(self.buf)))
        elif len(self.buf) >= self.length and self.done is not None:
            self.done.set_result(bytes(self.buf[: self.length]))


def content_length(head: bytes) -> int:
    """The ``Content-Length`` of a lower-cased head, -1 when it has none."""
    at = head.find(b"content-length:")
    if at < 0:
        return -1
    stop = head.find(b"\r\n", at)
    return int(head[at + 15: stop if stop > 0 else None])


def _dechunk(raw: bytes) -> bytes:
    out = bytearray()
    at = 0
    while True:
        eol = raw.index(b"\r\n", at)
        size = int(raw[at:eol], 16)
        if size == 0:
            return bytes(out)
        out += raw[eol + 2: eol + 2 + size]
        at = eol + 4 + size


class _Pool:
    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 80
        self.idle: deque[_Upstream] = deque()

    async def get(self) -> _Upstream:
        if self.idle:
            return self.idle.pop()
        loop = asyncio.get_running_loop()
        _, proto = await loop.create_connection(_Upstream, self.host, self.port)
        return proto

    def put(self, conn: _Upstream) -> None:
        self.idle.append(conn)


def _post(host: str, body: bytes) -> bytes:
    return (b"POST /inference/v1/generate HTTP/1.1\r\nHost: " + host.encode()
            + b"\r\nContent-Type: application/json\r\nContent-Length: " + str(len(body)).encode()
            + b"\r\n\r\n" + body)


class _Client(asyncio.Protocol):
    def __init__(self, prefill: _Pool, decode: _Pool) -> None:
        self.prefill = prefill
        self.decode = decode
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        end = self.buf.find(_END)
        if end < 0:
            return
        length = max(content_length(bytes(self.buf[:end]).lower()), 0)
        if len(self.buf) < end + 4 + length:
            return
        body = bytes(self.buf[end + 4: end + 4 + length])
        del self.buf[: end + 4 + length]
        asyncio.get_running_loop().create_task(self.serve(body))

    async def serve(self, raw: bytes) -> None:
        assert self.transport is not None
        req = json.loads(raw)
        stream = bool(req.get("stream"))
        pre = dict(req)
        pre["sampling_params"] = {**req.get("sampling_params", {}), "max_tokens": 1}
        pre["stream"] = False
        pre["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False,
                                     "remote_engine_id": None, "remote_block_ids": None,
                                     "remote_host": None, "remote_port": None}
        conn = await self.prefill.get()
        reply = json.loads(await conn.begin(_post(self.prefill.host, json.dumps(pre).encode())))
        self.prefill.put(conn)
        dec = dict(req)
        dec["kv_transfer_params"] = reply.get("kv_transfer_params")
        conn = await self.decode.get()
        transport = self.transport
        if stream:
            transport.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                            b"Transfer-Encoding: chunked\r\n\r\n")
            await conn.begin(_post(self.decode.host, json.dumps(dec).encode()), transport.write)
        else:
            body = await conn.begin(_post(self.decode.host, json.dumps(dec).encode()))
            transport.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                            + str(len(body)).encode() + b"\r\n\r\n" + body)
        self.decode.put(conn)


async def start(port: int, prefill: str, decode: str) -> asyncio.Server:
    """Serve on 127.0.0.1:``port`` (0: any free port) in front of one prefill and one decode worker."""
    p, d = _Pool(prefill), _Pool(decode)
    return await asyncio.get_running_loop().create_server(lambda: _Client(p, d), "127.0.0.1", port)


async def _main(port: int, prefill: str, decode: str) -> None:
    server = await start(port, prefill, decode)
    print(f"bare proxy on http://127.0.0.1:{port}", flush=True)
    async with server:
        await server.serve_forever()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--prefill", required=True)
    ap.add_argument("--decode", required=True)
    a, _ = ap.parse_known_args()
    try:
        import uvloop  # noqa: PLC0415
        uvloop.run(_main(a.port, a.prefill, a.decode))
    except ImportError:
        asyncio.run(_main(a.port, a.prefill, a.decode))


if __name__ == "__main__":
    main()
