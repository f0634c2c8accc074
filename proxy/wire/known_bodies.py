"""Generate bodies that differ from one that passed validation only in their top-level
``token_ids`` (and a plain-string ``request_id``) reuse its parse and model, those values replaced.

Exact because: a key is cut only where its one occurrence is the top-level key
(``protocol.unique_key_end``); a value is cut only in a form every instance of which passes
(ids: digits, commas and spaces parsing to one or more ints; request id: printable ASCII without
quote or backslash); every other byte is the cache key. Only successes are kept; known parses are
shared read-only (callers copy before changing a body). Bounded by ``size`` and ``max_key``.
"""

from __future__ import annotations

import re
from typing import Any, Final

import pydantic_core

from proxy.wire.protocol import GenerateRequest, unique_key_end
from proxy.wire.token_ids import TokenIds, ids_span

_WS: Final = rb"[ \t\n\r]*"  # JSON's whitespace
_RID_KEY: Final = b'"request_id"'
_IDS_CHARS: Final = b"0123456789, "
"""What the array may hold (the JSON parser then says if it is an array of integers)."""
_RID_AT: Final = re.compile(_WS + b":" + _WS + rb'("[\x20\x21\x23-\x5b\x5d-\x7e]*")')
"""After the key: a string of printable ASCII without a quote or a backslash."""

_Key = tuple[str, int, int, bytes]
"""The content type, the lengths of the body's first two pieces, the pieces joined."""
Probe = tuple[_Key, bytes, bytes | None]
"""A body's key, its token ids' text, its request id's text (None: not cut)."""


def cut(body: bytes, content_type: str) -> Probe | None:
    """``body``'s probe, or None when its token ids cannot be cut."""
    span = ids_span(body)  # the one "token_ids" key's array, to its first "]"
    if span is None:
        return None
    a, b = span
    if body[a + 1:b - 1].translate(None, _IDS_CHARS):
        return None
    ids_text = body[a:b]
    rid = None
    if _RID_KEY in body:
        rid_end = unique_key_end(body, _RID_KEY)
        rid = _RID_AT.match(body, rid_end) if rid_end is not None else None
    if rid is None:
        return (content_type, a, -1, body[:a] + body[b:]), ids_text, None
    c, d = rid.span(1)
    if c < a:
        a, b, c, d = c, d, a, b
    return (content_type, a, c - b, b"".join((body[:a], body[b:c], body[d:]))), ids_text, rid.group(1)


_RESTING_EVERY = 16
"""While no known shape comes back, one body in this many is cut."""


class KnownBodies:
    """The validated parses of recent bodies, by their keys (``cut``); after ``size`` misses in a
    row only one body in ``_RESTING_EVERY`` is cut, until one is known again."""

    def __init__(self, size: int = 256, max_key: int = 4096) -> None:
        self.size, self.max_key = size, max_key
        self._known: dict[_Key, tuple[GenerateRequest, dict[str, Any]]] = {}
        self._misses = 0
        self._skipped = 0

    def __len__(self) -> int:
        return len(self._known)

    def probe(self, body: bytes, content_type: str) -> Probe | None:
        """``cut(body, content_type)``, or None for a body not looked up (resting)."""
        if self._misses >= self.size:
            self._skipped += 1
            if self._skipped < _RESTING_EVERY:
                return None
            self._skipped = 0
        return cut(body, content_type)

    def get(self, probe: Probe) -> tuple[GenerateRequest, dict[str, Any]] | None:
        """``parse_generate_body``'s answer for the body ``probe`` was cut from, or None."""
        key, ids_text, rid_text = probe
        known = self._known.get(key)
        if known is None:
            self._misses += 1
            return None
        self._misses = 0
        try:
            ids = pydantic_core.from_json(ids_text)
        except ValueError:  # not JSON (``[1,,2]``, ``[01]``)
            return None
        if not ids:
            return None
        req = known[0].__copy__()
        req.__dict__["token_ids"] = ids
        data = dict(known[1])
        data["token_ids"] = TokenIds(ids, ids_text)
        if rid_text is not None:
            req.__dict__["request_id"] = data["request_id"] = rid_text[1:-1].decode("ascii")
        return req, data

    def add(self, probe: Probe, req: GenerateRequest, data: dict[str, Any]) -> None:
        """Keep the model and parse of the body ``probe`` was cut from, which passed every check."""
        key, _, rid_text = probe
        if len(key[3]) > self.max_key:
            return
        if rid_text is not None and data.get("request_id") != rid_text[1:-1].decode("ascii"):
            return  # the one "request_id" of the text is not the top-level key's
        known = self._known
        if len(known) >= self.size and key not in known:
            known.clear()
        kept = req.__copy__()
        kept.__dict__["token_ids"] = []
        template = dict(data)
        template["token_ids"] = None
        known[key] = (kept, template)
