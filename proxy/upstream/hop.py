"""The HTTP/1.1 client of the generate hops: a keep-alive pool per worker, capped at
``max_per_host``. A POST is never sent twice here (``HopStale``); a connection whose answer was
not read to its end is closed, never reused: that is what tells vLLM the caller left.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import ssl
from collections import deque
from collections.abc import Callable

from proxy.upstream.hop_answer import AnswerLimits, HopTooLarge
from proxy.upstream.hop_wire import (
    HopConnection,
    HopDisconnected,
    HopProtocolError,
    Origin,
    SinkError,
    expire,
    parse_origin,
    read_until,
)

LINGER = 1.0
"""How long a released answer's connection waits for the end of its framing."""
_MAX_ORIGINS = 4096


class HopStale(HopDisconnected):
    """A kept-alive connection ended before any answer byte, after the request went out. The
    worker may have read it: only ``Upstream`` sends it again, once any copy was aborted."""


class HopConnectTimeout(TimeoutError):
    """No connection to the worker within the connect timeout."""


_STALL = 0.25
"""How far past a connect's timeout a stalled loop must notice it for the connect to be retried."""


class HopResponse:
    """An answer whose head arrived. ``close()`` (always call it) pools a fully read connection
    and closes any other."""

    __slots__ = ("_client", "_conn", "_deadline", "_read_limit", "headers", "status")

    def __init__(self, client: HopClient, conn: HopConnection, status: int, headers: dict[str, str], *,
                 deadline: float | None, read_limit: float | None) -> None:
        self._client = client
        self._conn: HopConnection | None = conn
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
            await conn.wait(read_until(conn.loop, self._deadline, self._read_limit))

    async def pipe(self, sink: Callable[[bytes], bool]) -> None:
        """The rest of the body to ``sink`` as it arrives, until it ends or the sink returns False;
        what the sink raises comes out as a ``SinkError``."""
        conn = self._conn
        if conn is None:
            return
        await conn.pipe(sink, self._deadline, self._read_limit)
        if conn.finished:
            self.close()

    async def read(self) -> bytes:
        """The rest of the body."""
        conn = self._conn
        if conn is not None and conn.finished:  # all of it came with the head (a JSON answer, usually)
            data = conn.take()
            self.close()
            return data
        parts = []
        while chunk := await self.read_any():
            parts.append(chunk)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def close(self) -> None:
        """Done: a connection that carried the answer whole is pooled, any other closed."""
        conn, self._conn = self._conn, None
        if conn is not None:
            self._client.release(conn)

    def release(self) -> None:
        """Done with an answer whose content all arrived: pooled once its framing ends (``LINGER``)."""
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
                 write_timeout: float | None = None, max_per_host: int = 0,
                 limits: AnswerLimits | None = None) -> None:
        self.connect_timeout = connect_timeout
        self.limits = limits if limits is not None else AnswerLimits()
        self.max_per_host = max_per_host
        """Connections open to one worker at most (0: no cap); a hop beyond waits for one."""
        self.write_timeout = connect_timeout if write_timeout is None else write_timeout
        """Longest wait for a worker to take more request bytes."""
        self.keepalive = keepalive
        self._ssl = ssl_context
        self._loop = loop
        self.origin = functools.lru_cache(maxsize=_MAX_ORIGINS)(parse_origin)
        self._idle: dict[str, list[HopConnection]] = {}
        self._in_use: set[HopConnection] = set()
        self._open: dict[str, int] = {}
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
                      deadline: float | None, read_limit: float | None = None,
                      stream: bool = False) -> HopResponse:
        """POST ``body`` (``headers``: complete ``Name: value\\r\\n`` lines); returns at the head.
        ``stream``: a 2xx body is taken as it arrives, not bounded by ``limits.body``."""
        if self._closed:
            raise HopDisconnected("the hop client is closed")
        origin = self.origin(url)
        head = b"".join((b"POST ", (origin.base_path + path).encode(), b" HTTP/1.1\r\nHost: ",
                         origin.host_header, b"\r\nContent-Length: ", str(len(body)).encode(),
                         b"\r\n", headers, b"\r\n"))
        message = head + body if len(body) < 65536 else None
        conn = await self._acquire(origin, deadline)
        reused = conn.uses > 0
        conn.begin(stream=stream)
        try:
            if message is not None:
                await conn.send(message, deadline, self.write_timeout)
            else:
                await conn.send(head, deadline, self.write_timeout)
                await conn.send(body, deadline, self.write_timeout)
            while conn.head is None:
                await conn.wait(read_until(self.loop, deadline, read_limit))
        except BaseException as e:
            self._in_use.discard(conn)
            self._drop(conn)
            if reused and isinstance(e, HopDisconnected | ConnectionResetError | BrokenPipeError) \
                    and not conn.got_bytes:
                # The worker may have read it: never sent again here.
                raise HopStale("the worker closed a kept-alive connection before answering") from None
            raise
        status, hdrs = conn.head
        return HopResponse(self, conn, status, hdrs, deadline=deadline, read_limit=read_limit)

    async def _acquire(self, origin: Origin, deadline: float | None) -> HopConnection:
        key = origin.key
        conn = self._take_idle(key)
        if conn is not None:
            return conn
        cap = self.max_per_host
        if cap and self._open.get(key, 0) >= cap:
            return await self._wait_for_one(origin, deadline)
        return await self._connect(origin, deadline)

    def _take_idle(self, key: str) -> HopConnection | None:
        """A pooled connection to reuse (fresh and not closed by the worker); others are closed."""
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

    async def _wait_for_one(self, origin: Origin, deadline: float | None) -> HopConnection:
        """At the cap: wait for a connection to be pooled or closed, within the connect timeout."""
        key, cap, loop = origin.key, self.max_per_host, self.loop
        until = loop.time() + self._limit(deadline)
        waiters = self._waiters.setdefault(key, deque())
        while True:
            waiter: asyncio.Future[None] = loop.create_future()
            waiters.append(waiter)
            timer = loop.call_at(until, expire, waiter)
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
            waiters = self._waiters.setdefault(key, deque())

    def _wake(self, key: str) -> None:
        waiters = self._waiters.get(key)
        while waiters:
            waiter = waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    async def _connect(self, origin: Origin, deadline: float | None) -> HopConnection:
        limit = self._limit(deadline)
        sslctx: ssl.SSLContext | None = None
        if origin.tls:
            if self._ssl is None:  # the system's CAs, full verification
                self._ssl = ssl.create_default_context()
            sslctx = self._ssl
        conn = HopConnection(self.loop, origin, self.limits)
        conn.counted = True
        self._open[origin.key] = self._open.get(origin.key, 0) + 1
        asked = limit
        try:
            for tries_left in (1, 0):
                until = self.loop.time() + limit
                try:
                    await self._open_socket(conn, sslctx, until)
                    break
                except TimeoutError:
                    # The loop stood still: the connect may have lost to the timer. Once more.
                    limit = self._limit(deadline)
                    if not tries_left or self.loop.time() - until < _STALL or limit <= 0:
                        raise HopConnectTimeout(f"not connected within {asked:.3g} s") from None
                    conn.close()  # a fresh protocol for the new socket; its place under the cap kept
                    fresh = HopConnection(self.loop, origin)
                    fresh.counted, conn.counted = True, False
                    conn = fresh
        except BaseException:
            self._drop(conn)
            raise
        if self._closed:
            self._drop(conn)
            raise HopDisconnected("the hop client is closed")
        self._in_use.add(conn)
        return conn

    async def _open_socket(self, conn: HopConnection, sslctx: ssl.SSLContext | None, until: float) -> None:
        origin = conn.origin
        async with asyncio.timeout_at(until):
            await self.loop.create_connection(lambda: conn, origin.host, origin.port, ssl=sslctx,
                                              server_hostname=origin.host if sslctx else None)

    def _drop(self, conn: HopConnection) -> None:
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

    def release(self, conn: HopConnection) -> None:
        self._in_use.discard(conn)
        if self._closed or not conn.reusable:
            self._drop(conn)
            return
        conn.idle_since = self.loop.time()
        key = conn.origin.key
        self._idle.setdefault(key, []).append(conn)
        if self._waiters:
            self._wake(key)

    def linger(self, conn: HopConnection) -> None:
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


__all__ = ["AnswerLimits", "HopClient", "HopDisconnected", "HopProtocolError", "HopResponse", "HopStale",
           "HopTooLarge", "Origin", "SinkError", "header_lines", "parse_origin"]
