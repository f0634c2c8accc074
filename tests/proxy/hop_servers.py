"""Scripted HTTP/1.1 servers on loopback for the hop client's tests (``test_hop``,
``test_hop_wire``, ``test_upstream_hop``): a TCP server whose handler writes raw bytes, and a
``HopClient`` in front of it."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable

from proxy.upstream.hop import HopClient

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]


class Server:
    """A TCP server on 127.0.0.1 whose handler gets each connection's number (0, 1, ...)."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.closed_by_client: list[int] = []
        self.requests: list[bytes] = []
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        n = self.connections
        self.connections += 1
        try:
            await self.handler(reader, writer, n)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def request(self, reader: asyncio.StreamReader) -> bytes:
        """One request (head + Content-Length body); b"" when the client closed."""
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            return b""
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        body = await reader.readexactly(length)
        self.requests.append(head + body)
        return head + body

    async def start(self, *, rcvbuf: int | None = None, limit: int = 1 << 16) -> str:
        """``rcvbuf``: a small fixed receive buffer for the accepted sockets (no autotuning), so
        that a handler that stops reading soon fills the client's send path."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if rcvbuf is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.bind(("127.0.0.1", 0))
        self._server = await asyncio.start_server(self._handle, sock=sock, limit=limit)
        return f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def close(self) -> None:
        assert self._server is not None
        self._server.close()
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._server.wait_closed()


@contextlib.asynccontextmanager
async def serving(handler: Handler, *, rcvbuf: int | None = None, limit: int = 1 << 16, max_per_host: int = 0,
                  **client_kw: float) -> AsyncIterator[tuple[Server, str, HopClient]]:
    server = Server(handler)
    url = await server.start(rcvbuf=rcvbuf, limit=limit)
    client = HopClient(connect_timeout=client_kw.get("connect_timeout", 5.0),
                       keepalive=client_kw.get("keepalive", 4.0),
                       write_timeout=client_kw.get("write_timeout"), max_per_host=max_per_host)
    try:
        yield server, url, client
    finally:
        await client.close()
        await server.close()


async def until(check: Callable[[], bool]) -> None:
    """Wait (bounded: 2 s) for a state; the assertion after it says what was expected."""
    for _ in range(200):
        if check():
            return
        await asyncio.sleep(0.01)


def ok(body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Length: " + str(len(body)).encode() + b"\r\n" + extra + b"\r\n" + body


def chunked(*parts: bytes) -> bytes:
    out = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Type: text/event-stream\r\n\r\n"
    for p in parts:
        out += f"{len(p):x}\r\n".encode() + p + b"\r\n"
    return out + b"0\r\n\r\n"


async def post(client: HopClient, url: str, body: bytes = b"{}", *, deadline: float | None = None,
               read_limit: float | None = 5.0) -> tuple[int, bytes]:
    if deadline is None:
        deadline = asyncio.get_running_loop().time() + 10
    resp = await client.request(url, "/inference/v1/generate", b"Content-Type: application/json\r\n", body,
                                deadline=deadline, read_limit=read_limit)
    try:
        return resp.status, await resp.read()
    finally:
        resp.close()


BIG_BODY = 16 << 20
"""A request body larger than what the kernel buffers on both sides (4 MiB of send buffer at most
here, and the scripted server's receive buffer fixed small)."""


async def head_only(r: asyncio.StreamReader) -> int:
    """Reads a request's head; its Content-Length."""
    head = await r.readuntil(b"\r\n\r\n")
    return next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length:"))

