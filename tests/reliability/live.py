"""A P/D world (pd-sim workers + pd-proxy) running on its own event loop in a background thread,
for synchronous tests (hypothesis drives plain functions) that talk raw HTTP to it."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

from tests.reliability.harness import World, start_world

T = TypeVar("T")


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def dechunk(body: bytes) -> bytes:
    out = bytearray()
    i = 0
    while i < len(body):
        j = body.index(b"\r\n", i)
        size = int(body[i:j].split(b";")[0], 16)
        if size == 0:
            break
        out += body[j + 2: j + 2 + size]
        i = j + 2 + size + 2
    return bytes(out)


def raw_exchange(port: int, data: bytes, *, timeout: float = 30.0) -> Reply:
    """Send ``data`` (a whole HTTP/1.1 request, ``Connection: close``) and read the reply."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(data)
        buf = bytearray()
        while True:
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            buf += chunk
    head, _, body = bytes(buf).partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        k, _, v = line.decode("latin-1").partition(":")
        headers[k.strip().lower()] = v.strip()
    if headers.get("transfer-encoding") == "chunked":
        body = dechunk(body)
    return Reply(status, headers, body)


def request_bytes(method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None,
                  *, content_length: bool = True) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", "Connection: close"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    if content_length:
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


class Live:
    def __init__(self, **world_kwargs: Any) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="live-world")
        self.thread.start()
        self.world: World = self.run(start_world(**world_kwargs))
        self.port = int(self.world.url.rsplit(":", 1)[1])

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def exchange(self, data: bytes, timeout: float = 30.0) -> Reply:
        return raw_exchange(self.port, data, timeout=timeout)

    def request(self, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None,
                **kw: Any) -> Reply:
        return self.exchange(request_bytes(method, path, body, headers, **kw))

    def generate_calls(self) -> int:
        async def count() -> int:
            total = 0
            for sim in self.world.sims:
                total += int((await sim.state())["generate_calls"])
            return total
        return self.run(count())

    def close(self) -> None:
        try:
            self.run(self.world.close())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            self.loop.close()
