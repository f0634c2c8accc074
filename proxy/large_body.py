"""Large generate bodies, parsed without stalling the event loop for the other streams.

``json.loads`` and pydantic's validation run in C/Rust without a break: a 16 MiB body of prompt
token ids held the loop for 300-900 ms on an idle 2-core VM (every stream of the process stood
still), and the list of a million ``int`` objects it made cost more when collected and freed. A body
over ``LARGE_BODY_BYTES`` whose bulk is its ``token_ids`` array is parsed here instead:

* the array's text is found with byte searches (no regex pass over the body), and cut out: the
  rest of the body (everything else, normally a few hundred bytes) is parsed and validated as
  usual, with a one-id placeholder in its place;
* the array's text is parsed in slices of about ``SLICE_BYTES``, cut at commas, the loop given
  back between slices (about 0.25 ms of CPU each for ids written as 3-digit numbers). A slice
  written only with digits, commas and blanks is plain non-negative ints, read by pydantic-core's
  parser (``json.loads`` only says what is wrong when it fails); any other is read by
  ``json.loads`` and validated element by element as vLLM's model does (``list[int]``, lax), its
  errors' indices shifted to the whole array. A long run with no comma (blanks around one value,
  or values missing their comma) is decided by its first two values, found by ``bytes.split``;
* the ids are kept packed (``PackedTokenIds``: an ``array('q')`` and the array's text, which the
  hop bodies carry as it came), so no million-object list is made, traversed by the collector or
  freed at once, and no ids are encoded again;
* ``max_tokens`` (``--max-prompt-tokens``) is checked as the slices go: a longer prompt is a 400
  as soon as the count passes it, before the rest of the array is parsed.

What the client is told for a bad body is what ``protocol.parse_generate_body`` (vLLM's route)
would say for it: the same JSON error and position, the same validation errors in the same
order, the same precedence (a JSON error anywhere before any validation error; a ``cache_salt``
or ``SamplingParams`` error before the field errors). Two exceptions, both 400s on ``token_ids``:
an array that is not flat or holds strings (vLLM takes numeric strings such as ``"42"``) is
refused, since it cannot be cut safely; an id of 2**63 or more is refused (no vocabulary has it).

A large body whose bulk is elsewhere (not a top-level flat ``token_ids`` array) is parsed in one
go, as before.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from array import array
from collections.abc import Iterator, Sequence
from typing import Any, NoReturn, overload

import pydantic_core
from pydantic import TypeAdapter, ValidationError

from proxy.protocol import GenerateRequest, JSONBodyError, loads_bounded, parse_generate_body
from proxy.validation_errors import RequestValidationError, VLLMValidationError, format_validation_errors

LARGE_BODY_BYTES = 1 << 20
"""Bodies above this size go through ``parse_large_generate_body``."""
SLICE_BYTES = 32 << 10
"""About this much of the array's text is parsed between two turns of the loop (under 1 ms)."""

_IDS_KEY = b'"token_ids"'
_WS = b" \t\n\r"
_PLAIN = b"0123456789," + _WS
"""What an array of non-negative ints (and nothing else) is written with."""
_NOT_FLAT = (b'"', b"[", b"{")
_LIST_INT: TypeAdapter[list[int]] = TypeAdapter(list[int])
_MAX_REPORTED = 10
Buffer = bytes | bytearray
_LateError = tuple[JSONBodyError, int]
"""A JSON error after the array, and its position in the body."""


class PackedTokenIds(Sequence[int]):
    """A large prompt's token ids: packed machine ints, and the array's JSON text as the client
    wrote it (``json``, spliced into the hop bodies as ``upstream.TokenIds`` is). Never mutated."""

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
        """The array's text (a view of the client's body: nothing is copied until a hop body is
        made of it)."""
        return self._text

    def __repr__(self) -> str:
        return f"PackedTokenIds(<{len(self._ids)} ids>)"


def _ids_span(body: Buffer) -> tuple[int, int] | None:
    """``(start, end)`` of the largest ``"token_ids": [ ... ]`` array (``body[start] == b"["``,
    ``body[end - 1] == b"]"``, the first ``]`` after the ``[``); None when there is none."""
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


def _char_pos(body: Buffer, byte_pos: int) -> int:
    """The character position (what ``json.loads`` reports) of ``byte_pos`` in UTF-8 ``body``."""
    return len(body[:byte_pos].decode("utf-8", "surrogatepass"))


def _json_error(e: JSONBodyError, pos: int) -> RequestValidationError:
    return format_validation_errors([{"type": "json_invalid", "loc": ("body", pos),
                                      "msg": "JSON decode error", "input": {}, "ctx": {"error": e.reason}}])


def _not_flat(threshold: int) -> VLLMValidationError:
    return VLLMValidationError(
        f"token_ids must be a flat array of integers (not strings, arrays or objects) in a request "
        f"body over {threshold} bytes", parameter="token_ids")


def prompt_too_long(limit: int, count: int | None = None) -> VLLMValidationError:
    """The 400 for a prompt of more than ``limit`` tokens (``count`` when it is known)."""
    got = f"got {count}" if count is not None else f"got more than {limit}"
    return VLLMValidationError(f"token_ids must have at most {limit} tokens (this server's limit), {got}.",
                               parameter="token_ids")


class _Ids:
    """The array's elements as the slices are parsed: packed ids, or errors (count, first few)."""

    def __init__(self) -> None:
        self.ids: array[int] = array("q")
        self.count = 0
        self.errors: list[dict[str, Any]] = []
        self.error_count = 0
        self.negative = False

    def add(self, values: list[Any], plain: bool, packed: array[int] | None = None) -> None:
        """One slice's values (``packed``: the same, already packed; ``plain``: ints >= 0)."""
        if not plain:
            try:
                values = _LIST_INT.validate_python(values)
            except ValidationError as e:
                errors = e.errors(include_url=False)
                self.error_count += len(errors)
                for err in errors[: max(0, _MAX_REPORTED - len(self.errors))]:
                    index, *inner = err["loc"]
                    self.errors.append({**err, "loc": ("body", "token_ids", int(index) + self.count, *inner)})
                self.count += len(values)
                return
            if values and min(values) < 0:
                self.negative = True
        self.count += len(values)
        if not self.error_count and not self.negative:
            try:
                self.ids += packed if packed is not None else array("q", values)
            except OverflowError:
                raise VLLMValidationError("token ids must be below 2**63", parameter="token_ids") from None


def _ids_error_list(ids: _Ids) -> tuple[list[dict[str, Any]], int]:
    """Errors of the ``token_ids`` field (as pydantic reports them), and their total count."""
    if ids.error_count:
        return ids.errors, ids.error_count
    if ids.negative or ids.count == 0:
        probe: list[int] = [-1] if ids.negative else []
        try:
            GenerateRequest.model_validate({"token_ids": probe, "sampling_params": {}})
        except ValidationError as e:
            err: dict[str, Any] = dict(e.errors(include_url=False)[0])
            err["loc"] = ("body", *tuple(err["loc"]))
            err["input"] = f"<list of {ids.count} items>"
            return [err], 1
    return [], 0


async def parse_large_generate_body(
        body: Buffer, content_type: str, *, max_tokens: int | None = None,
        slice_bytes: int = SLICE_BYTES) -> tuple[GenerateRequest, dict[str, Any]]:
    """``protocol.parse_generate_body`` for a large body, yielding to the loop between slices.
    ``max_tokens``: a prompt longer than this is refused (``VLLMValidationError``, param
    ``token_ids``) as soon as the count passes it. Same results and errors (see the module)."""
    media_type = content_type.lower().split(";", maxsplit=1)[0].strip()
    if media_type != "application/json":
        return parse_generate_body(b"", content_type)  # refused for its media type, as before
    span = _ids_span(body)
    if span is None or span[1] - span[0] < 2 * slice_bytes:
        return parse_generate_body(bytes(body), content_type)  # its bulk is elsewhere: as before
    start, end = span
    rest = _parse_rest(body, start, end)
    if rest is None:
        return parse_generate_body(bytes(body), content_type)
    rest_data, rest_error = rest
    await asyncio.sleep(0)
    cuts = await _cuts(body, start + 1, end - 1, slice_bytes)
    ids = await _read_ids(body, cuts, start + 1, slice_bytes, max_tokens)
    if rest_error is not None:
        raise _json_error(*rest_error)
    return _validated(body, start, end, rest_data, ids)


def _parse_rest(body: Buffer, start: int, end: int) -> tuple[dict[str, Any], _LateError | None] | None:
    """The body with a placeholder in place of its ``token_ids`` array (``body[start:end]``),
    parsed first (it is small): its object, and a JSON error after the array with its position
    in the whole body (reported once the array parsed: an error in it comes first). A JSON error
    before the array is raised (the first one vLLM reports). None when the array is not the
    body's own ``token_ids`` (a nested key, or one spelled with escapes)."""
    sentinel = b'"pd-token-ids-' + secrets.token_hex(8).encode() + b'"'
    rest = body[:start] + sentinel + body[end:]
    try:
        rest_data = loads_bounded(bytes(rest))
    except JSONBodyError as e:
        pos = e.pos
        sentinel_at = _char_pos(rest, start) if pos else 0
        if pos > sentinel_at:
            pos += (end - start) - len(sentinel)  # after the array: the array's text is ASCII
        if pos <= sentinel_at:
            raise _json_error(e, pos) from None
        return {}, (e, pos)
    if not isinstance(rest_data, dict) or rest_data.get("token_ids") != sentinel[1:-1].decode():
        return None
    return rest_data, None


async def _cuts(body: Buffer, lo: int, hi: int, slice_bytes: int) -> list[tuple[int, int]]:
    """The array's text between its brackets (``body[lo:hi]``), cut at commas into slices of
    about ``slice_bytes`` (a comma is never inside a number or a multi-byte character). Checks on
    the way that it can be cut (flat, no strings) and is UTF-8 (vLLM checks the whole body's
    encoding first)."""
    ascii_body = body.isascii()
    cuts: list[tuple[int, int]] = []
    a = lo
    while True:
        cut = _next_cut(body, a, hi, slice_bytes)
        b = hi if cut < 0 else cut
        _check_slice(body, a, b, ascii_body)
        cuts.append((a, b))
        if cut < 0:
            return cuts
        a = cut + 1
        if len(cuts) % 16 == 0:
            await asyncio.sleep(0)


def _next_cut(body: Buffer, a: int, hi: int, slice_bytes: int) -> int:
    """Where the slice from ``a`` ends: the first comma past ``slice_bytes``, -1 for the end."""
    cut = body.find(b",", a + slice_bytes, hi) if a + slice_bytes < hi else -1
    if (cut if cut >= 0 else hi) - a > 2 * slice_bytes:
        # No comma for a long way after this slice: end it at its own last comma, so that the
        # long run becomes a piece of its own, with no comma at all.
        back = body.rfind(b",", a, a + slice_bytes)
        if back >= 0:
            cut = back
    return cut


def _check_slice(body: Buffer, a: int, b: int, ascii_body: bool) -> None:
    if body.find(b'"', a, b) >= 0 or body.find(b"[", a, b) >= 0 or body.find(b"{", a, b) >= 0:
        raise _not_flat(LARGE_BODY_BYTES)
    if not ascii_body and not body[a:b].isascii():
        try:
            body[a:b].decode()
        except UnicodeDecodeError:
            raise _json_error(JSONBodyError("invalid UTF-8"), 0) from None


async def _read_ids(body: Buffer, cuts: list[tuple[int, int]], lo: int, slice_bytes: int,
                    max_tokens: int | None) -> _Ids:
    """The slices parsed one by one, the loop given back between them; the prompt cap checked
    as the count grows."""
    ids = _Ids()
    for i, (a, b) in enumerate(cuts):
        if i:
            await asyncio.sleep(0)
        piece, at, empty = _slice_text(body, a, b, lo, slice_bytes)
        if len(cuts) > 1 and empty:
            # ``1,,2``, ``[,1]`` or ``[1,]``: a value is missing where the next comma (or the
            # closing bracket) stands.
            raise _json_error(JSONBodyError("Expecting value"), _char_at(body, lo, b))
        ids.add(*_slice_values(body, lo, b"" if empty else piece, at))
        if max_tokens is not None and ids.count > max_tokens:
            raise prompt_too_long(max_tokens)
    return ids


def _char_at(body: Buffer, lo: int, byte_pos: int) -> int:
    """The character position of ``byte_pos`` at or after ``lo`` (the array's text is ASCII up
    to an error in it)."""
    return _char_pos(body, lo) - lo + byte_pos


def _slice_text(body: Buffer, a: int, b: int, lo: int, slice_bytes: int) -> tuple[Buffer, int, bool]:
    """The slice ``body[a:b]``'s text to parse, where that text starts in the body, and whether
    it holds no value at all."""
    piece = body[a:b]
    if len(piece) > 2 * slice_bytes and b"\x0b" not in piece and b"\x0c" not in piece:
        # A long piece has no comma (see the cuts): one value among many blanks, or values with
        # no comma between them (an error at the second one). Only what decides it is parsed,
        # the blanks skipped by ``bytes.split`` (``strip`` is ten times slower); the two blanks
        # that it knows and JSON does not (VT, FF) are left to the other branch.
        parts = piece.split(None, 2)
        if len(parts) > 1:
            _raise_for_run(body, lo, piece, a, parts)
        if parts:
            return parts[0], a + piece.find(parts[0]), False
        return piece, a, True
    return piece, a, not piece.strip(_WS)


def _raise_for_run(body: Buffer, lo: int, piece: Buffer, at: int, parts: Sequence[Buffer]) -> NoReturn:
    """The error of a long run with no comma and two values or more (``piece`` at ``at``): the
    first value's own, else the missing comma before the second."""
    first = piece.find(parts[0])
    _loads_slice(body, lo, parts[0], at + first)
    second = piece.find(parts[1], first + len(parts[0]))
    raise _json_error(JSONBodyError("Expecting ',' delimiter"), _char_at(body, lo, at + second))


def _slice_values(body: Buffer, lo: int, piece: Buffer, at: int) -> tuple[list[Any], bool, array[int] | None]:
    """A slice's values, whether it is plain (digits, commas and blanks: ints >= 0), and the
    same packed when they are."""
    plain = not piece.translate(None, _PLAIN)
    if plain:  # pydantic-core's parse, 40% faster than json's
        try:
            values = pydantic_core.from_json(b"[" + piece + b"]")
            return values, True, array("q", values)
        except (ValueError, OverflowError):
            pass  # ``json.loads`` tells what is wrong, in vLLM's words
    return _loads_slice(body, lo, piece, at), plain, None


def _loads_slice(body: Buffer, lo: int, piece: Buffer, at: int) -> list[Any]:
    """``piece`` (at ``at`` in the body) parsed as the values of a JSON array by ``json``, whose
    errors are vLLM's words, placed in the body."""
    try:
        values: list[Any] = json.loads(b"[" + piece + b"]")
    except json.JSONDecodeError as e:
        raise _json_error(JSONBodyError(e.msg, e.pos), _char_at(body, lo, at + e.pos - 1)) from None
    except ValueError as e:  # a number past Python's digit limit
        raise _json_error(JSONBodyError(str(e).split(":", 1)[0]), 0) from None
    return values


def _validated(body: Buffer, start: int, end: int, rest_data: dict[str, Any],
               ids: _Ids) -> tuple[GenerateRequest, dict[str, Any]]:
    """The request validated as vLLM's model would, the ids checked slice by slice standing in
    for the array: the errors of both, merged in pydantic's order, or the request."""
    ids_errors, ids_total = _ids_error_list(ids)
    rest_data["token_ids"] = [0]
    rest_errors: list[dict[str, Any]] = []
    try:
        req = GenerateRequest.model_validate(rest_data)
    except ValidationError as e:
        rest_errors = [{**err, "loc": ("body", *err["loc"])} for err in e.errors(include_url=False)]
    if ids_errors:
        # pydantic checks the fields in order (``request_id`` before ``token_ids``), and runs the
        # model's own checks (loc ``()``) only when every field passed.
        before = [err for err in rest_errors if err["loc"][1:2] == ("request_id",)]
        after = [err for err in rest_errors if err["loc"][1:2] not in (("request_id",), ())]
        merged = [*before, *ids_errors, *after]
        raise format_validation_errors(merged[:_MAX_REPORTED], total=len(before) + ids_total + len(after))
    if rest_errors:
        raise format_validation_errors(rest_errors)
    token_ids = PackedTokenIds(ids.ids, memoryview(body)[start:end])
    rest_data["token_ids"] = token_ids
    req.__dict__["token_ids"] = token_ids  # validated above, slice by slice
    return req, rest_data


__all__ = ["LARGE_BODY_BYTES", "SLICE_BYTES", "PackedTokenIds", "parse_large_generate_body",
           "prompt_too_long"]
