"""D's first token out of its stream, after checking it is P's (else a ``Mismatch``)."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from proxy.sse.first_token import CHUNK_OPTIONAL, FirstToken, Mismatch, as_int
from proxy.wire.protocol import parse_stream_chunk, stream_json

# D's chunk is decided on its parse; the result is edited in its own bytes (spans found by a small
# scanner), everything else kept byte for byte. A payload that repeats a key is written again.

_WS: Final = b" \t\r\n"
_STRING: Final = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_TO_BRACKET: Final = re.compile(rb'(?:"(?:[^"\\]|\\.)*"|[^"\[\]{}])*', re.DOTALL)
"""A run of JSON text up to the next bracket outside a string."""
_SCALAR_END: Final = re.compile(rb"[,\]} \t\r\n]")

_Member = tuple[str, int, int, int]
"""key, where the member starts (its key's quote), where its value starts and ends."""


class _Scan:
    """Where the values of a (parsed, so valid) JSON text start and end."""

    __slots__ = ("ends", "raw")

    def __init__(self, raw: bytes) -> None:
        self.raw = raw
        self.ends: dict[int, int] = {}
        stack: list[int] = []
        at, size, run = 0, len(raw), _TO_BRACKET.match
        while True:
            m = run(raw, at)
            assert m is not None
            at = m.end()
            if at >= size:
                return
            if raw[at] in b"[{":
                stack.append(at)
            else:
                self.ends[stack.pop()] = at + 1
            at += 1

    def ws(self, i: int) -> int:
        raw = self.raw
        while raw[i] in _WS:
            i += 1
        return i

    def end(self, i: int) -> int:
        """Where the value starting at ``i`` ends."""
        c = self.raw[i]
        if c == 0x22:
            m = _STRING.match(self.raw, i)
        elif c in b"[{":
            return self.ends[i]
        else:
            m = _SCALAR_END.search(self.raw, i)
            assert m is not None
            return m.start()
        assert m is not None
        return m.end()

    def members(self, i: int) -> list[_Member]:
        """The members of the object opening at ``i``."""
        out: list[_Member] = []
        j = self.ws(i + 1)
        if self.raw[j] == 0x7D:
            return out
        while True:
            ke = self.end(j)
            quoted = self.raw[j:ke]
            key = json.loads(quoted) if b"\\" in quoted else quoted[1:-1].decode()
            vs = self.ws(self.ws(ke) + 1)
            ve = self.end(vs)
            out.append((key, j, vs, ve))
            j = self.ws(ve)
            if self.raw[j] == 0x7D:
                return out
            j = self.ws(j + 1)

    def items(self, i: int) -> list[tuple[int, int]]:
        """The spans of the items of the array opening at ``i``."""
        out: list[tuple[int, int]] = []
        j = self.ws(i + 1)
        if self.raw[j] == 0x5D:
            return out
        while True:
            end = self.end(j)
            out.append((j, end))
            j = self.ws(end)
            if self.raw[j] == 0x5D:
                return out
            j = self.ws(j + 1)

    def unique_members(self, i: int) -> dict[str, _Member] | None:
        """The members of the object at ``i`` by key; None unless an object without repeated keys."""
        if self.raw[i] != 0x7B:
            return None
        members = self.members(i)
        found = {m[0]: m for m in members}
        return found if len(found) == len(members) else None

    def first_item(self, member: _Member) -> tuple[int, int]:
        """The span that takes the first item out of the array ``member`` holds."""
        items = self.items(member[2])
        if len(items) > 1:
            return items[0][0], items[1][0]
        return member[2] + 1, member[3] - 1


def _skip_chars(raw: bytes, i: int, count: int) -> int:
    """Where the JSON string text from ``raw[i]`` holds ``count`` code points."""
    for _ in range(count):
        c = raw[i]
        if c == 0x5C:
            if raw[i + 1] == 0x75:  # \uXXXX
                cp = int(raw[i + 2 : i + 6], 16)
                i += 6
                if 0xD800 <= cp < 0xDC00 and raw[i : i + 2] == b"\\u" \
                        and 0xDC00 <= int(raw[i + 2 : i + 6], 16) < 0xE000:
                    i += 6
            else:
                i += 2
        else:
            i += 1 if c < 0x80 else 4 if c >= 0xF0 else 3 if c >= 0xE0 else 2
    return i


def _is_empty(choice: Mapping[str, Any]) -> bool:
    return not choice.get("token_ids") and not choice.get("text") and choice.get("finish_reason") is None


@dataclass(slots=True)
class _Cut:
    """What to take out of one choice of D's chunk (by its position in ``choices``)."""

    pos: int
    chars: int
    logprob: bool


def _take_first(chunk: dict[str, Any], pos: int, first: FirstToken) -> _Cut | Mismatch | None:
    """Take token 1 out of the parsed ``pos``-th choice: how, why not, or None (no token in it)."""
    choice = chunk["choices"][pos]
    ids = choice.get("token_ids") or []
    text = choice.get("text")
    if not ids:
        return Mismatch(first.index, first.token_id, None, "text") if isinstance(text, str) and text else None
    if ids[0] != first.token_id:
        return Mismatch(first.index, first.token_id, ids[0], "token")
    if first.text is not None and isinstance(text, str) and not text.startswith(first.text):
        return Mismatch(first.index, first.token_id, ids[0], "text")
    choice["token_ids"] = ids[1:]
    chars = 0
    if first.text and isinstance(text, str):
        chars = len(first.text)
        choice["text"] = text[chars:]
    logprobs = choice.get("logprobs")
    cut_logprob = isinstance(logprobs, dict) and isinstance(logprobs.get("content"), list) \
        and bool(logprobs["content"])
    if cut_logprob:
        choice["logprobs"] = {**logprobs, "content": logprobs["content"][1:]}
    return _Cut(pos, chars, cut_logprob)


def _spliced(raw: bytes, cuts: list[_Cut], drop_keys: list[str]) -> bytes | None:
    """``raw`` with the cuts made in its own bytes; None when a key repeats."""
    scan = _Scan(raw)
    top = scan.unique_members(scan.ws(0))
    if top is None or "choices" not in top:
        return None
    spans: list[tuple[int, int]] = []
    items = scan.items(top["choices"][2])
    for cut in cuts:
        choice = scan.unique_members(items[cut.pos][0])
        if choice is None:
            return None
        spans.append(scan.first_item(choice["token_ids"]))
        if cut.chars:
            vs = choice["text"][2]
            spans.append((vs + 1, _skip_chars(raw, vs + 1, cut.chars)))
        if cut.logprob:
            logprobs = scan.unique_members(choice["logprobs"][2])
            if logprobs is None:
                return None
            spans.append(scan.first_item(logprobs["content"]))
    members = sorted(top.values(), key=lambda m: m[1])
    for key in drop_keys:  # a top-level member, with its comma
        at = next(i for i, m in enumerate(members) if m[0] == key)
        spans.append((members[at - 1][3], members[at][3]) if at > 0 else (members[0][1], members[1][1]))
    for start, end in sorted(spans, reverse=True):
        raw = raw[:start] + raw[end:]
    return raw


def _take_firsts(chunk: dict[str, Any], firsts: Mapping[int, FirstToken],
                 seen: list[int]) -> tuple[list[_Cut], list[int]] | Mismatch:
    """Token 1 out of each choice of ``chunk`` in ``firsts``: the cuts, and the positions of
    choices whose end the client already had; or a ``Mismatch``."""
    cuts: list[_Cut] = []
    ended: list[int] = []
    for pos, choice in enumerate(chunk["choices"]):
        if not isinstance(choice, dict):
            continue
        first = firsts.get(as_int(choice.get("index", 0)) or 0)
        if first is None:
            continue
        seen.append(first.index)
        cut = _take_first(chunk, pos, first)
        if isinstance(cut, Mismatch):
            return cut
        if first.final:
            if choice.get("token_ids") or choice.get("text") or choice.get("finish_reason") is None:
                return Mismatch(first.index, first.token_id, first.token_id, "finish")
            ended.append(pos)
        elif cut is not None:
            cuts.append(cut)
    return cuts, ended


def _drop(payload: bytes, chunk: dict[str, Any], firsts: Mapping[int, FirstToken], *,
          first_event: bool) -> tuple[bytes | Mismatch | None, list[int]]:
    """``payload`` without token 1 of each choice in ``firsts``, and which of those it held."""
    seen: list[int] = []
    taken = _take_firsts(chunk, firsts, seen)
    if isinstance(taken, Mismatch) or not seen:
        return (taken if isinstance(taken, Mismatch) else payload), seen
    cuts, ended = taken
    if ended:
        chunk["choices"] = [c for pos, c in enumerate(chunk["choices"]) if pos not in ended]
    if all(isinstance(c, dict) and _is_empty(c) for c in chunk["choices"]):
        return None, seen
    drop_keys = [key for key in CHUNK_OPTIONAL if first_event and chunk.get(key) is not None]
    for key in drop_keys:  # the client had them with P's chunk
        chunk.pop(key)
    if ended:  # another choice beside an ended one in one chunk (vLLM sends one each): written again
        return stream_json(chunk), seen
    if not cuts and not drop_keys:
        return payload, seen
    spliced = _spliced(payload, cuts, drop_keys)
    return (spliced if spliced is not None else stream_json(chunk)), seen


def drop_first_token(payload: bytes, expected_token: int, expected_text: str | None = None, *,
                     index: int = 0) -> bytes | Mismatch | None:
    """D's first data event for choice ``index`` without token 1 (id, logprob, the shown text,
    ``prompt_token_ids``), every other byte kept; None when nothing is left to send, a
    ``Mismatch`` when D's token 1 is not what the client was shown."""
    chunk = parse_stream_chunk(payload)
    if chunk is None:
        return payload
    result, _ = _drop(payload, chunk, {index: FirstToken(index, expected_token, expected_text)},
                      first_event=True)
    return result


class FirstTokenFilter:
    """Takes token 1 out of D's stream once per choice, whichever attempt produces the events."""

    __slots__ = ("pending", "started")

    def __init__(self, firsts: Sequence[FirstToken]) -> None:
        self.pending: dict[int, FirstToken] = {f.index: f for f in firsts}
        self.started = False
        """An event has gone through (``prompt_token_ids`` are only on a stream's first)."""

    def event(self, payload: bytes) -> bytes | Mismatch | None:
        """The payload to relay, None to send nothing, or a ``Mismatch``."""
        if not self.pending:
            return payload
        chunk = parse_stream_chunk(payload)
        if chunk is None:
            return payload  # an error event, or not a chunk: the caller's checks apply
        result, seen = _drop(payload, chunk, self.pending, first_event=not self.started)
        self.started = True
        if not isinstance(result, Mismatch):
            for index in seen:
                self.pending.pop(index, None)
        return result

    def clear(self) -> None:
        """Stop filtering: the stream goes on as a continuation that starts after P's token."""
        self.pending.clear()


__all__ = ["FirstTokenFilter", "drop_first_token"]
