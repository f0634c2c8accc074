"""The hot calls' own server: ``POST`` generate and abort served on a protocol of the project's own,
every other connection handed to aiohttp's.

aiohttp's request handler costs a proxy request as much as the walk's components do (measured:
``benchmarks/internals/shells.py``): per request it waits on a new future for the message, builds
a payload reader, a ``StreamWriter`` and a ``web.Request``, prepares the response through its
header machinery and writes it through the writer. ``Front`` is the
protocol of every connection the app accepts (``FrontServer``, the app's ``web.Server``). It
reads a request's head and body from its own buffer and serves it itself when the request is one
of the hot calls in their plain form:

    POST <a lean path, exactly> HTTP/1.1
    the header lines, each ``token: visible text``, at most 128 of them and 8190 bytes in all
    Content-Length: N (one, digits), N at most ``FRONT_BODY_BYTES`` and the app's body limit
    no Transfer-Encoding, Content-Encoding, Expect or Upgrade, no ``Connection: upgrade``

Anything else (another method or path, HTTP/1.0, a chunked or compressed body, a larger one, a
head that is not strictly well formed) hands the connection to aiohttp's ``RequestHandler`` with
every byte read so far, before any of it is answered, and aiohttp serves it and the rest of the
connection exactly as without the front: its parser decides what is malformed, its router answers
404 and 405, its middlewares check keys and bodies. A connection is handed over only between
requests, so a request is always answered whole by one of the two.

What the front answers, it answers as the lean front (``proxy.lean``) does: the key check, the
handler, every error through ``proxy.errors.answer_error``; a body that does not arrive within the
body timeout is a 408, and the connection is closed after it. The handler runs in a task of its
own, cancelled when the client goes away (``handler_cancellation``, as aiohttp) unless it is in a
step it must finish first (the prefill hop): then the front calls the request's ``on_gone``
instead, and the handler ends itself once the step is done; responses are
written in one ``transport.write`` (a ``web.Response``) or through aiohttp's ``StreamResponse``
(streams prepare themselves on the request, ``FrontRequest`` giving them a ``StreamWriter``).
Graceful shutdown (``pre_shutdown``, ``shutdown``) finishes a request in flight within the
runner's timeout, as aiohttp's handler does. Keep-alive: an idle connection (no request, or one
whose head has not all arrived) is closed after the server's ``keepalive_timeout``; pipelined
requests are served one after the other.

``FrontRequest`` is the handler's request: the few things the walk, the key check and the error
answers read of a ``web.Request`` (the suite runs through the front, so a new use that it lacks
fails there).
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, NamedTuple, cast

from aiohttp import hdrs, web
from aiohttp.base_protocol import BaseProtocol
from aiohttp.http import HttpVersion11
from aiohttp.http_exceptions import BadHttpMethod
from aiohttp.http_writer import StreamWriter
from multidict import CIMultiDict, CIMultiDictProxy

from proxy.errors import BodyTimeout, answer_error, log_unexpected, malformed_http_response
from proxy.front_write import FrontReply, FrontStream, full_answer, response_head

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Guard = Callable[[web.Request], None]

FRONT_BODY_BYTES = 1 << 20
"""The largest body the front reads; larger ones (``proxy.large_body``'s) go to aiohttp's path."""
MAX_HEAD_BYTES = 8190
"""A longer head (request line and headers) goes to aiohttp's parser, which has its own limits."""
READ_AHEAD_BYTES = 1 << 16
"""Bytes buffered past a request in flight (pipelined requests) before reading pauses."""

log = logging.getLogger("pd_proxy")

_FIELD_NAME = r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+"
_HEAD = re.compile(rb"POST (/[!-~]*) HTTP/1\.1(\r\n(?:" + _FIELD_NAME.encode() +
                   rb":[\t\x20-\x7e\x80-\xff]*\r\n){0,128})\r\n")
_FIELD = re.compile("(" + _FIELD_NAME + "):[ \t]*([^\r\n]*)\r\n")
"""A header line: its name and its value, leading blanks left out, in time linear in the line
(trailing blanks are stripped after, where ``_BLANK_END`` finds some: a lazy value before
``[ \t]*`` backtracked over every run of blanks inside it, in time quadratic in its length)."""
_BLANK_END = re.compile(rb"[ \t]\r\n")
_HANDED = re.compile(rb"\r\n(?:transfer-encoding|content-encoding|expect|upgrade):", re.IGNORECASE)
"""Headers whose requests aiohttp serves: a chunked or compressed body, ``100-continue``, an upgrade."""
_DIGITS = re.compile("[0-9]{1,18}")


class FrontRoute(NamedTuple):
    handler: Handler


class Head(NamedTuple):
    route: FrontRoute
    path: str
    headers: CIMultiDictProxy[str]
    body_start: int
    length: int
    keep_alive: bool


_HAND_OFF = "hand off"


def parse_head(buf: bytearray, routes: Mapping[str, FrontRoute], max_body: int,
               scanned: int = 0) -> Head | str | None:
    """The head at the start of ``buf``: a ``Head`` the front serves, ``_HAND_OFF`` for aiohttp,
    None while it has not all arrived. ``scanned``: where the search for its end starts (the
    bytes before it were searched by an earlier call, so a head arriving byte by byte is not
    searched again from its start each time)."""
    end = buf.find(b"\r\n\r\n", scanned, MAX_HEAD_BYTES + 4)
    if end < 0:  # not all here; or a head aiohttp's parser may take (bare LFs), or too long
        bare = buf.find(b"\n\n", scanned) >= 0 or buf.find(b"\n\r\n", scanned) >= 0
        return _HAND_OFF if bare or len(buf) > MAX_HEAD_BYTES + 4 else None
    m = _HEAD.fullmatch(buf, 0, end + 4)
    path = m.group(1).decode("ascii") if m is not None else ""
    route = routes.get(path)
    if m is None or route is None or _HANDED.search(block := m.group(2)) is not None:
        return _HAND_OFF
    fields = _FIELD.findall(block.decode("utf-8", "surrogateescape")[2:])
    if _BLANK_END.search(block) is not None:  # a value with trailing blanks (rare): they go
        fields = [(name, value.rstrip(" \t")) for name, value in fields]
    headers = CIMultiDict(fields)
    lengths = headers.getall(hdrs.CONTENT_LENGTH, ())
    if len(lengths) != 1 or _DIGITS.fullmatch(lengths[0]) is None or int(lengths[0]) > max_body:
        return _HAND_OFF
    keep_alive = True
    if hdrs.CONNECTION in headers:
        tokens = {t.strip().lower() for v in headers.getall(hdrs.CONNECTION) for t in v.split(",")}
        if "upgrade" in tokens:
            return _HAND_OFF
        keep_alive = "close" not in tokens
    return Head(route, path, CIMultiDictProxy(headers), end + 4, int(lengths[0]), keep_alive)


class FrontRequest:
    """What the handlers read of a request the front serves (see the module's docstring)."""

    method = hdrs.METH_POST
    version = HttpVersion11
    body_exists = True
    can_read_body = False

    def __init__(self, protocol: Front, app: web.Application, head: Head, body: bytes) -> None:
        self._protocol, self.app, self.path, self.headers = protocol, app, head.path, head.headers
        self.keep_alive, self._body = head.keep_alive, body
        self._state: dict[Any, Any] = {}
        self._writer: StreamWriter | None = None
        self.replied: FrontReply | None = None
        """Set by ``reply``: the answer is on the wire, whatever the handler does after it."""
        self.on_gone: Callable[[], None] | None = None
        """Set by the handler while it is in a step it must not leave half done (the prefill hop,
        ``proxy.prefill``): when the client goes away, or the shutdown ends the request, the front
        calls it (once) instead of cancelling the handler, which then ends itself
        (``CancelledError``) as soon as the step is done."""

    @property
    def transport(self) -> asyncio.Transport | None:
        return self._protocol.transport

    @property
    def content_length(self) -> int:
        return len(self._body)

    @property
    def _payload_writer(self) -> StreamWriter:
        """For ``StreamResponse.prepare``: the response's writer on this connection."""
        if self._writer is None:
            self._writer = StreamWriter(self._protocol, self._protocol.loop)
        return self._writer

    async def _prepare_hook(self, response: web.StreamResponse) -> None:
        return  # no ``on_response_prepare`` signals on the lean routes' app

    async def read(self) -> bytes:
        return self._body

    def reply(self, body: bytes, headers: Mapping[str, str]) -> web.StreamResponse:
        """A 200 JSON answer written on the connection now, before the walk's accounting
        (``front_write.full_answer``: what ``Front._finish`` writes for the same ``web.Response``,
        ``Connection: close`` when the connection ends). Nothing is written when the client is
        gone. The response returned is the front's record of it (``FrontReply``): nothing is left
        to send."""
        protocol = self._protocol
        transport = protocol.transport
        if transport is not None and not transport.is_closing():
            transport.write(full_answer(body, headers, close=not self.keep_alive or protocol.closing))
        replied = self.replied = FrontReply(protocol)
        return replied

    def stream(self, headers: Mapping[str, str], *, headers_with_first_write: bool) -> FrontStream:
        """The request's event stream, written on its connection (``FrontStream``)."""
        return FrontStream(self._protocol, self.keep_alive, headers,
                           headers_with_first_write=headers_with_first_write)

    def get(self, key: Any, default: Any = None) -> Any:
        return self._state.get(key, default)

    def __getitem__(self, key: Any) -> Any:
        return self._state[key]

    def __setitem__(self, key: Any, value: Any) -> None:
        self._state[key] = value

    def __contains__(self, key: Any) -> bool:
        return key in self._state


class Front(BaseProtocol):
    """One client connection (see the module's docstring)."""

    def __init__(self, server: FrontServer) -> None:
        super().__init__(server.loop)
        self.server = server
        self.loop = server.loop
        self.buf = bytearray()
        self.task: asyncio.Task[None] | None = None
        self.request: FrontRequest | None = None
        """The request ``task`` serves."""
        self.head: Head | None = None
        """A head the front serves whose body has not all arrived."""
        self.keepalive: asyncio.TimerHandle | None = None
        self.idle_until = 0.0
        """When an idle connection is closed: the keep-alive timer fires at or before it and is
        moved on when it fires early (not re-armed for every request)."""
        self.body_timer: asyncio.TimerHandle | None = None
        """The body timeout, while ``head`` waits for its body."""
        self.closing = False
        self.discard_left = 0
        """Bytes of a refused request's body still to come (its key refused before the body
        arrived): read and dropped before the connection closes, within the body timeout, so
        that a client that writes its whole body before it reads gets the answer, not a reset."""
        self.scanned = 0
        """How far the buffer was searched for the end of a head that has not all arrived."""

    # -- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self.server.fronts.add(self)
        self._idle()

    def connection_lost(self, exc: BaseException | None) -> None:
        super().connection_lost(exc)
        self.server.fronts.discard(self)
        self._cancel_timers()
        self.buf.clear()
        if self.task is not None and self.server.handler_cancellation:
            self._end_handler()

    def data_received(self, data: bytes) -> None:
        if self.closing:
            if self.discard_left > 0:
                self.discard_left -= len(data)
                if self.discard_left <= 0 and self.task is None and self.transport is not None:
                    self.transport.close()  # the refused body is all in: the answer is out
            return
        self.buf += data
        if self.task is None:
            self._next()
        elif len(self.buf) > READ_AHEAD_BYTES and not self._buffer_paused:
            self._pause_reading_for_buffer()

    def eof_received(self) -> bool:
        return False  # the transport closes; a request in flight is cancelled (connection_lost)

    # -- requests

    def _next(self) -> None:
        """Start the request at the head of the buffer, or wait for the rest of it, or hand off."""
        head = self.head
        if head is None:
            parsed = parse_head(self.buf, self.server.routes, self.server.max_body, self.scanned)
            if parsed is None:
                self.scanned = max(0, len(self.buf) - 3)  # a line end may straddle the next bytes
                return
            self.scanned = 0
            if type(parsed) is not Head:
                self._hand_off()
                return
            head = parsed
        end = head.body_start + head.length
        buf = self.buf
        if len(buf) < end:
            if self.head is None:  # the body is late: the key first (as the lean front), then its timer
                guard = self.server.guard
                if guard is not None:
                    try:
                        guard(cast(web.Request, FrontRequest(self, self.server.app, head, b"")))
                    except Exception as e:
                        self._answer_and_close(head, e, drain=end - len(buf))
                        return
                self.head = head
                self.body_timer = self.loop.call_later(self.server.body_timeout, self._body_late)
            return
        if self.head is not None:
            self.head = None
            if self.body_timer is not None:
                self.body_timer.cancel()
                self.body_timer = None
        if end == len(buf):
            body = bytes(buf[head.body_start:])
            buf.clear()
        else:
            body = bytes(buf[head.body_start:end])
            del buf[:end]
        request = self.request = FrontRequest(self, self.server.app, head, body)
        self.task = self.loop.create_task(self._serve(request, head.route.handler))

    def _end_handler(self) -> None:
        """End the request in flight: its handler cancelled, or told through ``on_gone`` when it
        is in a step it must finish first."""
        request, task = self.request, self.task
        if request is not None and request.on_gone is not None:
            gone, request.on_gone = request.on_gone, None
            gone()
        elif task is not None:
            task.cancel()

    async def _serve(self, request: FrontRequest, handler: Handler) -> None:
        as_request = cast(web.Request, request)
        try:
            try:
                guard = self.server.guard
                if guard is not None:
                    guard(as_request)
                resp = await handler(as_request)
            except Exception as e:
                if request.replied is None:
                    resp = answer_error(as_request, e)
                else:  # a bug after the answer went out: no second answer on this connection
                    log_unexpected(e, f"serving POST {request.path} after its answer")
                    request.keep_alive = False
                    resp = request.replied
            await self._finish(request, resp)
        except Exception as e:  # the client went away mid-write, or a response that cannot be written
            if not isinstance(e, ConnectionResetError):
                log_unexpected(e, f"answering POST {request.path}: the connection is closed")
            request.keep_alive = False
            if self.transport is not None:
                self.transport.abort()
        finally:
            self.task = self.request = None
            self._served(request.keep_alive)

    async def _finish(self, request: FrontRequest, resp: web.StreamResponse) -> None:
        if resp.prepared:  # a stream, written by the walk; ended unless the walk ended it
            await resp.write_eof()
            return
        if type(resp) is not web.Response or type(body := resp.body) is not bytes:
            await resp.prepare(cast(web.Request, request))
            await resp.write_eof()
            return
        transport = self.transport
        if transport is None:
            return
        headers = resp.headers
        headers[hdrs.CONTENT_LENGTH] = str(len(body))
        if body and hdrs.CONTENT_TYPE not in headers:
            headers[hdrs.CONTENT_TYPE] = "application/octet-stream"
        transport.write(response_head(resp, close=not request.keep_alive or self.closing) + body)
        if self._paused:
            await self._drain_helper()

    def _served(self, keep_alive: bool) -> None:
        transport = self.transport
        if transport is None:
            return
        if not keep_alive or self.closing:
            if self.discard_left > 0:  # a refused body still coming: dropped as it comes, for a while
                self.body_timer = self.loop.call_later(self.server.body_timeout, transport.close)
                return
            transport.close()
            return
        self._idle()
        if self._buffer_paused:
            self._resume_reading_for_buffer()
        if self.buf:
            self._next()

    def _body_late(self) -> None:
        """The body timeout passed with the body not all arrived: a 408 in vLLM's shape."""
        self.body_timer = None
        head, self.head = self.head, None
        if head is not None and self.task is None:
            self._answer_and_close(head, BodyTimeout.after(self.server.body_timeout))

    def _answer_and_close(self, head: Head, error: Exception, *, drain: int = 0) -> None:
        """Answer ``error`` for the request of ``head`` without its body, then close: nothing more
        is read from this connection as a request (what is left of the body is not one).
        ``drain``: bytes of the body still to come, dropped as they arrive before the close
        (``discard_left``)."""
        self._cancel_timers()
        self.buf.clear()
        self.closing = True
        self.discard_left = drain
        if drain > 0 and self._buffer_paused:
            self._resume_reading_for_buffer()
        request = FrontRequest(self, self.server.app, head._replace(keep_alive=False), b"")

        async def fail(_: web.Request) -> web.StreamResponse:
            raise error

        self.request = request
        self.task = self.loop.create_task(self._serve(request, fail))

    # -- idle connections, the hand-off

    def _idle(self) -> None:
        """No request in flight from now: the connection closes if none starts within the
        keep-alive timeout (aiohttp's ``keepalive_timeout``)."""
        timeout = self.server.keepalive_timeout
        if timeout > 0:
            self.idle_until = self.loop.time() + timeout
            if self.keepalive is None:
                self.keepalive = self.loop.call_at(self.idle_until, self._keepalive_fired)

    def _keepalive_fired(self) -> None:
        self.keepalive = None
        if self.task is not None or self.head is not None or self.transport is None:
            return  # busy: ``_idle`` re-arms it after the request
        if self.loop.time() < self.idle_until:
            self.keepalive = self.loop.call_at(self.idle_until, self._keepalive_fired)
        else:
            self.transport.close()

    def _cancel_timers(self) -> None:
        for timer in (self.keepalive, self.body_timer):
            if timer is not None:
                timer.cancel()
        self.keepalive = self.body_timer = None

    def _hand_off(self) -> None:
        """The connection goes to aiohttp's request handler with what was read of it."""
        transport = self.transport
        if transport is None:
            return
        self._cancel_timers()
        self.server.fronts.discard(self)
        data, self.buf = bytes(self.buf), bytearray()
        self.transport = None
        self.closing = True
        handler = self.server.aiohttp_protocol()
        transport.set_protocol(handler)
        handler.connection_made(transport)
        if self._buffer_paused:
            transport.resume_reading()
        if data:
            handler.data_received(data)

    # -- the runner's shutdown (``web.Server.pre_shutdown``, ``shutdown``)

    def close(self) -> None:
        """Stop taking requests: an idle connection closes now, a busy one after its request."""
        self.closing = True
        if self.task is None and self.transport is not None:
            self._cancel_timers()
            self.transport.close()

    async def shutdown(self, timeout: float | None) -> None:  # noqa: ASYNC109 (aiohttp's signature)
        """Let the request in flight finish within ``timeout``, then cancel it; close."""
        self.close()
        task = self.task
        if task is not None:
            _, pending = await asyncio.wait({task}, timeout=timeout)
            if pending:
                self._end_handler()
                await asyncio.wait({task}, timeout=timeout)
        if self.transport is not None:
            self.transport.close()


class QuietRequestHandler(web.RequestHandler):
    """aiohttp's request handler, for the connections the front hands over and every one under
    ``--front aiohttp``. A request its parser refuses is answered in vLLM's error shape and
    logged in one line, its class and status: aiohttp logs it at ERROR with the parser's message,
    which quotes the offending line (an ``Authorization`` header and its key, say), and answers
    it as plain text that echoes it. Errors of a handler (500) stay aiohttp's (the app's
    middlewares answer them first)."""

    def handle_error(self, request: web.BaseRequest, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if status != 400:
            return super().handle_error(request, status, exc, message)
        # Non-HTTP traffic (a TLS hello, a scanner) is a bad method: DEBUG, as aiohttp logs it.
        level = logging.DEBUG if isinstance(exc, BadHttpMethod) else logging.INFO
        log.log(level, "refused a malformed HTTP request from %s: %s", request.remote,
                type(exc).__name__ if exc is not None else "no error")
        if request.writer.output_size > 0:  # as aiohttp: an answer is on its way, the connection is broken
            raise ConnectionError("an answer was sent already: no error answer can follow")
        return malformed_http_response(status, exc)


class QuietServer(web.Server):
    """A ``web.Server`` whose connections get ``QuietRequestHandler``."""

    def __call__(self) -> web.RequestHandler:
        return QuietRequestHandler(self, loop=self._loop, **self._kwargs)


class FrontServer(QuietServer):
    """The app's ``web.Server``: each connection starts on a ``Front``; aiohttp's
    ``RequestHandler`` takes those handed to it (``aiohttp_protocol``)."""

    def __init__(self, handler: Any, *, app: web.Application, routes: Mapping[str, FrontRoute],
                 guard: Guard | None, max_body: int, body_timeout: float, **kwargs: Any) -> None:
        super().__init__(handler, **kwargs)
        self.loop = self._loop
        self.app, self.routes, self.guard = app, routes, guard
        self.max_body, self.body_timeout = max_body, body_timeout
        self.keepalive_timeout = float(kwargs.get("keepalive_timeout", 3630.0))
        self.fronts: set[Front] = set()

    def __call__(self) -> Front:  # type: ignore[override]
        return Front(self)

    def aiohttp_protocol(self) -> web.RequestHandler:
        return super().__call__()

    def pre_shutdown(self) -> None:
        super().pre_shutdown()
        for front in list(self.fronts):
            front.close()

    async def shutdown(self, timeout: float | None = None) -> None:  # noqa: ASYNC109 (web.Server's)
        await asyncio.gather(super().shutdown(timeout), *(f.shutdown(timeout) for f in list(self.fronts)))


__all__ = ["FRONT_BODY_BYTES", "Front", "FrontRequest", "FrontRoute", "FrontServer", "QuietRequestHandler",
           "QuietServer", "parse_head"]
