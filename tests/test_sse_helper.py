"""The shared SSE reading (``tests.sse``) is never laxer than the hand-written splits it replaced."""

from __future__ import annotations

import pytest

from tests.sse import datas, done, events, json_events, tokens

ONE, TWO = b'{"choices":[{"token_ids":[1,2]}]}', b'{"choices":[{"token_ids":[3]}]}'
BODY = b"data: " + ONE + b"\n\n: keep-alive\n\ndata: " + TWO + b"\n\ndata: [DONE]\n\n"


def test_reads_payloads_in_order() -> None:
    assert events(BODY, comments=True) == [ONE, TWO, b"[DONE]"]
    assert datas(BODY, comments=True)[-1] == "[DONE]"
    assert len(json_events(BODY, comments=True)) == 2
    assert tokens(BODY, comments=True) == [1, 2, 3]
    assert done(BODY, comments=True) and not done(BODY[: -len(b"data: [DONE]\n\n")], comments=True)


@pytest.mark.parametrize("raw", [
    BODY,  # a comment where none is allowed
    b"data: {}\n\ndata: [DONE]",  # unfinished last event
    b"event: x\ndata: {}\n\n",  # another field
    b"data: {}\n\n\n\n",  # a blank event
    b"data:{}\n\n",  # no space after the colon
    b"data: {}\ndata: {}\n\n",  # two data lines in one event
])
def test_rejects_what_is_not_one_data_line_per_event(raw: bytes) -> None:
    with pytest.raises(AssertionError):
        events(raw)


def test_partial_leaves_out_the_unfinished_event() -> None:
    assert events(b'data: {}\n\ndata: {"a', partial=True) == [b"{}"]


def test_json_events_rejects_events_after_done() -> None:
    with pytest.raises(AssertionError):
        json_events(b"data: [DONE]\n\ndata: {}\n\n")
