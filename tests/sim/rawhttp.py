"""A minimal raw HTTP/1.1 client: sends exact bytes and reports the response's HTTP chunks one by one
(aiohttp's client may merge chunks, and the contract test counts them)."""

from __future__ import annotations

import asyncio
import contextlib


class RawResponse:
    def __init__(self, status: int, headers: list[tuple[str, str]], reader: asyncio.StreamReader) -> None:
        self.status = status
        self.headers = headers
        self._reader = reader
        self.chunks: list[bytes] = []
        self.done = False

    def header(self, name: str) -> str | None:
        for k, v in self.headers:
            if k.lower() == name.lower():
                return v
        return None

    @property
    def chunked(self) -> bool:
        return (self.header("transfer-encoding") or "").lower() == "chunked"

    @property
    def body(self) -> bytes:
        return b"".join(self.chunks)

    async def read_chunk(self) -> bytes | None:
        """The next HTTP chunk (or the whole content-length body once); None at the end."""
        if self.done:
            return None
        r = self._reader
        if not self.chunked:
            n = int(self.header("content-length") or "0")
            data = await r.readexactly(n) if n else b""
            self.done = True
            self.chunks.append(data)
            return data
        size_line = await r.readline()
        size = int(size_line.split(b";", 1)[0].strip(), 16)
        if size == 0:
            await r.readline()
            self.done = True
            return None
        data = await r.readexactly(size)
        await r.readexactly(2)
        self.chunks.append(data)
        return data

    async def read_events(self, count: int) -> None:
        """Read chunks until the body holds at least ``count`` SSE events."""
        while self.body.count(b"\n\n") < count:
            if await self.read_chunk() is None:
                return

    async def read_all(self) -> bytes:
        while await self.read_chunk() is not None:
            pass
        return self.body


class RawConnection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def open(cls, host: str, port: int) -> RawConnection:
        reader, writer = await asyncio.open_connection(host, port)
        return cls(reader, writer)

    async def send(self, method: str, path: str, headers: list[tuple[str, str]], body: bytes) -> None:
        lines = [f"{method} {path} HTTP/1.1"]
        for k, v in headers:
            lines.append(f"{k}: {v}")
        data = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body
        self.writer.write(data)
        await self.writer.drain()

    async def response(self) -> RawResponse:
        status_line = (await self.reader.readline()).decode("latin-1").rstrip("\r\n")
        status = int(status_line.split(" ")[1])
        headers: list[tuple[str, str]] = []
        while True:
            line = (await self.reader.readline()).decode("latin-1").rstrip("\r\n")
            if not line:
                break
            k, _, v = line.partition(":")
            headers.append((k.strip().lower(), v.strip()))
        return RawResponse(status, headers, self.reader)

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(ConnectionError, OSError):
            await self.writer.wait_closed()
