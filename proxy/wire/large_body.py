"""Large generate bodies parsed without stalling the loop: ``token_ids`` read in slices and kept
packed. Anything this path cannot answer exactly as ``protocol.parse_generate_body`` goes to it."""

from __future__ import annotations

import asyncio
import secrets
from array import array
from collections.abc import Iterator, Sequence
from typing import Any, overload

import pydantic_core
from pydantic import ValidationError

from proxy.wire.protocol import GenerateRequest, JSONBodyError, loads_bounded, parse_generate_body
from proxy.wire.validation_errors import VLLMValidationError

LARGE_BODY_BYTES = 1 << 20
"""Bodies above this size go through ``parse_large_generate_body``."""
SLICE_BYTES = 32 << 10
"""About this much of the array's text is parsed between two turns of the loop."""

_IDS_KEY = b'"token_ids"'
_WS = b" \t\n\r"
_PLAIN = b"0123456789," + _WS
"""What an array of non-negative ints (and nothing else) is written with."""
Buffer = bytes | bytearray


class PackedTokenIds(Sequence[int]):
    """A large prompt's token ids, packed, with the client's text of the array. Never mutated."""

    __slots__ = ("_ids", "_text")

    def __init__(self, ids: array[int], text: bytes | memoryview) -> None:
        self._ids = ids
        self._text = text

    def __len__(self) -> int:
        return len(self._ids)

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> list[int]: ...
    def __getitem__(self, index: int | slice) -> int | list[int]:
        if isinstance(index, slice):
            return self._ids[index].tolist()
        return self._ids[index]

    def __iter__(self) -> Iterator[int]:
        return iter(self._ids)

    def json(self) -> bytes | memoryview:
        """The array's text (a view of the client's body)."""
        return self._text

    def __repr__(self) -> str:
        return f"PackedTokenIds(<{len(self._ids)} ids>)"


def prompt_too_long(limit: int, count: int) -> VLLMValidationError:
    """The 400 for a prompt of ``count`` tokens, more than ``limit``."""
    return VLLMValidationError(
        f"token_ids must have at most {limit} tokens (this server's limit), got {count}.",
        parameter="token_ids")


async def parse_large_generate_body(
        body: Buffer, content_type: str, *, max_tokens: int | None = None,
        slice_bytes: int = SLICE_BYTES) -> tuple[GenerateRequest, dict[str, Any]]:
    """``protocol.parse_generate_body`` for a large body, yielding between slices: the same
    request or error in every case; a prompt over ``max_tokens`` gets ``prompt_too_long``."""
    sliced = await _sliced(body, content_type, max_tokens, slice_bytes)
    if sliced is None:
        return parse_generate_body(bytes(body), content_type)  # decided in one go
    return sliced


async def _sliced(body: Buffer, content_type: str, max_tokens: int | None,
                  slice_bytes: int) -> tuple[GenerateRequest, dict[str, Any]] | None:
    """The body parsed around its sliced ``token_ids``; None where that cannot answer exactly."""
    if content_type.lower().split(";", maxsplit=1)[0].strip() != "application/json":
        return None
    span = _ids_span(body)
    if span is None or span[1] - span[0] < 2 * slice_bytes:
        return None  # its bulk is elsewhere
    start, end = span
    rest_data = _parse_rest(body, start, end)
    if rest_data is None:
        return None
    req = _validated_rest(rest_data)
    if req is None:
        return None
    await asyncio.sleep(0)
    ids = await _read_ids(body, start + 1, end - 1, slice_bytes, max_tokens)
    if ids is None:
        return None
    if max_tokens is not None and ids.count > max_tokens:
        raise prompt_too_long(max_tokens, ids.count)  # as the proxy's check after the model's
    token_ids = PackedTokenIds(ids.ids, memoryview(body)[start:end])
    rest_data["token_ids"] = token_ids
    req.__dict__["token_ids"] = token_ids  # validated slice by slice
    return req, rest_data


def _ids_span(body: Buffer) -> tuple[int, int] | None:
    """``(start, end)`` of the largest ``"token_ids": [...]`` array among the first few, or None.
    Only a candidate: ``_parse_rest`` checks that it is the body's own."""
    best: tuple[int, int] | None = None
    at = body.find(_IDS_KEY)
    seen = 0
    while at >= 0 and seen < 8:
        seen += 1
        i = at + len(_IDS_KEY)
        while i < len(body) and body[i] in _WS:
            i += 1
        if i < len(body) and body[i] == 0x3A:  # ':'
            i += 1
            while i < len(body) and body[i] in _WS:
                i += 1
            if i < len(body) and body[i] == 0x5B:  # '['
                close = body.find(b"]", i)
                if close > 0 and (best is None or close + 1 - i > best[1] - best[0]):
                    best = (i, close + 1)
                if close > 0:
                    at = body.find(_IDS_KEY, close)  # no key inside a flat array: skip its text
                    continue
        at = body.find(_IDS_KEY, at + 1)
    return best


def _parse_rest(body: Buffer, start: int, end: int) -> dict[str, Any] | None:
    """The body parsed with a random placeholder for ``body[start:end]``, if it is ``token_ids``."""
    sentinel = b'"pd-token-ids-' + secrets.token_hex(16).encode() + b'"'
    try:
        rest_data = loads_bounded(bytes(body[:start] + sentinel + body[end:]))
    except JSONBodyError:
        return None
    if not isinstance(rest_data, dict) or rest_data.get("token_ids") != sentinel[1:-1].decode():
        return None
    return rest_data


class _Ids:
    """The array's ids as the slices are read: packed while within the cap, then only counted."""

    def __init__(self) -> None:
        self.ids: array[int] = array("q")
        self.count = 0


async def _read_ids(body: Buffer, lo: int, hi: int, slice_bytes: int, max_tokens: int | None) -> _Ids | None:
    """The ids of ``body[lo:hi]`` read slice by slice; None unless plain ints in [0, 2**63)."""
    ids = _Ids()
    a = lo
    while True:
        cut = _next_cut(body, a, hi, slice_bytes)
        b = hi if cut < 0 else cut
        packed = _slice_ids(body[a:b], slice_bytes, whole=a == lo and b == hi)
        if packed is None:
            return None
        ids.count += len(packed)
        if max_tokens is None or ids.count <= max_tokens:
            ids.ids += packed
        elif ids.ids:
            ids.ids = array("q")  # over the cap: counted only
        if cut < 0:
            return ids if ids.count else None
        a = cut + 1
        await asyncio.sleep(0)


def _next_cut(body: Buffer, a: int, hi: int, slice_bytes: int) -> int:
    """Where the slice from ``a`` ends: the first comma past ``slice_bytes``, -1 for the end. A
    slice longer than twice ``slice_bytes`` holds no comma."""
    cut = body.find(b",", a + slice_bytes, hi) if a + slice_bytes < hi else -1
    if (cut if cut >= 0 else hi) - a > 2 * slice_bytes:
        back = body.rfind(b",", a, a + slice_bytes)
        if back >= 0:
            cut = back
    return cut


def _slice_ids(piece: Buffer, slice_bytes: int, *, whole: bool) -> array[int] | None:
    """The ids of one slice, packed; None unless ints in [0, 2**63) in valid JSON."""
    if piece.translate(None, _PLAIN):
        return None
    if len(piece) > 2 * slice_bytes:
        # No comma in it: blanks around one value, or an error.
        parts = piece.split(None, 1)
        if len(parts) > 1:
            return None
        piece = parts[0] if parts else b""
    if not whole and not piece.strip(_WS):
        return None  # ``1,,2``, ``[,1]`` or ``[1,]``: a value missing
    try:
        return array("q", pydantic_core.from_json(b"[" + piece + b"]"))
    except (ValueError, OverflowError):
        return None


def _validated_rest(rest_data: dict[str, Any]) -> GenerateRequest | None:
    """The request validated with ``[0]`` for the ids (valid ids pass whatever the rest holds)."""
    rest_data["token_ids"] = [0]
    try:
        return GenerateRequest.model_validate(rest_data)
    except (ValidationError, VLLMValidationError):
        return None


__all__ = ["LARGE_BODY_BYTES", "SLICE_BYTES", "PackedTokenIds", "parse_large_generate_body",
           "prompt_too_long"]
