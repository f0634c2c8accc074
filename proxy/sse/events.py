"""Server-sent events: an incremental reader correct for any split of the bytes, and writers.
Events keep their raw bytes (``\\n``-normalized) for forwarding; a *plain* ``Batch`` (what vLLM
sends) is forwarded as one block, anything else event by event with the same result.
"""

from __future__ import annotations

from typing import NamedTuple

DONE_DATA = b"[DONE]"
DONE_EVENT = b"data: [DONE]\n\n"
_DATA = b"data: "
_NEXT_DATA = b"\n\ndata: "
_ERROR_EVENT = b'data: {"error"'


class Event(NamedTuple):
    raw: bytes
    """The whole event including its terminating blank line."""
    data: bytes


class Batch:
    """The whole events completed by one ``feed_batch`` call. ``plain``: only single-line ``data: ``
    events, no in-band error, ``[DONE]`` at most last (then ``body`` is ``raw`` without it)."""

    __slots__ = ("body", "done", "plain", "raw")

    def __init__(self, raw: bytes, *, plain: bool, done: bool = False) -> None:
        self.raw = raw
        self.plain = plain
        self.done = done
        self.body = raw[: -len(DONE_EVENT)] if done else raw

    def events(self) -> list[Event]:
        """The events with a ``data`` field, in order (as ``SSEReader.feed`` returns them)."""
        return split_events(self.raw)

    def split_first(self) -> tuple[Batch, Batch] | None:
        """A plain batch of two or more events (``[DONE]`` aside) split after its first event."""
        if not self.plain:
            return None
        end = self.body.find(b"\n\n") + 2
        if end <= 1 or end == len(self.body):
            return None
        return Batch(self.body[:end], plain=True), Batch(self.raw[end:], plain=True, done=self.done)


_EMPTY = Batch(b"", plain=True)


class SSEReader:
    """Feed bytes as they arrive; get back the events they complete."""

    __slots__ = ("pending",)

    def __init__(self) -> None:
        self.pending = b""
        """Bytes of an event not yet terminated (non-empty at the end = a truncated stream)."""

    def feed(self, chunk: bytes) -> list[Event]:
        return self.feed_batch(chunk).events()

    def feed_batch(self, chunk: bytes) -> Batch:
        """Every whole event these bytes complete, as one ``Batch`` (possibly empty)."""
        buf = self.pending + chunk if self.pending else chunk
        if b"\r" in buf:
            # Normalize CRLF / CR line ends; a trailing CR may be the first half of a CRLF.
            tail = b""
            if buf.endswith(b"\r"):
                buf, tail = buf[:-1], b"\r"
            buf = buf.replace(b"\r\n", b"\n").replace(b"\r", b"\n") + tail
        end = buf.rfind(b"\n\n")
        if end < 0:
            self.pending = buf
            return _EMPTY
        raw = buf[: end + 2]
        n = raw.count(b"\n\n")
        if raw.startswith(_DATA) and raw.count(b"\n") == 2 * n and raw.count(_NEXT_DATA) == n - 1 \
                and _ERROR_EVENT not in raw:
            # Every line break is an event end, every event one data line.
            self.pending = buf[end + 2 :]
            at = raw.find(DONE_EVENT)
            if at < 0:
                return Batch(raw, plain=True)
            if at + len(DONE_EVENT) == len(raw) and (at == 0 or raw[at - 1] == 0x0A):
                return Batch(raw, plain=True, done=True)
        # Anything else: event boundaries from a scan from the start.
        cut = _scan_end(buf)
        self.pending = buf[cut:]
        return Batch(buf[:cut], plain=False)


def _scan_end(buf: bytes) -> int:
    start = 0
    while True:
        end = buf.find(b"\n\n", start)
        if end < 0:
            return start
        start = end + 2


def split_events(raw: bytes) -> list[Event]:
    """The events with a ``data`` field in ``raw`` (whole, ``\\n``-normalized events)."""
    events: list[Event] = []
    start = 0
    while True:
        end = raw.find(b"\n\n", start)
        if end < 0:
            break
        one = raw[start : end + 2]
        start = end + 2
        data = _data_of(one)
        if data is not None:
            events.append(Event(one, data))
    return events


def last_data(body: bytes) -> bytes:
    """The ``data`` of the last event of a plain batch's ``body`` (``b""`` when empty)."""
    if not body:
        return b""
    at = body.rfind(_NEXT_DATA, 0, len(body) - 2)
    return body[at + len(_NEXT_DATA) : -2] if at >= 0 else body[len(_DATA) : -2]


def _data_of(raw: bytes) -> bytes | None:
    """The ``data`` field of one event (``raw`` ends with a blank line)."""
    body = raw[:-2]
    if body.startswith(_DATA) and b"\n" not in body:
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
