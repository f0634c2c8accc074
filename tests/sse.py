"""One reading of a server-sent-event body for every test (vLLM's and the proxy's streams).

Each event is exactly one ``data: `` line followed by a blank line; a comment event (``:`` first,
e.g. a keep-alive) is dropped where the caller allows comments and fails the reading otherwise.
Anything else in the body (another field, a blank event, an unfinished last event) fails it, so a
test reading through here is never laxer than a hand-written split. Tests of exact framing or
bytes compare bytes instead."""

from __future__ import annotations

import json
from typing import Any

DONE = b"[DONE]"
_DATA = b"data: "


def events(raw: bytes, *, comments: bool = False, partial: bool = False) -> list[bytes]:
    """The data payloads of ``raw`` in order, ``b"[DONE]"`` included where it came.

    ``partial``: ``raw`` is a stream read so far, and an unfinished last event is left out."""
    blocks = raw.split(b"\n\n")
    tail = blocks.pop()
    assert partial or not tail, f"the body does not end on an event boundary: {tail[:80]!r}"
    out: list[bytes] = []
    for block in blocks:
        if comments and block.startswith(b":"):
            continue
        assert block.startswith(_DATA) and b"\n" not in block, f"not one data line: {block[:80]!r}"
        out.append(block[len(_DATA):])
    return out


def datas(raw: bytes, *, comments: bool = False, partial: bool = False) -> list[Any]:
    """The payloads JSON-decoded, ``[DONE]`` kept as the string ``"[DONE]"``."""
    return ["[DONE]" if d == DONE else json.loads(d) for d in events(raw, comments=comments, partial=partial)]


def json_events(raw: bytes, *, comments: bool = False, partial: bool = False) -> list[dict[str, Any]]:
    """The JSON objects of the stream, ``[DONE]`` left out; it may only be the last event."""
    payloads = events(raw, comments=comments, partial=partial)
    assert DONE not in payloads[:-1], "an event after [DONE]"
    out: list[dict[str, Any]] = []
    for d in payloads:
        if d != DONE:
            obj = json.loads(d)
            assert isinstance(obj, dict), d[:80]
            out.append(obj)
    return out


def done(raw: bytes, *, comments: bool = False) -> bool:
    """The whole body reads as a stream and its last event is ``[DONE]``."""
    return events(raw, comments=comments)[-1:] == [DONE]


def tokens(raw: bytes, *, comments: bool = False, partial: bool = False) -> list[int]:
    """Every generated token id of the stream, choice after choice, event after event."""
    return [t for e in json_events(raw, comments=comments, partial=partial)
            for c in e.get("choices") or [] for t in c.get("token_ids") or []]
