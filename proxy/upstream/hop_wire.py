"""One HTTP/1.1 connection to a worker (the protocol under ``hop.HopClient``): writes a request
with back-pressure, parses answers through ``hop_answer._Answer``, pipes a streamed body to a
callback, and bounds every wait for bytes with one timer per connection.
"""

from __future__ import annotations

import asyncio
import contextvars
import select
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast
from urllib.parse import urlsplit

from proxy.upstream.hop_answer import (
    _DONE,
    _UNTIL_CLOSE,
    AnswerLimits,
    HopDisconnected,
    HopProtocolError,
    _Answer,
)


class SinkError(Exception):
    """What a ``HopConnection.pipe`` sink raised, told apart from the hop's own failures."""

    def __init__(self, error: Exception) -> None:
        super().__init__(repr(error))
        self.error = error


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


def read_until(loop: asyncio.AbstractEventLoop, deadline: float | None,
               read_limit: float | None) -> float | None:
    """When a wait for bytes gives up: the exchange's deadline or ``read_limit`` from now."""
    if read_limit is None:
        return deadline
    until = loop.time() + read_limit
    return until if deadline is None else min(until, deadline)


def expire(waiter: asyncio.Future[None]) -> None:
    """A timer's end: a wait still pending fails with ``TimeoutError``."""
    if not waiter.done():
        waiter.set_exception(TimeoutError())


class _ReadTimer:
    """One timer for every wait of a connection, re-armed only when a wait must end before it
    fires; firing early re-arms it at the watched wait's end, so a wait never outlives its end."""

    __slots__ = ("_at", "_handle", "_loop", "_until", "_waiter")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._handle: asyncio.TimerHandle | None = None
        self._at = 0.0
        self._waiter: asyncio.Future[None] | None = None
        self._until: float | None = None
        """When the watched wait gives up (None: never)."""

    def watch(self, waiter: asyncio.Future[None], until: float | None) -> None:
        self._waiter, self._until = waiter, until
        if until is not None and (self._handle is None or until < self._at):
            self._arm(until)

    def _arm(self, when: float) -> None:
        if self._handle is not None:
            self._handle.cancel()
        self._at = when
        self._handle = self._loop.call_at(when, self._fire)

    def _fire(self) -> None:
        self._handle = None
        waiter, until = self._waiter, self._until
        if waiter is None or waiter.done() or until is None:
            return  # no wait pending (the next one arms its own)
        if until <= self._at:
            waiter.set_exception(TimeoutError())
        else:
            self._arm(until)

    def extend(self, until: float | None) -> None:
        """The watched wait now gives up at ``until``, no earlier than before."""
        self._until = until

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


class HopConnection(_Answer):
    """One connection: writes requests, parses one answer at a time into a body queue (``_Answer``)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, origin: Origin,
                 limits: AnswerLimits | None = None) -> None:
        super().__init__(limits)
        self.loop = loop
        self.origin = origin
        self.closed = False
        self.uses = 0
        self.counted = False
        self.idle_since = 0.0
        self.got_bytes = False
        self._exc: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._timer = _ReadTimer(loop)
        self._drain: asyncio.Future[None] | None = None
        self._write_paused = False
        self.on_done: Callable[[], None] | None = None
        """Set while lingering (``HopResponse.release``): called when the answer ends."""
        self.sink: Callable[[bytes], bool] | None = None
        """Set while a caller waits in ``pipe``: given the body bytes once per loop turn that had
        reads; False ends the piping."""
        self.sink_error: Exception | None = None
        """What the sink raised (``pipe`` raises it as a ``SinkError``)."""
        self._sink_limit: float | None = None
        self._sink_deadline: float | None = None
        self._sink_stopped = False
        self._sink_soon = False
        self._sink_context: contextvars.Context | None = None
        """The context of ``pipe``'s caller: the sink runs in it."""
        self._poll: select.poll | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses
        sock = transport.get_extra_info("socket")
        if sock is not None:
            self._poll = select.poll()
            self._poll.register(sock.fileno(), select.POLLIN)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._timer.stop()
        if self._state == _UNTIL_CLOSE and self._exc is None:
            self._state = _DONE  # the body's end (not when the parser failed it: past its limit)
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
        if self.sink is not None:
            if not self._sink_soon:
                self._sink_soon = True
                self.loop.call_soon(self._to_sink)
            return
        self._wake()

    def _to_sink(self) -> None:
        """What this loop turn's reads brought, to the sink. The pipe's caller is woken only when
        the piping ends; otherwise the wait for the next read is extended by the read limit."""
        self._sink_soon = False
        sink = self.sink
        if sink is None:
            return  # the pipe ended meanwhile (woken by the connection's end, or cancelled)
        more = True
        if self._body:
            assert self._sink_context is not None
            try:
                more = self._sink_context.run(sink, self.take())
            except Exception as e:  # handed to the caller, which raises it
                self.sink_error, more = e, False
            if not more:
                self._sink_stopped = True
        if more and self._exc is None and self._state != _DONE:
            if self._sink_limit is not None:
                self._timer.extend(read_until(self.loop, self._sink_deadline, self._sink_limit))
            return
        self.sink = None
        self._wake()

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

    @property
    def reusable(self) -> bool:
        return (self._state == _DONE and self._keep_alive and self._exc is None and not self.closed
                and not self._body and self.transport is not None and not self.transport.is_closing())

    def stale(self) -> bool:
        """An idle connection's socket is readable (EOF, reset or stray bytes), asked of the kernel
        so it holds at the moment a request would be written."""
        return self._poll is not None and bool(self._poll.poll(0))

    def begin(self, *, stream: bool = False) -> None:
        """A request goes out (``stream``: a 2xx body is taken as it arrives, not bounded)."""
        self.begin_answer(stream=stream)
        self.got_bytes = False
        self.uses += 1

    async def send(self, data: bytes, deadline: float | None, write_limit: float) -> None:
        """Write ``data``, waiting while the worker reads nothing; ``TimeoutError`` when it took
        nothing for ``write_limit`` seconds, or at ``deadline``."""
        transport = self.transport
        assert transport is not None
        transport.write(data)
        while self._write_paused and not self.closed:
            left = transport.get_write_buffer_size()
            drain = self._drain = self.loop.create_future()
            until = self.loop.time() + write_limit
            timer = self.loop.call_at(until if deadline is None else min(until, deadline), expire, drain)
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
        """Until something arrives or the connection ends, at most until ``deadline``."""
        if self._exc is not None:
            raise self._exc
        waiter = self._waiter = self.loop.create_future()
        self._timer.watch(waiter, deadline)
        try:
            await waiter
        finally:
            self._waiter = None

    async def pipe(self, sink: Callable[[bytes], bool], deadline: float | None,
                   read_limit: float | None) -> None:
        """Hand the body to ``sink`` in the caller's context until it ends, the sink returns False
        or raises (``SinkError``), the connection fails, or a wait times out (``TimeoutError``)."""
        self._sink_limit, self._sink_deadline = read_limit, deadline
        self._sink_stopped, self.sink_error = False, None
        self._sink_context = contextvars.copy_context()
        self.sink = sink
        try:
            self._to_sink()  # what is buffered already (what came with the head)
            while self.sink is not None:
                await self.wait(read_until(self.loop, deadline, read_limit))
                self._to_sink()  # what is left when the connection's end woke us, not the sink
        finally:
            self.sink = self._sink_context = None
        if self.sink_error is not None:
            e, self.sink_error = self.sink_error, None
            raise SinkError(e) from e
        if not self._sink_stopped and self._exc is not None and self._state != _DONE:
            raise self._exc

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
        self._timer.stop()
        if self.transport is not None:
            self.transport.close()


__all__ = ["HopConnection", "HopDisconnected", "HopProtocolError", "Origin", "SinkError", "expire",
           "parse_origin", "read_until"]
