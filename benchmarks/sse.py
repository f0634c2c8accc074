"""Incremental Server-Sent Events decoder (WHATWG "event stream interpretation").

Bytes are fed as they arrive, split anywhere (inside a line, between ``\\r`` and ``\\n``, inside
a multi-byte UTF-8 character); complete events come out. Only what pd-bench needs is kept: the
``data`` field (multi-line data joined by ``\\n``) and comment lines (``: ...``), which pd-proxy
uses for its opt-in ``server-timing`` report. ``event``/``id``/``retry`` fields are accepted and
ignored. Written here rather than taken from a library because the available SSE clients own
the HTTP request themselves and hide the chunk arrival times that the metrics are built on.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SSEEvent:
    """One dispatched event: its data (``None`` for a comment) or a comment's text."""

    data: str | None
    comment: str | None = None


class SSEDecoder:
    """Feed bytes with :meth:`feed`; it returns the events completed by those bytes."""

    __slots__ = ("_buf", "_data", "_has_data", "_pending_cr")

    def __init__(self) -> None:
        self._buf = bytearray()
        self._data: list[str] = []
        self._has_data = False
        self._pending_cr = False

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        out: list[SSEEvent] = []
        if not chunk:
            return out
        if self._pending_cr:
            # A CR ended the previous chunk: a LF right after it belongs to the same line end.
            self._pending_cr = False
            if chunk[:1] == b"\n":
                chunk = chunk[1:]
        self._buf += chunk
        buf = self._buf
        start = 0
        n = len(buf)
        while start < n:
            lf = buf.find(b"\n", start)
            cr = buf.find(b"\r", start)
            if lf < 0 and cr < 0:
                break
            if cr < 0 or (0 <= lf < cr):
                end, nxt = lf, lf + 1
            else:
                end = cr
                if cr + 1 < n:
                    nxt = cr + 2 if buf[cr + 1] == 0x0A else cr + 1
                else:
                    nxt = cr + 1
                    self._pending_cr = True
            line = bytes(buf[start:end]).decode("utf-8", errors="replace")
            start = nxt
            ev = self._line(line)
            if ev is not None:
                out.append(ev)
        del buf[:start]
        return out

    def _line(self, line: str) -> SSEEvent | None:
        if not line:
            if not self._has_data:
                return None
            data = "\n".join(self._data)
            self._data = []
            self._has_data = False
            return SSEEvent(data=data)
        if line.startswith(":"):
            text = line[1:]
            return SSEEvent(data=None, comment=text[1:] if text.startswith(" ") else text)
        field, sep, value = line.partition(":")
        if sep and value.startswith(" "):
            value = value[1:]
        if field == "data":
            self._data.append(value)
            self._has_data = True
        return None

    @property
    def has_partial(self) -> bool:
        """True when bytes of an unfinished event are buffered (a stream cut mid-event)."""
        return bool(self._buf) or self._has_data
