"""The HTTP/1.1 client of the generate hops: one keep-alive pool per process, lean per call.

Every generate call the proxy makes (the prefill hop, the decode hop, stream or not) goes through
``HopClient``; the low-volume control calls (aborts, health probes, metrics scrapes) stay on
aiohttp's ``ClientSession``. Why not aiohttp here too: ``python -m benchmarks.internals.hop_cost`` measured
its client at about 150 µs of CPU per sequential hop against about 55 µs for a bare HTTP/1.1
exchange with the same JSON work, and every request makes two hops: on a warm run that was a
third of the proxy's CPU per request. The hops need little of a general client: one method, one
content type, no cookies, redirects, proxies, compression or multipart. What they do need is here:

* a keep-alive pool per worker (``scheme://host:port``), idle connections dropped after
  ``keepalive`` seconds (under vLLM's 5 s) and at the first sign the worker closed them; a
  pooled socket is polled just before reuse (readable means EOF, a reset or stray bytes: closed,
  never written to). A POST is never sent twice here: a reused connection that ends with no
  answer byte once the request went out raises ``HopStale`` (the worker most likely closed it
  idle, but it may have read the request; ``Upstream`` sends it again only after aborting it);
* at most ``max_per_host`` connections open per worker (connecting, in use, idle); a hop beyond
  waits for one to come back or close, at most the connect timeout;
* a connect timeout, a deadline for the whole exchange, a limit on each wait for bytes and one on
  each wait for the worker to take request bytes (``write_timeout``, no progress);
* answers framed by ``Content-Length``, chunked encoding or the connection's end, the body read
  whole or as it arrives, with back-pressure (reading pauses while 1 MiB waits unread). Framing
  is strict: a Content-Length is 1 to 18 ASCII digits (one value), a chunk size 1 to 16 hex
  digits (extensions ignored), nothing else; anything malformed is a ``HopProtocolError`` and
  closes the connection. An answer with both Transfer-Encoding and Content-Length is read as
  chunked and its connection closed after it (RFC 9112 6.3);
* TLS through the standard library (``ssl=`` context; ``https://`` workers);
* a connection whose answer was not read to its end is closed, never reused: closing it is what
  tells vLLM the caller left.

Errors are the standard ones (``OSError``, ``TimeoutError``, ``HopProtocolError``); ``Upstream``
turns them into the proxy's error tree.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import re
import select
import ssl
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast
from urllib.parse import urlsplit

_MAX_HEAD = 64 * 1024
"""Largest status line + headers accepted from a worker."""
_READ_PAUSE = 1 << 20
"""Body bytes buffered unread before the socket stops being read."""
LINGER = 1.0
"""How long a released answer's connection waits for the end of its framing."""
_MAX_ORIGINS = 4096
"""Cached URL parses (workers come and go through the admin API; the cache is bounded)."""

_MAX_LENGTH_DIGITS = 18
"""Longest Content-Length accepted (just under 1 EB; plain ASCII digits, nothing else)."""
_MAX_CHUNK_DIGITS = 16
"""Longest chunk size accepted (hex digits, nothing else)."""
_HEX_SIZE = re.compile(rb"[0-9A-Fa-f]{1,%d}" % _MAX_CHUNK_DIGITS)
_FRAMING = ("content-length", "transfer-encoding")

_HEAD, _LENGTH, _CHUNK_SIZE, _CHUNK_DATA, _CHUNK_END, _TRAILER, _UNTIL_CLOSE, _DONE = range(8)


class HopProtocolError(Exception):
    """The worker broke HTTP/1.1 framing (or closed mid-answer: ``HopDisconnected``)."""


class HopDisconnected(HopProtocolError, ConnectionError):
    """The connection ended before the answer did."""


class HopStale(HopDisconnected):
    """A kept-alive connection ended before any byte of the answer, after (some of) the request
    was written to it. Most likely the worker had closed it idle and never read the request, but
    it may have read it: the client does not send it again by itself (``Upstream`` does, once the
    worker aborted any copy it read)."""


@dataclass(frozen=True, slots=True)
class Origin:
    key: str
    host: str
    port: int
    tls: bool
    host_header: bytes
    base_path: str


def parse_origin(url: str) -> Origin:
    """``ValueError`` naming the URL when it has no host or a port out of range."""
    try:
        parts = urlsplit(url)
        port_given = parts.port
    except ValueError:
        raise ValueError(f"worker URL has an invalid port: {url!r}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"worker URL must be http(s)://host[:port], got {url!r}")
    tls = parts.scheme == "https"
    port = port_given or (443 if tls else 80)
    host = parts.hostname
    shown = f"[{host}]" if ":" in host else host
    default = port == (443 if tls else 80)
    return Origin(key=f"{parts.scheme}://{shown}:{port}", host=host, port=port, tls=tls,
                  host_header=(shown if default else f"{shown}:{port}").encode("idna"),
                  base_path=parts.path.rstrip("/"))



def _status_line(line: bytes) -> tuple[int, bytes]:
    """The status and the HTTP version of an answer's first line (strict: ``HTTP/1.x`` and a
    3-digit status in 100-599)."""
    parts = line.split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1."):
        raise HopProtocolError("an answer that is not HTTP/1.x")
    code = parts[1]
    if len(code) != 3 or not code.isdigit():  # bytes.isdigit: ASCII digits only
        raise HopProtocolError("a malformed status line")
    status = int(code)
    if not 100 <= status <= 599:
        raise HopProtocolError("a malformed status line")
    return status, parts[0]


def _header_lines(lines: list[bytes]) -> dict[str, str]:
    """An answer's headers, names lower-cased; a framing header twice (but the same
    Content-Length) is an error: where the answer ends would not be known (RFC 9112 6.3)."""
    headers: dict[str, str] = {}
    for raw in lines:
        name, sep, value = raw.partition(b":")
        if not sep or not name or name != name.strip():
            raise HopProtocolError("a malformed header line")
        key = name.decode("latin-1").lower()
        text = value.strip().decode("latin-1")
        if key in headers and key in _FRAMING and (key != "content-length" or headers[key] != text):
            raise HopProtocolError(f"a repeated {key} header")
        headers[key] = text
    return headers

class _Conn(asyncio.Protocol):
    """One connection: writes requests, parses one answer at a time into a body queue."""

    def __init__(self, loop: asyncio.AbstractEventLoop, origin: Origin) -> None:
        self.loop = loop
        self.origin = origin
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.uses = 0
        self.counted = False
        """Counted against the client's per-worker cap (until ``HopClient._drop``)."""
        self.idle_since = 0.0
        self._pending = b""
        self._state = _DONE
        self._remaining = 0
        self._keep_alive = True
        self.got_bytes = False
        self.head: tuple[int, dict[str, str]] | None = None
        self._body: deque[bytes] = deque()
        self._buffered = 0
        self._reading_paused = False
        self._exc: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._drain: asyncio.Future[None] | None = None
        self._write_paused = False
        self.on_done: Callable[[], None] | None = None
        """Set while lingering (``HopResponse.release``): called when the answer ends."""
        self._poll: select.poll | None = None

    # -- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses
        sock = transport.get_extra_info("socket")
        if sock is not None:
            self._poll = select.poll()
            self._poll.register(sock.fileno(), select.POLLIN)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._state == _UNTIL_CLOSE:
            self._state = _DONE
        elif self._state != _DONE and self._exc is None:
            self._exc = HopDisconnected("the worker closed the connection before its answer ended"
                                        if self.got_bytes else "the worker closed the connection")
        self._wake()
        if self.on_done is not None:
            done, self.on_done = self.on_done, None
            done()
        if self._drain is not None and not self._drain.done():
            self._drain.set_exception(ConnectionResetError("connection lost while sending"))

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)
        self._drain = None

    def eof_received(self) -> bool:
        return False  # close the transport; connection_lost settles the answer

    def data_received(self, data: bytes) -> None:
        if not data:
            return
        self.got_bytes = True
        if self._state == _DONE:
            self._keep_alive = False  # bytes nobody asked for: never reuse this connection
            return
        try:
            self._feed(data)
        except HopProtocolError as e:
            self._fail(e)
        if self.on_done is not None:  # lingering: the caller has what it wanted of the body
            self._body.clear()
            self._buffered = 0
            if self._state == _DONE or self._exc is not None:
                done, self.on_done = self.on_done, None
                done()
            return
        self._wake()

    # -- parsing

    def _feed(self, data: bytes) -> None:  # noqa: C901, PLR0912
        # One frame on purpose: the per-read state machine of every hop; a call per chunk line
        # would add a Python call per SSE event on the streaming path.
        if self._pending:
            data, self._pending = self._pending + data, b""
        pos, end = 0, len(data)
        while pos < end:
            state = self._state
            if state in (_LENGTH, _CHUNK_DATA, _UNTIL_CLOSE):
                take = end - pos if state == _UNTIL_CLOSE else min(self._remaining, end - pos)
                self._push(data if pos == 0 and take == end else data[pos:pos + take])
                pos += take
                if state != _UNTIL_CLOSE:
                    self._remaining -= take
                    if self._remaining == 0:
                        self._state = _DONE if state == _LENGTH else _CHUNK_END
            elif state in (_CHUNK_SIZE, _CHUNK_END, _TRAILER):
                nl = data.find(b"\r\n", pos)
                if nl < 0:
                    if end - pos > 4096:
                        raise HopProtocolError("a chunk header longer than 4 KiB")
                    self._pending = data[pos:]
                    return
                line = data[pos:nl]
                pos = nl + 2
                if state == _CHUNK_END:
                    if line:
                        raise HopProtocolError("chunk data longer than its declared size")
                    self._state = _CHUNK_SIZE
                elif state == _TRAILER:
                    if not line:
                        self._state = _DONE
                else:
                    size = _chunk_size(line)
                    if size == 0:
                        self._state = _TRAILER
                    elif data[pos + size:pos + size + 2] == b"\r\n":
                        # The whole chunk and its CRLF are here (an SSE event usually is).
                        self._push(data[pos:pos + size])
                        pos += size + 2
                    else:
                        self._state, self._remaining = _CHUNK_DATA, size
            elif state == _HEAD:
                mark = data.find(b"\r\n\r\n", pos)
                if mark < 0:
                    if end - pos > _MAX_HEAD:
                        raise HopProtocolError("headers larger than 64 KiB")
                    self._pending = data[pos:]
                    return
                head = data[pos:mark]
                pos = mark + 4
                self._parse_head(head)
            else:  # _DONE: bytes past the answer
                self._keep_alive = False
                return

    def _parse_head(self, head: bytes) -> None:
        lines = head.split(b"\r\n")
        status, version = _status_line(lines[0])
        if 100 <= status < 200:
            return  # an interim answer (100 Continue): the real one follows
        headers = _header_lines(lines[1:])
        if version == b"HTTP/1.0" or "close" in headers.get("connection", "").lower():
            self._keep_alive = False
        encoding = headers.get("transfer-encoding")
        length = headers.get("content-length")
        if status in (204, 304):
            self._state = _DONE
        elif encoding is not None:
            if encoding.lower() != "chunked":
                raise HopProtocolError(f"an unsupported transfer encoding ({encoding})")
            self._state = _CHUNK_SIZE
            if length is not None:
                # Both: chunked wins (RFC 9112 6.3), and the connection is not reused after it
                # (the two framings may have been read differently on the way).
                self._keep_alive = False
        elif length is not None:
            if not (len(length) <= _MAX_LENGTH_DIGITS and length.isascii() and length.isdigit()):
                raise HopProtocolError("a malformed Content-Length")
            self._remaining = int(length)
            self._state = _LENGTH if self._remaining else _DONE
        else:
            self._state, self._keep_alive = _UNTIL_CLOSE, False
        self.head = (status, headers)

    def _push(self, chunk: bytes) -> None:
        self._body.append(chunk)
        self._buffered += len(chunk)
        if self._buffered > _READ_PAUSE and not self._reading_paused and self.transport is not None:
            self._reading_paused = True
            self.transport.pause_reading()

    def _fail(self, exc: BaseException) -> None:
        if self._exc is None:
            self._exc = exc
        self._keep_alive = False
        if self.transport is not None:
            self.transport.close()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- used by HopClient / HopResponse

    @property
    def reusable(self) -> bool:
        return (self._state == _DONE and self._keep_alive and self._exc is None and not self.closed
                and not self._body and self.transport is not None and not self.transport.is_closing())

    def stale(self) -> bool:
        """An idle connection's socket is readable: the worker closed it (EOF, reset) or sent
        bytes nobody asked for, and the loop has not run the callbacks that would say so yet.
        Asked of the kernel (one ``poll``), so it holds at the moment a request would be written."""
        return self._poll is not None and bool(self._poll.poll(0))

    def begin(self) -> None:
        self._state = _HEAD
        self.head = None
        self.got_bytes = False
        self._pending = b""
        self.uses += 1

    async def send(self, data: bytes, deadline: float | None, write_limit: float) -> None:
        """Write ``data``; while the transport's buffer is full, wait for the worker to read it.
        ``TimeoutError`` when the worker took nothing for ``write_limit`` seconds, or at
        ``deadline``."""
        transport = self.transport
        assert transport is not None
        transport.write(data)
        while self._write_paused and not self.closed:
            left = transport.get_write_buffer_size()
            drain = self._drain = self.loop.create_future()
            until = self.loop.time() + write_limit
            timer = self.loop.call_at(until if deadline is None else min(until, deadline), _expire, drain)
            try:
                await drain
            except TimeoutError:
                progress = transport.get_write_buffer_size() < left
                if progress and (deadline is None or self.loop.time() < deadline):
                    continue  # slow, not stuck: the worker took some
                raise
            finally:
                timer.cancel()
                self._drain = None

    async def wait(self, deadline: float | None) -> None:
        """Until something arrives (or the connection ends), at most until ``deadline``."""
        if self._exc is not None:
            raise self._exc
        waiter = self._waiter = self.loop.create_future()
        timer = (self.loop.call_at(deadline, _expire, waiter) if deadline is not None else None)
        try:
            await waiter
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()

    def take(self) -> bytes:
        """The body bytes buffered so far (b"" when none)."""
        body = self._body
        if not body:
            return b""
        data = body.popleft() if len(body) == 1 else b"".join(body)
        body.clear()
        self._buffered = 0
        if self._reading_paused and self.transport is not None:
            self._reading_paused = False
            self.transport.resume_reading()
        return data

    @property
    def finished(self) -> bool:
        return self._state == _DONE

    @property
    def error(self) -> BaseException | None:
        return self._exc

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


def _chunk_size(line: bytes) -> int:
    """A chunk-size line's size: 1 to 16 hex digits, optionally followed by chunk extensions
    (``;name[=value]``, whitespace allowed before each ``;``, RFC 9112 7.1.1) that are ignored.
    No sign, no ``0x``, no ``_``, no whitespace elsewhere: anything else is a protocol error."""
    digits, semi, _ = line.partition(b";")
    if semi:
        digits = digits.rstrip(b" \t")
    if _HEX_SIZE.fullmatch(digits) is None:  # int(, 16) alone takes signs, "0x", "_" and spaces
        raise HopProtocolError("a malformed chunk size")
    return int(digits, 16)


def _until(loop: asyncio.AbstractEventLoop, deadline: float | None, read_limit: float | None) -> float | None:
    """When a wait for bytes gives up: the exchange's deadline or ``read_limit`` from now."""
    if read_limit is None:
        return deadline
    until = loop.time() + read_limit
    return until if deadline is None else min(until, deadline)


def _expire(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError())


class HopResponse:
    """An answer whose status line and headers arrived; the body is read through it.

    ``close()`` (always call it) puts a fully read connection back in the pool and closes any
    other."""

    __slots__ = ("_client", "_conn", "_deadline", "_read_limit", "headers", "status")

    def __init__(self, client: HopClient, conn: _Conn, status: int, headers: dict[str, str], *,
                 deadline: float | None, read_limit: float | None) -> None:
        self._client = client
        self._conn: _Conn | None = conn
        self._deadline = deadline
        self._read_limit = read_limit
        self.status = status
        self.headers = headers
        """Header names lower-cased."""


    async def read_any(self) -> bytes:
        """The body bytes that arrived since the last call (waiting for some); b"" at its end."""
        conn = self._conn
        if conn is None:
            return b""
        while True:
            data = conn.take()
            if data:
                return data
            if conn.finished:
                self.close()
                return b""
            await conn.wait(_until(conn.loop, self._deadline, self._read_limit))

    async def read(self) -> bytes:
        """The rest of the body."""
        parts = []
        while chunk := await self.read_any():
            parts.append(chunk)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def close(self) -> None:
        """Done with the answer: a connection that carried it whole goes back to the pool, any
        other is closed (the worker sees the caller leave)."""
        conn, self._conn = self._conn, None
        if conn is not None:
            self._client.release(conn)

    def release(self) -> None:
        """Done with the answer, whose content has all arrived (a stream's ``[DONE]``): the
        connection waits up to ``LINGER`` seconds for the end of the framing (the last chunk)
        and then goes back to the pool; ``close()`` would close it."""
        conn, self._conn = self._conn, None
        if conn is None:
            return
        conn.take()
        if conn.finished or conn.error is not None or conn.closed:
            self._client.release(conn)
        else:
            self._client.linger(conn)


class HopClient:
    def __init__(self, *, connect_timeout: float, keepalive: float,
                 ssl_context: ssl.SSLContext | None = None,
                 loop: asyncio.AbstractEventLoop | None = None,
                 write_timeout: float | None = None, max_per_host: int = 0) -> None:
        self.connect_timeout = connect_timeout
        self.max_per_host = max_per_host
        """Connections open to one worker at most (connecting, in use and idle; 0: no cap). A hop
        beyond it waits for one to come back to the pool or close, at most the connect timeout."""
        self.write_timeout = connect_timeout if write_timeout is None else write_timeout
        """Longest wait for a worker to take more of a request's bytes (default: the connect
        timeout): a worker that stops reading a request fails its hop, it does not hold it."""
        self.keepalive = keepalive
        self._ssl = ssl_context
        self._loop = loop
        self.origin = functools.lru_cache(maxsize=_MAX_ORIGINS)(parse_origin)
        """``parse_origin``, each URL parsed once."""
        self._idle: dict[str, list[_Conn]] = {}
        self._in_use: set[_Conn] = set()
        self._open: dict[str, int] = {}
        """Per worker: connections counted against ``max_per_host``."""
        self._waiters: dict[str, deque[asyncio.Future[None]]] = {}
        """Per worker: hops waiting for a connection (first come, first woken)."""
        self._closed = False

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        return self._loop

    def counts(self) -> dict[str, int]:
        return {"in_use": len(self._in_use), "idle": sum(len(v) for v in self._idle.values())}

    async def request(self, url: str, path: str, headers: bytes, body: bytes, *,
                      deadline: float | None, read_limit: float | None = None) -> HopResponse:
        """POST ``body`` to ``url + path`` with ``headers`` (complete ``Name: value\\r\\n`` lines,
        Host and Content-Length added here). Returns once the status and headers arrived.

        ``deadline`` (loop time) bounds the whole exchange, body included; ``read_limit`` each
        wait for bytes (the headers' included)."""
        if self._closed:
            raise HopDisconnected("the hop client is closed")
        origin = self.origin(url)
        head = b"".join((b"POST ", (origin.base_path + path).encode(), b" HTTP/1.1\r\nHost: ",
                         origin.host_header, b"\r\nContent-Length: ", str(len(body)).encode(),
                         b"\r\n", headers, b"\r\n"))
        message = head + body if len(body) < 65536 else None
        conn = await self._acquire(origin, deadline)
        reused = conn.uses > 0
        conn.begin()
        try:
            if message is not None:
                await conn.send(message, deadline, self.write_timeout)
            else:
                await conn.send(head, deadline, self.write_timeout)
                await conn.send(body, deadline, self.write_timeout)
            while conn.head is None:
                await conn.wait(_until(self.loop, deadline, read_limit))
        except BaseException as e:
            self._in_use.discard(conn)
            self._drop(conn)
            if reused and isinstance(e, HopDisconnected | ConnectionResetError | BrokenPipeError) \
                    and not conn.got_bytes:
                # Most likely closed idle as the request went out, but the worker may have
                # read it: not sent again here (``HopStale``).
                raise HopStale("the worker closed a kept-alive connection before answering") from None
            raise
        status, hdrs = conn.head
        return HopResponse(self, conn, status, hdrs, deadline=deadline, read_limit=read_limit)

    async def _acquire(self, origin: Origin, deadline: float | None) -> _Conn:
        key = origin.key
        conn = self._take_idle(key)
        if conn is not None:
            return conn
        cap = self.max_per_host
        if cap and self._open.get(key, 0) >= cap:
            return await self._wait_for_one(origin, deadline)
        return await self._connect(origin, deadline)

    def _take_idle(self, key: str) -> _Conn | None:
        """A pooled connection to reuse: fresh, kept-alive, and not closed by the worker (the
        kernel is asked: ``_Conn.stale``). Others are closed on the way."""
        idle = self._idle.get(key)
        if idle:
            now = self.loop.time()
            while idle:
                conn = idle.pop()
                if conn.reusable and now - conn.idle_since < self.keepalive and not conn.stale():
                    self._in_use.add(conn)
                    return conn
                self._drop(conn)
        return None

    def _limit(self, deadline: float | None) -> float:
        limit = self.connect_timeout
        if deadline is not None:
            limit = min(limit, max(0.0, deadline - self.loop.time()))
        return limit

    async def _wait_for_one(self, origin: Origin, deadline: float | None) -> _Conn:
        """At the cap: wait for a connection to come back to the pool (reused) or to close (a new
        one is opened), at most the connect timeout and never past ``deadline`` (``TimeoutError``)."""
        key, cap, loop = origin.key, self.max_per_host, self.loop
        until = loop.time() + self._limit(deadline)
        waiters = self._waiters.setdefault(key, deque())
        while True:
            waiter: asyncio.Future[None] = loop.create_future()
            waiters.append(waiter)
            timer = loop.call_at(until, _expire, waiter)
            try:
                await waiter
            except BaseException:
                if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                    self._wake(key)  # woken, then cancelled: the wake goes to the next one
                raise
            finally:
                timer.cancel()
                with contextlib.suppress(ValueError):
                    waiters.remove(waiter)
                if not waiters and self._waiters.get(key) is waiters:
                    del self._waiters[key]
            if self._closed:
                raise HopDisconnected("the hop client is closed")
            conn = self._take_idle(key)
            if conn is not None:
                return conn
            if self._open.get(key, 0) < cap:
                return await self._connect(origin, deadline)
            # another hop took it first: wait again (the same bound)
            waiters = self._waiters.setdefault(key, deque())

    def _wake(self, key: str) -> None:
        waiters = self._waiters.get(key)
        while waiters:
            waiter = waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    async def _connect(self, origin: Origin, deadline: float | None) -> _Conn:
        limit = self._limit(deadline)
        sslctx: ssl.SSLContext | None = None
        if origin.tls:
            if self._ssl is None:  # the system's CAs, full verification
                self._ssl = ssl.create_default_context()
            sslctx = self._ssl
        conn = _Conn(self.loop, origin)
        conn.counted = True
        self._open[origin.key] = self._open.get(origin.key, 0) + 1
        try:
            async with asyncio.timeout(limit):
                await self.loop.create_connection(lambda: conn, origin.host, origin.port, ssl=sslctx,
                                                  server_hostname=origin.host if sslctx else None)
        except BaseException:
            self._drop(conn)
            raise
        if self._closed:
            self._drop(conn)
            raise HopDisconnected("the hop client is closed")
        self._in_use.add(conn)
        return conn

    def _drop(self, conn: _Conn) -> None:
        """Close a connection; its place under the cap goes to a waiting hop."""
        conn.close()
        if conn.counted:
            conn.counted = False
            key = conn.origin.key
            left = self._open.get(key, 0) - 1
            if left > 0:
                self._open[key] = left
            else:
                self._open.pop(key, None)
            if self._waiters:
                self._wake(key)

    def release(self, conn: _Conn) -> None:
        self._in_use.discard(conn)
        if self._closed or not conn.reusable:
            self._drop(conn)
            return
        conn.idle_since = self.loop.time()
        key = conn.origin.key
        self._idle.setdefault(key, []).append(conn)
        if self._waiters:
            self._wake(key)

    def linger(self, conn: _Conn) -> None:
        def give_up() -> None:
            if conn.on_done is not None:
                conn.on_done = None
                self.release(conn)  # still mid-answer: closes it

        timer = self.loop.call_later(LINGER, give_up)

        def done() -> None:
            timer.cancel()
            self.release(conn)

        conn.on_done = done

    def sweep(self) -> None:
        """Close idle connections past the keep-alive time or closed by their worker."""
        now = self.loop.time()
        for key, conns in list(self._idle.items()):
            keep = [c for c in conns if c.reusable and now - c.idle_since < self.keepalive]
            for c in conns:
                if c not in keep:
                    self._drop(c)
            if keep:
                self._idle[key] = keep
            else:
                del self._idle[key]

    async def close(self) -> None:
        self._closed = True
        conns = [c for v in self._idle.values() for c in v] + list(self._in_use)
        self._idle.clear()
        self._in_use.clear()
        self._open.clear()
        for c in conns:
            c.counted = False
            c.close()
        for waiters in self._waiters.values():
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_exception(HopDisconnected("the hop client is closed"))
        self._waiters.clear()
        await asyncio.sleep(0)  # let the transports run their connection_lost


def header_lines(headers: dict[str, str]) -> bytes:
    """``Name: value\\r\\n`` lines; a value with CR, LF or NUL is left out (never sent broken)."""
    out = []
    for name, value in headers.items():
        if "\r" in value or "\n" in value or "\0" in value:
            continue
        out.append(f"{name}: {value}\r\n".encode())
    return b"".join(out)


__all__ = ["HopClient", "HopDisconnected", "HopProtocolError", "HopResponse", "HopStale", "Origin",
           "header_lines", "parse_origin"]
