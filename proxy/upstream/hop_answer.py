"""One HTTP/1.1 answer of a generate hop parsed at a time, with strict framing (RFC 9112) and
bounded (``AnswerLimits``): anything malformed or too large is a ``HopProtocolError``."""

from __future__ import annotations

import asyncio
import re
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

MAX_HEAD = 64 * 1024
"""Largest head (interim answers and the trailer included) accepted from a worker by default."""
MAX_BODY = 64 * 1024 * 1024
MAX_ERROR_BODY = 1024 * 1024
_READ_PAUSE = 1 << 20
"""Body bytes buffered unread before the socket stops being read."""

_MAX_LENGTH_DIGITS = 18
"""Longest Content-Length accepted (plain ASCII digits)."""
_MAX_CHUNK_DIGITS = 16
_HEX_SIZE = re.compile(rb"[0-9A-Fa-f]{1,%d}" % _MAX_CHUNK_DIGITS)
_BAD_HEAD = re.compile(rb"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]|\r(?!\n)|(?<!\r)\n")
"""In a head: a control character but HTAB, or a CR or LF that is not part of a CRLF."""
_MAX_CHUNK_LINE = 4096
_FRAMING = ("content-length", "transfer-encoding")

_HEAD, _LENGTH, _CHUNK_SIZE, _CHUNK_DATA, _CHUNK_END, _TRAILER, _UNTIL_CLOSE, _DONE = range(8)


class HopProtocolError(Exception):
    """The worker broke HTTP/1.1 framing or an answer's limits."""


class HopDisconnected(HopProtocolError, ConnectionError):
    """The connection ended before the answer did."""


class HopTooLarge(HopProtocolError):
    """An answer's head or body passed its limit: ``part`` is ``head``, ``body`` or ``error``."""

    def __init__(self, part: str, limit: int) -> None:
        what = {"head": "a head", "body": "a body", "error": "an error body"}[part]
        super().__init__(f"{what} larger than {limit} bytes")
        self.part = part
        self.limit = limit


_UNBOUNDED = 1 << 62
"""The body budget of a stream's 2xx answer: taken by its caller as it arrives, never held whole."""


def _bad_head(found: re.Match[bytes]) -> HopProtocolError:
    return HopProtocolError("a CR or LF alone in its head" if found[0] in (b"\r", b"\n")
                            else "a control character in its head")


@dataclass(frozen=True, slots=True)
class AnswerLimits:
    """What one answer may hold, in bytes: head, 2xx body (a stream's is not bounded), other body."""

    head: int = MAX_HEAD
    body: int = MAX_BODY
    error: int = MAX_ERROR_BODY

    def __post_init__(self) -> None:
        if min(self.head, self.body, self.error) < 1:
            raise ValueError("the limits of a worker's answer must be at least 1 byte")


def _status_line(line: bytes) -> tuple[int, bytes]:
    """The status and HTTP version of an answer's first line (strict)."""
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


_SEEN_LINES = 32
"""Header lines a connection remembers the reading of (all forgotten when that many are)."""


def _header_lines(lines: list[bytes], seen: dict[bytes, tuple[str, str]]) -> dict[str, str]:
    """An answer's headers, names lower-cased; a repeated framing header is an error (RFC 9112 6.3)."""
    headers: dict[str, str] = {}
    for raw in lines:
        known = seen.get(raw)
        if known is not None:
            key, text = known
        else:
            name, sep, value = raw.partition(b":")
            if not sep or not name or name != name.strip():
                raise HopProtocolError("a malformed header line")
            key = name.decode("latin-1").lower()
            text = value.strip().decode("latin-1")
            if len(seen) >= _SEEN_LINES:
                seen.clear()
            seen[raw] = (key, text)
        if key in headers and key in _FRAMING and (key != "content-length" or headers[key] != text):
            raise HopProtocolError(f"a repeated {key} header")
        headers[key] = text
    return headers


def _body_framing(status: int, headers: dict[str, str]) -> tuple[int, int, bool]:
    """The parser's next state, the Content-Length, and whether the connection may be reused."""
    encoding = headers.get("transfer-encoding")
    length = headers.get("content-length")
    if status in (204, 304):
        return _DONE, 0, True
    if encoding is not None:
        if encoding.lower() != "chunked":
            raise HopProtocolError(f"an unsupported transfer encoding ({encoding})")
        # Both: chunked wins, and the connection is not reused (RFC 9112 6.3).
        return _CHUNK_SIZE, 0, length is None
    if length is not None:
        if not (len(length) <= _MAX_LENGTH_DIGITS and length.isascii() and length.isdigit()):
            raise HopProtocolError("a malformed Content-Length")
        remaining = int(length)
        return (_LENGTH if remaining else _DONE), remaining, True
    return _UNTIL_CLOSE, 0, False


def _chunk_size(line: bytes) -> int:
    """A chunk-size line's size: 1 to 16 hex digits, extensions ignored (RFC 9112 7.1.1)."""
    digits, semi, extensions = line.partition(b";")
    if semi:
        if b"\r" in extensions or b"\n" in extensions:
            raise HopProtocolError("a CR or LF alone in a chunk line")
        digits = digits.rstrip(b" \t")
    if _HEX_SIZE.fullmatch(digits) is None:  # int(, 16) alone takes signs, "0x", "_" and spaces
        raise HopProtocolError("a malformed chunk size")
    return int(digits, 16)


class _Answer(asyncio.Protocol):
    """One answer at a time: its head, and its body queued as slices of the reads, within ``limits``."""

    def __init__(self, limits: AnswerLimits | None = None) -> None:
        self.transport: asyncio.Transport | None = None
        self.limits = limits if limits is not None else AnswerLimits()
        self._pending = b""
        self._state = _DONE
        self._remaining = 0
        self._keep_alive = True
        self.head: tuple[int, dict[str, str]] | None = None
        self._body: deque[bytes] = deque()
        self._buffered = 0
        self._reading_paused = False
        self._seen: dict[bytes, tuple[str, str]] = {}
        self._stream = False
        self._head_left = self.limits.head
        self._body_left = _UNBOUNDED

    def begin_answer(self, *, stream: bool) -> None:
        """A new answer is due; ``stream``: a 2xx body is taken as it arrives (not bounded)."""
        self._state = _HEAD
        self.head = None
        self._pending = b""
        self._stream = stream
        self._head_left = self.limits.head

    # Parsing: one step per ``_state``; a step reads ``data`` from ``pos`` and returns where it
    # stopped (``end`` once it kept an unfinished line in ``_pending``).

    def _feed(self, data: bytes) -> None:
        if self._pending:
            data, self._pending = self._pending + data, b""
        pos, end = 0, len(data)
        steps = self._STEPS
        while pos < end:
            pos = steps[self._state](self, data, pos, end)

    def _on_head(self, data: bytes, pos: int, end: int) -> int:
        """The status line and headers, refused as soon as they pass the limit or hold a bad byte."""
        mark = data.find(b"\r\n\r\n", pos)
        if mark < 0:
            if end - pos > self._head_left:
                raise HopTooLarge("head", self.limits.head)
            part = data[pos:end - 1] if data[end - 1] == 0x0D else data[pos:]
            found = _BAD_HEAD.search(part)
            if found is not None:
                raise _bad_head(found)
            self._pending = data[pos:]
            return end
        size = mark + 4 - pos
        if size > self._head_left:
            raise HopTooLarge("head", self.limits.head)
        self._head_left -= size
        self._parse_head(data[pos:mark])
        return mark + 4

    def _on_counted(self, data: bytes, pos: int, end: int) -> int:
        """Body bytes of a known count (Content-Length, or a chunk that did not arrive whole)."""
        take = min(self._remaining, end - pos)
        self._push(data if pos == 0 and take == end else data[pos:pos + take])
        self._remaining -= take
        if self._remaining == 0:
            self._state = _DONE if self._state == _LENGTH else _CHUNK_END
        return pos + take

    def _on_until_close(self, data: bytes, pos: int, end: int) -> int:
        n = end - pos
        if n > self._body_left:
            raise self._too_large()
        self._body_left -= n
        self._push(data if pos == 0 else data[pos:])
        return end

    def _line_end(self, data: bytes, pos: int, end: int) -> int:
        """Where the chunk line at ``pos`` ends (its CR), or -1 until it has all arrived; a CR or
        LF alone in it is an error at once."""
        nl = data.find(b"\n", pos)
        if nl < 0:
            if data.find(b"\r", pos, end - 1) >= 0:
                raise HopProtocolError("a CR or LF alone in a chunk line")
            if end - pos > _MAX_CHUNK_LINE:
                raise HopProtocolError("a chunk header longer than 4 KiB")
            self._pending = data[pos:]
            return -1
        if nl == pos or data[nl - 1] != 0x0D or data.find(b"\r", pos, nl - 1) >= 0:
            raise HopProtocolError("a CR or LF alone in a chunk line")
        return nl - 1

    def _on_chunk_size(self, data: bytes, pos: int, end: int) -> int:
        """A chunk's size line, and every whole chunk after it in this read (one call per read on
        the streaming path). A chunk past the body's limit is refused before its data is held."""
        body = self._body
        taken = 0
        left = self._body_left
        try:
            while pos < end:
                nl = data.find(b"\r\n", pos)  # _line_end inlined: this runs once per streamed event
                if nl < 0:
                    self._line_end(data, pos, end)  # kept for the next read, or a CR or LF alone
                    return end
                line = data[pos:nl]
                size = int(line, 16) if _HEX_SIZE.fullmatch(line) is not None else _chunk_size(line)
                pos = nl + 2
                if size == 0:
                    self._state = _TRAILER
                    return pos
                left -= size
                if left < 0:
                    raise self._too_large()
                stop = pos + size
                if data[stop:stop + 2] != b"\r\n":
                    self._state, self._remaining = _CHUNK_DATA, size
                    return pos
                body.append(data[pos:stop])
                taken += size
                pos = stop + 2
            return pos
        finally:
            self._body_left = left
            if taken:
                self._queued(taken)

    def _on_chunk_end(self, data: bytes, pos: int, end: int) -> int:
        nl = self._line_end(data, pos, end)
        if nl < 0:
            return end
        if nl != pos:
            raise HopProtocolError("chunk data longer than its declared size")
        self._state = _CHUNK_SIZE
        return nl + 2

    def _on_trailer(self, data: bytes, pos: int, end: int) -> int:
        """The trailer after the last chunk (fields ignored), counted against the head's limit."""
        nl = self._line_end(data, pos, end)
        if nl < 0:
            if end - pos > self._head_left:
                raise HopTooLarge("head", self.limits.head)
            return end
        self._head_left -= nl + 2 - pos
        if self._head_left < 0:
            raise HopTooLarge("head", self.limits.head)
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

    def _parse_head(self, head: bytes) -> None:
        found = _BAD_HEAD.search(head)
        if found is not None:
            raise _bad_head(found)
        lines = head.split(b"\r\n")
        status, version = _status_line(lines[0])
        if 100 <= status < 200:
            return  # an interim answer (100 Continue): the real one follows
        headers = _header_lines(lines[1:], self._seen)
        if version == b"HTTP/1.0" or "close" in headers.get("connection", "").lower():
            self._keep_alive = False
        self._state, self._remaining, reusable = _body_framing(status, headers)
        if not reusable:
            self._keep_alive = False
        ok = 200 <= status < 300
        bounded = not (ok and self._stream)
        self._body_left = (self.limits.body if ok else self.limits.error) if bounded else _UNBOUNDED
        if self._state == _LENGTH and self._remaining > self._body_left:
            raise self._too_large(ok)
        self.head = (status, headers)

    def _too_large(self, ok: bool | None = None) -> HopTooLarge:
        """A body past its limit (``ok``: a 2xx answer's; None: this answer's)."""
        if ok is None:
            ok = self.head is not None and 200 <= self.head[0] < 300
        return HopTooLarge("body", self.limits.body) if ok else HopTooLarge("error", self.limits.error)

    def _push(self, chunk: bytes) -> None:
        self._body.append(chunk)
        self._queued(len(chunk))

    def _queued(self, n: int) -> None:
        """``n`` more body bytes queued: past ``_READ_PAUSE`` unread, reading pauses."""
        self._buffered += n
        if self._buffered > _READ_PAUSE and not self._reading_paused and self.transport is not None:
            self._reading_paused = True
            self.transport.pause_reading()


__all__ = ["AnswerLimits", "HopDisconnected", "HopProtocolError", "HopTooLarge"]
