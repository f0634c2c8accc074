"""The wire side of the generate hops: one HTTP/1.1 connection and the framing of its answers.

``HopConnection`` is the ``asyncio.Protocol`` under ``proxy.hop.HopClient``: it writes a request
(waiting while the worker does not take the bytes), parses one answer at a time (status line,
headers, then a body framed by ``Content-Length``, chunked encoding or the connection's end) and
queues the body's bytes for the caller, pausing the socket while 1 MiB waits unread. Framing is
strict: a status is 3 digits in 100-599 after ``HTTP/1.x``, a Content-Length 1 to 18 ASCII digits
(one value), a chunk size 1 to 16 hex digits (extensions ignored), nothing else; anything malformed
is a ``HopProtocolError`` and closes the connection. An answer with both Transfer-Encoding and
Content-Length is read as chunked and its connection not reused after it (RFC 9112 6.3).
"""

from __future__ import annotations

import asyncio
import contextvars
import re
import select
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, cast
from urllib.parse import urlsplit

_MAX_HEAD = 64 * 1024
"""Largest status line + headers accepted from a worker."""
_READ_PAUSE = 1 << 20
"""Body bytes buffered unread before the socket stops being read."""

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


class SinkError(Exception):
    """What a ``HopConnection.pipe`` sink raised (``error``), told apart from the hop's own
    failures, which callers translate."""

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


def _body_framing(status: int, headers: dict[str, str]) -> tuple[int, int, bool]:
    """How the body after an answer's head is framed: the parser's next state, the length of a
    Content-Length body, and whether the framing lets the connection be reused after it."""
    encoding = headers.get("transfer-encoding")
    length = headers.get("content-length")
    if status in (204, 304):
        return _DONE, 0, True
    if encoding is not None:
        if encoding.lower() != "chunked":
            raise HopProtocolError(f"an unsupported transfer encoding ({encoding})")
        # Both: chunked wins (RFC 9112 6.3), and the connection is not reused after it (the two
        # framings may have been read differently on the way).
        return _CHUNK_SIZE, 0, length is None
    if length is not None:
        if not (len(length) <= _MAX_LENGTH_DIGITS and length.isascii() and length.isdigit()):
            raise HopProtocolError("a malformed Content-Length")
        remaining = int(length)
        return (_LENGTH if remaining else _DONE), remaining, True
    return _UNTIL_CLOSE, 0, False


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
    """One timer for every wait of a connection, not one per wait: left armed when a wait ends
    and re-armed only when a wait must end before it fires. When it fires at the watched wait's
    own end the wait fails (``TimeoutError``), as a timer of its own would have made it; when it
    fires earlier (armed for an earlier wait: a read limit that moved on, a former hop's
    deadline) it is armed again at the watched wait's end; with no wait pending it stops."""

    __slots__ = ("_at", "_handle", "_loop", "_until", "_waiter")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._handle: asyncio.TimerHandle | None = None
        self._at = 0.0
        """When ``_handle`` fires: never later than the watched wait's end."""
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
        """The watched wait now gives up at ``until``, no earlier than before (the timer, armed
        for the old end, arms itself again when it fires): a read re-arms nothing."""
        self._until = until

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


class _Answer(asyncio.Protocol):
    """The parsing half of a ``HopConnection``: one answer at a time, its status line and headers
    (``head``) and its body queued (``_body``) as slices of the reads, reading paused while too
    much of it is queued."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._pending = b""
        self._state = _DONE
        self._remaining = 0
        self._keep_alive = True
        self.head: tuple[int, dict[str, str]] | None = None
        self._body: deque[bytes] = deque()
        self._buffered = 0
        self._reading_paused = False

    # -- parsing: a state machine over the answer (``_state``), one step per state. A step reads
    # ``data`` from ``pos`` and returns where it stopped: ``end`` once it kept an unfinished line
    # for the next read (``_pending``) or met bytes past the answer. Body bytes are queued as
    # slices of the read (the whole read when it is all body), never copied byte by byte.

    def _feed(self, data: bytes) -> None:
        if self._pending:
            data, self._pending = self._pending + data, b""
        pos, end = 0, len(data)
        steps = self._STEPS
        while pos < end:
            pos = steps[self._state](self, data, pos, end)

    def _on_head(self, data: bytes, pos: int, end: int) -> int:
        """The status line and headers, once all of them are here."""
        mark = data.find(b"\r\n\r\n", pos)
        if mark < 0:
            if end - pos > _MAX_HEAD:
                raise HopProtocolError("headers larger than 64 KiB")
            self._pending = data[pos:]
            return end
        self._parse_head(data[pos:mark])
        return mark + 4

    def _on_counted(self, data: bytes, pos: int, end: int) -> int:
        """Body bytes of a known count: a Content-Length body, or the data of a chunk that did not
        arrive whole with its CRLF."""
        take = min(self._remaining, end - pos)
        self._push(data if pos == 0 and take == end else data[pos:pos + take])
        self._remaining -= take
        if self._remaining == 0:
            self._state = _DONE if self._state == _LENGTH else _CHUNK_END
        return pos + take

    def _on_until_close(self, data: bytes, pos: int, end: int) -> int:
        """A body that ends with the connection: all of it."""
        self._push(data if pos == 0 else data[pos:])
        return end

    def _line_end(self, data: bytes, pos: int, end: int) -> int:
        """Where the chunk line (size, data's end or trailer) at ``pos`` ends (its CRLF); -1 when
        it has not all arrived (kept for the next read)."""
        nl = data.find(b"\r\n", pos)
        if nl < 0:
            if end - pos > 4096:
                raise HopProtocolError("a chunk header longer than 4 KiB")
            self._pending = data[pos:]
        return nl

    def _on_chunk_size(self, data: bytes, pos: int, end: int) -> int:
        """A chunk's size line. A chunk that follows whole with its CRLF (an SSE event usually
        does) is taken in the same step, and so is every such chunk after it: one call per read
        on the streaming path, not one per event (the chunks queued as ``_push`` queues them, the
        bytes counted once for the read)."""
        append = self._body.append
        taken = 0
        try:
            while pos < end:
                nl = data.find(b"\r\n", pos)  # _line_end inlined: this runs once per streamed event
                if nl < 0:
                    self._line_end(data, pos, end)
                    return end
                line = data[pos:nl]
                # A bare size (no extensions) is the usual line: one match and int, no partition.
                size = int(line, 16) if _HEX_SIZE.fullmatch(line) is not None else _chunk_size(line)
                pos = nl + 2
                if size == 0:
                    self._state = _TRAILER
                    return pos
                stop = pos + size
                if data[stop:stop + 2] != b"\r\n":
                    self._state, self._remaining = _CHUNK_DATA, size
                    return pos
                append(data[pos:stop])
                taken += size
                pos = stop + 2
            return pos
        finally:
            if taken:
                self._queued(taken)

    def _on_chunk_end(self, data: bytes, pos: int, end: int) -> int:
        """The CRLF after a chunk's data, and nothing before it."""
        nl = self._line_end(data, pos, end)
        if nl < 0:
            return end
        if nl != pos:
            raise HopProtocolError("chunk data longer than its declared size")
        self._state = _CHUNK_SIZE
        return nl + 2

    def _on_trailer(self, data: bytes, pos: int, end: int) -> int:
        """The trailer after the last chunk (its fields ignored), up to its empty line."""
        nl = self._line_end(data, pos, end)
        if nl < 0:
            return end
        if nl == pos:
            self._state = _DONE
        return nl + 2

    def _on_done(self, data: bytes, pos: int, end: int) -> int:
        """Bytes past the answer: never reuse this connection."""
        self._keep_alive = False
        return end

    _STEPS: ClassVar[tuple[Callable[[_Answer, bytes, int, int], int], ...]] = (
        _on_head, _on_counted, _on_chunk_size, _on_counted, _on_chunk_end, _on_trailer, _on_until_close,
        _on_done)
    """The step of each state, in the states' order (``_HEAD`` ... ``_DONE``)."""

    def _parse_head(self, head: bytes) -> None:
        lines = head.split(b"\r\n")
        status, version = _status_line(lines[0])
        if 100 <= status < 200:
            return  # an interim answer (100 Continue): the real one follows
        headers = _header_lines(lines[1:])
        if version == b"HTTP/1.0" or "close" in headers.get("connection", "").lower():
            self._keep_alive = False
        self._state, self._remaining, reusable = _body_framing(status, headers)
        if not reusable:
            self._keep_alive = False
        self.head = (status, headers)

    def _push(self, chunk: bytes) -> None:
        self._body.append(chunk)
        self._queued(len(chunk))

    def _queued(self, n: int) -> None:
        """``n`` more body bytes queued: past ``_READ_PAUSE`` unread, the socket is not read."""
        self._buffered += n
        if self._buffered > _READ_PAUSE and not self._reading_paused and self.transport is not None:
            self._reading_paused = True
            self.transport.pause_reading()


class HopConnection(_Answer):
    """One connection: writes requests, parses one answer at a time into a body queue (``_Answer``)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, origin: Origin) -> None:
        super().__init__()
        self.loop = loop
        self.origin = origin
        self.closed = False
        self.uses = 0
        self.counted = False
        """Counted against the client's per-worker cap (until ``HopClient._drop``)."""
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
        """Set while a caller waits in ``pipe``: given the body bytes as they arrive (``_to_sink``,
        once per loop turn that had reads; no task woken); False ends the piping. Unset by the
        connection when it ends (the sink said stop or raised), and by ``pipe`` when it returns."""
        self.sink_error: Exception | None = None
        """What the sink raised (``pipe`` raises it as a ``SinkError``)."""
        self._sink_limit: float | None = None
        self._sink_deadline: float | None = None
        self._sink_stopped = False
        self._sink_soon = False
        """A ``_to_sink`` call is scheduled."""
        self._sink_context: contextvars.Context | None = None
        """The context of ``pipe``'s caller: the sink runs in it, as if the caller had called it."""
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
        self._timer.stop()
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
        if self.sink is not None:
            if not self._sink_soon:
                self._sink_soon = True
                self.loop.call_soon(self._to_sink)
            return
        self._wake()

    def _to_sink(self) -> None:
        """What the reads since the last call brought, to the sink (run once per loop turn that had
        reads, ``call_soon`` from ``data_received``: the reads of one turn go as one). The pipe's
        caller is woken only when the piping ends: the body ended, something failed, the sink
        said stop or raised; otherwise the wait for the next read is extended by the read limit."""
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
            limit = self._sink_limit
            if limit is not None:  # ``read_until``, inlined: this runs once per read
                until = self.loop.time() + limit
                deadline = self._sink_deadline
                self._timer.extend(until if deadline is None or until < deadline else deadline)
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
        """Until something arrives (or the connection ends), at most until ``deadline``
        (``TimeoutError``; the connection's one ``_ReadTimer`` watches it)."""
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
        """Hand the body to ``sink`` until it ends, the sink returns False or raises
        (``SinkError``), the connection fails (raised) or a wait for bytes outlasts ``read_limit``
        or passes ``deadline`` (``TimeoutError``). What arrives goes to the sink in the loop turn
        it arrived in (``_to_sink``: one call for what that turn's reads brought, in the caller's
        context: its context variables, a task it creates): no future, timer or task per read."""
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
