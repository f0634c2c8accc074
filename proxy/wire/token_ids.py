"""A prompt's token ids as they travel: their JSON text made once, spliced into both hop bodies."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from proxy.wire.large_body import PackedTokenIds
from proxy.wire.protocol import hop_json, unique_key_end

_IDS_KEY = b'"token_ids"'
_IDS_OPEN = re.compile(rb"\s*:\s*\[")
"""What follows the key: the colon and an array's start."""


def ids_span(body: bytes) -> tuple[int, int] | None:
    """``[`` to past the first ``]`` of the one ``token_ids`` key's array, or None when the key
    cannot be told apart for certain (``protocol.unique_key_end``) or no array follows it."""
    end = unique_key_end(body, _IDS_KEY)
    found = _IDS_OPEN.match(body, end) if end is not None else None
    if found is None:
        return None
    close = body.find(b"]", found.end())
    return None if close < 0 else (found.end() - 1, close + 1)


def ids_text(body: bytes) -> bytes | None:
    """The text of the top-level ``token_ids`` array of a validated body, or None."""
    span = ids_span(body)
    return body[span[0]:span[1]] if span is not None else None


class TokenIds(list[int]):
    """A prompt's token ids with their JSON text made once (or the client's own ``text``) for both
    hop bodies. Never mutated once made."""

    __slots__ = ("_json",)

    def __init__(self, ids: Iterable[int], text: bytes | None = None) -> None:
        super().__init__(ids)
        self._json: bytes | None = text

    def json(self) -> bytes:
        if self._json is None:
            self._json = hop_json(self)
        return self._json


def encode_body(body: dict[str, Any]) -> bytes:
    """A hop body as JSON, ``TokenIds`` or ``PackedTokenIds`` spliced in from their cached text."""
    ids: TokenIds | PackedTokenIds | None = body.get("token_ids")
    kind = type(ids)
    if ids is None or (kind is not TokenIds and kind is not PackedTokenIds):
        return hop_json(body)
    rest = dict(body)
    del rest["token_ids"]
    return b"".join((hop_json(rest)[:-1], b',"token_ids":' if rest else b'"token_ids":', ids.json(), b"}"))
