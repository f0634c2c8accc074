"""Server-sent events: an incremental reader correct for any split of the bytes, and writers.

The reader re-emits whole events. Each event keeps its raw bytes (normalized to ``\\n`` line
ends and a ``\\n\\n`` terminator), so the relay can forward it untouched, plus the value of its
``data`` field. Events without a ``data`` field (comments only) are not dispatched, as in the
SSE specification.
"""

from __future__ import annotations

from typing import NamedTuple

DONE_DATA = b"[DONE]"
DONE_EVENT = b"data: [DONE]\n\n"


class Event(NamedTuple):
    raw: bytes
    """The whole event including its terminating blank line."""
    data: bytes


class SSEReader:
    """Feed bytes as they arrive; get back the events they complete."""

    __slots__ = ("_buf",)

    def __init__(self) -> None:
        self._buf = b""

    @property
    def pending(self) -> bytes:
        """Bytes of an event not yet terminated (non-empty at the end = a truncated stream)."""
        return self._buf

    def feed(self, chunk: bytes) -> list[Event]:
        buf = self._buf + chunk if self._buf else chunk
        if b"\r" in buf:
            # Normalize CRLF / CR line ends; a trailing CR may be the first half of a CRLF.
            tail = b""
            if buf.endswith(b"\r"):
                buf, tail = buf[:-1], b"\r"
            buf = buf.replace(b"\r\n", b"\n").replace(b"\r", b"\n") + tail
        events: list[Event] = []
        start = 0
        while True:
            end = buf.find(b"\n\n", start)
            if end < 0:
                break
            raw = buf[start : end + 2]
            start = end + 2
            data = _data_of(raw)
            if data is not None:
                events.append(Event(raw, data))
        self._buf = buf[start:]
        return events


def _data_of(raw: bytes) -> bytes | None:
    """The ``data`` field of one event (``raw`` ends with a blank line)."""
    body = raw[:-2]
    if body.startswith(b"data: ") and b"\n" not in body:
        return body[6:]
    parts: list[bytes] = []
    for line in body.split(b"\n"):
        if line.startswith(b"data:"):
            value = line[5:]
            parts.append(value[1:] if value.startswith(b" ") else value)
        elif line == b"data":
            parts.append(b"")
    if not parts:
        return None
    return b"\n".join(parts)


def data_event(data: bytes) -> bytes:
    return b"data: " + data + b"\n\n"


def comment_event(text: str) -> bytes:
    return b": " + text.encode() + b"\n\n"
