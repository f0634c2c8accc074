"""Generate bodies validated before, known again by their bytes: the parse and the model
validation skipped for a body that differs from one that passed only in its prompt's token ids
(and its ``request_id``).

Clients send the same request shape again and again: the same sampling parameters, output mode
and stream flag around a new prompt. A body is cut at the value of its top-level ``token_ids``
(and of a top-level ``request_id`` written as a plain string); what is left, with the content type,
is the key. A body whose key is known is one whose JSON differs from a body that passed every
check only in those values, so it passes the same checks: its parse is the known body's parse with
those two values replaced, and its model the known model with the same two fields replaced. So
``get`` answers with copies of the known ones (the token ids parsed from their own text, by the
JSON parser), and the checks that depend on the ids (their number) are the caller's, run for every
body.

What makes the replacement exact:

* a key is cut only where its one occurrence in the body is that top-level key: the body has no
  ``\\u`` escape and the key's quoted name once (``protocol.unique_key_end``: a quote inside a
  JSON string is escaped, so no other text of the body can be it), and the known body's parse
  has that top-level key (``token_ids`` is required; ``request_id`` is checked when it is added);
* a value is cut only when it is of a form whose every instance passes where the known one did:
  ``token_ids`` an array of digits, commas and spaces that the JSON parser reads as one or more
  integers (non-negative, none a float, a string or a bool: ``list[int]``, at least one, its
  validator's ``min >= 0``), ``request_id`` a string of printable ASCII without a quote or a
  backslash (``str``; no escape, no surrogate, nothing for the body checks to refuse);
* nothing else in the body differs (the rest of its bytes are the key), so its depth, its other
  keys and values, the client transfer-parameter check, the cross-field checks (``output_mode``
  and ``detokenize``, ``SamplingParams``) give what they gave.

Only successes are kept: an error is always answered by the full path, byte for byte vLLM's. The
known parses are shared by the requests that hit them, read-only: the walk copies a body before it
changes one (``kv_transfer.handoff``, the first-token seed, migration); each request gets its own
top-level dict and model. Bounded: ``size`` keys of at most ``max_key`` bytes (all dropped when
a new one finds them full), each kept without the ids it came with; a body over ``max_key`` once
cut is never kept.
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
"""What the array may hold (the JSON parser says if it is an array of integers): checked by
deleting them (``bytes.translate``, 0.5 ms at 1 MiB; a regex took 3.9)."""
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
    """The validated parses of recent bodies, by their keys (``cut``). Clients whose bodies
    differ in more than their ids (a seed or a length per request) would pay for the cut and
    gain nothing: after ``size`` misses in a row only one body in ``_RESTING_EVERY`` is cut (and
    kept when it passes), until one of them is known again."""

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
        """The model and parse of the body ``probe`` was cut from (``parse_generate_body``'s, with
        ``data["token_ids"]`` a ``TokenIds`` carrying the body's own text), or None when its key
        is not known or its ids are not what they must be (the full path answers it)."""
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
            known.clear()  # shapes come back in one request each: cheaper than an order kept
        # Kept without the ids (each hit brings its own): an entry's size is its key's order.
        kept = req.__copy__()
        kept.__dict__["token_ids"] = []
        template = dict(data)
        template["token_ids"] = None
        known[key] = (kept, template)
