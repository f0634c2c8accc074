"""What the front (``proxy.front``) writes on a client's connection itself: a response's head as
aiohttp's ``prepare`` writes it, a full JSON answer in one write (``full_answer``), the record of
one written already (``FrontReply``) and a client's event stream (``FrontStream``). Each writes on
the connection's protocol (``front``: its transport, and its wait for a client past the
high-water mark)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

from aiohttp import hdrs, web
from aiohttp.base_protocol import BaseProtocol
from aiohttp.helpers import rfc822_formatted_time
from aiohttp.http import SERVER_SOFTWARE
from aiohttp.http_writer import _serialize_headers
from multidict import CIMultiDict


def response_head(resp: web.StreamResponse, *, close: bool) -> bytes:
    """``resp``'s status line and headers on HTTP/1.1, with what aiohttp's ``prepare`` adds:
    ``Date`` and ``Server`` unless set, ``Connection: close`` when ``close`` (through aiohttp's C
    serializer, which refuses CR and LF in a header)."""
    headers = resp.headers
    if hdrs.DATE not in headers:
        headers[hdrs.DATE] = rfc822_formatted_time()
    headers.setdefault(hdrs.SERVER, SERVER_SOFTWARE)
    if close:
        headers[hdrs.CONNECTION] = "close"
    return _serialize_headers(f"HTTP/1.1 {resp.status} {resp.reason}", headers)


def full_answer(body: bytes, headers: Mapping[str, str], *, close: bool) -> bytes:
    """A 200 JSON answer's bytes: the same head and body as ``Front._finish`` writes for a
    ``web.Response(body=body, content_type="application/json", headers=headers)`` (the headers in
    that order, then ``Content-Type``, ``Content-Length``, ``Date``, ``Server``, ``Connection:
    close`` when ``close``)."""
    head = dict(headers)
    head[hdrs.CONTENT_TYPE] = "application/json"
    head[hdrs.CONTENT_LENGTH] = str(len(body))
    head[hdrs.DATE] = rfc822_formatted_time()
    head[hdrs.SERVER] = SERVER_SOFTWARE
    if close:
        head[hdrs.CONNECTION] = "close"
    # aiohttp's serializer (C, refuses CR and LF) iterates any mapping's items
    return _serialize_headers("HTTP/1.1 200 OK", cast("CIMultiDict[str]", head)) + body


class FrontReply(web.StreamResponse):
    """A full answer ``FrontRequest.reply`` wrote already: its status for the walk's accounting;
    ending it waits for a client that has not taken it yet (past the transport's high-water mark),
    as ``Front._finish`` waits after its own write."""

    def __init__(self, front: BaseProtocol) -> None:
        super().__init__(status=200)
        self._front = front

    @property
    def prepared(self) -> bool:
        return True

    async def write_eof(self, data: bytes = b"") -> None:
        front = self._front
        if front.transport is not None and front._paused:
            await front._drain_helper()


class FrontStream(web.StreamResponse):
    """A client's event stream on the front: its head and chunks written on the connection's
    transport, framed here (one ``transport.write`` per ``write``, the head with the first one
    when ``headers_with_first_write``), not through aiohttp's ``StreamWriter``. What goes out is
    what aiohttp's ``StreamResponse`` sends for the same response: the status line, the headers
    with ``Transfer-Encoding: chunked``, ``Date``, ``Server`` and, when the request does not keep
    its connection, ``Connection: close``; each chunk's hex size and CRLFs; the last chunk with
    the stream's end. A write waits for the client when the transport's buffer is past its
    high-water mark, every 64 KiB written and at the end (as aiohttp's writer does); a write to a
    closed connection raises ``ConnectionResetError``."""

    def __init__(self, front: BaseProtocol, keep_alive: bool, headers: Mapping[str, str], *,
                 headers_with_first_write: bool) -> None:
        super().__init__(status=200, headers=headers)
        self._front = front
        self._keep = keep_alive
        self._with_first = headers_with_first_write
        self._started = False
        self._head = b""
        self._unflushed = 0

    @property
    def prepared(self) -> bool:
        return self._started

    async def prepare(self, request: Any) -> None:
        if self._started:
            return
        self._started = True
        self._headers[hdrs.TRANSFER_ENCODING] = "chunked"
        head = response_head(self, close=not self._keep)
        if self._with_first:
            self._head = head
        else:
            self._send(head)

    def _framed(self, data: bytes, *, last: bool = False, keep_head: bool = False) -> bytes:
        """``data`` as a chunk (none when empty), the last chunk after it when ``last``, the head
        before it while the head waits (taken unless ``keep_head``)."""
        out = b"%x\r\n%b\r\n" % (len(data), data) if data else b""
        if last:
            out += b"0\r\n\r\n"
        if not self._head:
            return out
        out = self._head + out
        if not keep_head:
            self._head = b""
        return out

    def _send(self, data: bytes) -> None:
        transport = self._front.transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("Cannot write to closing transport")
        transport.write(data)
        self._unflushed += len(data)

    async def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._eof_sent:
            raise RuntimeError("Cannot call write() after write_eof()")
        if not self._started:
            raise RuntimeError("Cannot call write() before prepare()")
        if not data:
            return
        self._send(self._framed(data if type(data) is bytes else bytes(data)))
        if self._unflushed > 0x10000:
            self._unflushed = 0
            await self._drain()

    def write_now(self, data: bytes) -> bool:
        """Write ``data`` (whole events) if that cannot make anyone wait: nothing is waiting in the
        transport's buffer and the framed bytes fit under its high-water mark (so writing cannot
        pause it). True when written; False leaves it to ``write``."""
        if not self._write_now(self._framed(data, keep_head=True)):
            return False  # the head (if any) still waits
        self._head = b""
        return True

    def write_framed_now(self, framed: bytes) -> bool:
        """``write_now`` for bytes already framed as chunks (a worker's chunked body, relayed as it
        came), once the head has gone out."""
        return not self._head and self._write_now(framed)

    def _write_now(self, out: bytes) -> bool:
        transport = self._front.transport
        if not self._started or self._eof_sent or transport is None or transport.is_closing() \
                or transport.get_write_buffer_size() or len(out) > transport.get_write_buffer_limits()[1]:
            return False
        transport.write(out)
        self._unflushed += len(out)
        return True

    async def write_eof(self, data: bytes = b"") -> None:
        if self._eof_sent:
            return
        assert self._started, "Response has not been started"
        self._send(self._framed(data, last=True))
        await self._drain()
        self._eof_sent = True

    async def _drain(self) -> None:
        front = self._front
        if front.transport is not None and front._paused:
            await front._drain_helper()


__all__ = ["FrontReply", "FrontStream", "full_answer", "response_head"]
