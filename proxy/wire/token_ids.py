"""A hop body as JSON: a large body's packed token ids (``PackedTokenIds``) spliced in from their
own text, every other body encoded whole."""

from __future__ import annotations

from typing import Any

from proxy.wire.large_body import PackedTokenIds
from proxy.wire.protocol import hop_json


def encode_body(body: dict[str, Any]) -> bytes:
    """A hop body as JSON, ``PackedTokenIds`` spliced in from their text (they are no list)."""
    ids = body.get("token_ids")
    if type(ids) is not PackedTokenIds:
        return hop_json(body)
    rest = dict(body)
    del rest["token_ids"]
    return b"".join((hop_json(rest)[:-1], b',"token_ids":' if rest else b'"token_ids":', ids.json(), b"}"))
