"""Test helpers for the pools: a fake clock, a TCP relay that cuts a reused connection."""

from __future__ import annotations

import asyncio
import contextlib
import re
from urllib.parse import urlsplit

_REQUEST_LINE = re.compile(rb"(?:POST|GET) \S+ HTTP/1\.1(?=\r\n)")


class FakeClock:
    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class CutRelay:
    """A TCP relay on 127.0.0.1 in front of ``target`` that, once, closes a client connection on
    the ``cut_on``-th request it carries, before forwarding a byte of it: what a client sees when
    it reuses a keep-alive connection the server has just closed (no response byte, a disconnect)."""

    def __init__(self, target: str, cut_on: int = 2) -> None:
        parts = urlsplit(target)
        assert parts.hostname is not None and parts.port is not None
        self.target = (parts.hostname, parts.port)
        self.cut_on = cut_on
        self.cuts = 0
        self.connections = 0
        self.requests: list[tuple[int, bytes]] = []
        """(connection number, request line) of every request seen, the cut one included."""
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        n = self.connections
        self.connections += 1
        up_reader, up_writer = await asyncio.open_connection(*self.target)
        back = asyncio.create_task(self._pump(up_reader, writer))
        requests = 0
        try:
            while chunk := await reader.read(65536):
                lines = _REQUEST_LINE.findall(chunk)
                self.requests += [(n, line) for line in lines]
                requests += len(lines)
                if requests >= self.cut_on and self.cuts == 0:
                    self.cuts += 1
                    break  # close both sides without a response byte
                up_writer.write(chunk)
                await up_writer.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            back.cancel()
            await asyncio.gather(back, return_exceptions=True)
            for w in (writer, up_writer):
                w.close()
            self._tasks.discard(task)

    @staticmethod
    async def _pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            while chunk := await src.read(65536):
                dst.write(chunk)
                await dst.drain()
