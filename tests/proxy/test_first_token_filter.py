"""proxy.sse.first_token_filter: D's stream without its first token (the client has it from P).

D's token 1 is taken out of merged chunks of any layout (ids, logprobs, text cut by characters in
any JSON spelling), the rest kept byte for byte; a token or text that is not P's is a Mismatch. The
round trip over every recorded vLLM stream is in ``test_first_token``.
"""

from __future__ import annotations

import json
from typing import Any

import pydantic_core
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.sse.first_token import (
    FirstToken,
    Mismatch,
    visible_text,
)
from proxy.sse.first_token_filter import FirstTokenFilter, drop_first_token
from tests.proxy.test_first_token import stream_cases

# -- D's first token out --------------------------------------------------------------------------


def _chunk(ids: list[int], *, text: str | None = None, logprobs: list[dict[str, Any]] | None = None,
           finish: str | None = None, usage: dict[str, Any] | None = None, index: int = 0,
           prompt_token_ids: list[int] | None = None) -> dict[str, Any]:
    versions = [{"version": "default", "start": 0, "end": 9}] if finish else None
    choice: dict[str, Any] = {"index": index, "finish_reason": finish, "stop_reason": None, "token_ids": ids,
                              "routed_experts": None, "sampling_mask": None, "weight_versions": versions}
    if text is not None:
        choice["text"] = text
    choice["logprobs"] = None if logprobs is None else {"content": logprobs}
    chunk: dict[str, Any] = {"request_id": "generate-tokens-x", "usage": usage}
    if prompt_token_ids is not None:
        chunk["prompt_token_ids"] = prompt_token_ids
    chunk["output_mode"] = "tokens" if text is None else "text"
    chunk["choices"] = [choice]
    return chunk


def _lp(token: int, value: float) -> dict[str, Any]:
    top = [{"token_id": token, "logprob": value, "rank": 1}]
    return {"token_id": token, "logprob": value, "rank": 1, "top_logprobs": top}


_texts = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=6)
_floats = st.one_of(st.floats(-30, 0, allow_nan=False), st.sampled_from([-1e-05, -1.25e-07, -9999.0, 0.0]))


@settings(deadline=None, max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(ids=st.lists(st.integers(0, 600), min_size=1, max_size=6), data=st.data(),
       mode=st.sampled_from(["tokens", "text"]), with_logprobs=st.booleans(),
       finish=st.sampled_from([None, "length", "stop"]), continuous=st.booleans())
def test_a_merged_chunk_loses_exactly_token_1(ids: list[int], data: st.DataObject, mode: str,
                                             with_logprobs: bool, finish: str | None,
                                             continuous: bool) -> None:
    texts = [data.draw(_texts) for _ in ids]
    stop = data.draw(st.lists(st.text(min_size=1, max_size=5), max_size=2)) if mode == "text" else []
    sp = {"stop": stop}
    ended = finish is not None
    shown = visible_text(texts[0], sp) if mode == "text" else None
    whole = "".join(texts)
    text = (whole if ended else visible_text(whole, sp)) if mode == "text" else None
    logprobs = [_lp(t, data.draw(_floats)) for t in ids] if with_logprobs else None
    usage = {"prompt_tokens": 3, "total_tokens": 3 + len(ids), "completion_tokens": len(ids),
             "prompt_tokens_details": None, "completion_tokens_details": None} if continuous else None
    original = _chunk(ids, text=text, logprobs=logprobs, finish=finish, usage=usage)
    payload = pydantic_core.to_json(original)
    out = drop_first_token(payload, ids[0], shown)
    assert not isinstance(out, Mismatch)
    rest_text = text[len(shown):] if text is not None and shown is not None else text
    expected = _chunk(ids[1:], text=rest_text, logprobs=None if logprobs is None else logprobs[1:],
                      finish=finish, usage=usage)
    if len(ids) == 1 and not rest_text and finish is None:
        assert out is None  # nothing new for the client (a continuous usage alone does not count)
        return
    assert out is not None
    assert out == pydantic_core.to_json(expected)  # every other byte as it was
    # P's token put back in front gives D's chunk again
    back = json.loads(out)["choices"][0]
    assert [ids[0], *back["token_ids"]] == ids
    if text is not None:
        assert (shown or "") + back["text"] == text
    if logprobs is not None:
        sent = json.loads(payload)["choices"][0]["logprobs"]["content"]
        assert [logprobs[0], *back["logprobs"]["content"]] == sent


@settings(deadline=None)
@given(before=_texts, after=_texts)
def test_text_is_cut_by_characters_in_any_spelling(before: str, after: str) -> None:
    """The shown text is cut from D's JSON text by characters, whatever the escapes (``ensure_ascii``
    spells every non-ASCII character as ``\\u`` escapes, surrogate pairs included)."""
    chunk = _chunk([1, 2], text=before + after)
    for payload in (pydantic_core.to_json(chunk), json.dumps(chunk, ensure_ascii=True).encode()):
        out = drop_first_token(payload, 1, before)
        assert isinstance(out, bytes)
        assert json.loads(out)["choices"][0]["text"] == after


def test_other_bytes_are_kept_in_any_layout() -> None:
    chunk = _chunk([4, 5, 6], text="abcdef", logprobs=[_lp(4, -1.0), _lp(5, -2.0), _lp(6, -3.0)])
    spaced = json.dumps(chunk, indent=1).encode()
    out = drop_first_token(spaced, 4, "ab")
    expected = _chunk([5, 6], text="cdef", logprobs=[_lp(5, -2.0), _lp(6, -3.0)])
    assert out == json.dumps(expected, indent=1).encode()


def test_a_repeated_key_is_written_again() -> None:
    chunk = _chunk([4, 5], text="abcd", logprobs=[_lp(4, -1.0), _lp(5, -2.0)], prompt_token_ids=[1])
    payload = pydantic_core.to_json(chunk)[:-1] + b',"usage":null}'
    out = drop_first_token(payload, 4, "ab")
    expected = _chunk([5], text="cd", logprobs=[_lp(5, -2.0)])
    assert out == pydantic_core.to_json(expected)


def test_the_first_token_alone_leaves_nothing() -> None:
    assert drop_first_token(pydantic_core.to_json(_chunk([4])), 4) is None
    assert drop_first_token(pydantic_core.to_json(_chunk([4], text="ab")), 4, "ab") is None
    usage = {"prompt_tokens": 3, "total_tokens": 4, "completion_tokens": 1}
    assert drop_first_token(pydantic_core.to_json(_chunk([4], usage=usage)), 4) is None


def test_an_end_with_the_first_token_is_kept_without_it() -> None:
    payload = pydantic_core.to_json(_chunk([4], text="ab", finish="length", logprobs=[_lp(4, -1.0)]))
    out = drop_first_token(payload, 4, "ab")
    assert out == pydantic_core.to_json(_chunk([], text="", finish="length", logprobs=[]))


def test_the_rest_of_the_held_back_text_stays() -> None:
    # P showed " ap" of " apple" (stop "lazy"); D's first chunk holds tokens 1-2: " apple" + "pon",
    # shown up to "applep" (3 held back)
    payload = pydantic_core.to_json(_chunk([386, 324], text=" applep"))
    out = drop_first_token(payload, 386, " ap")
    assert isinstance(out, bytes) and json.loads(out)["choices"][0]["text"] == "plep"


@pytest.mark.parametrize(("chunk", "token", "text", "mismatch"), [
    (_chunk([5, 6]), 4, None, Mismatch(0, 4, 5, "token")),
    (_chunk([5]), 4, None, Mismatch(0, 4, 5, "token")),
    (_chunk([4, 6], text="xyz"), 4, "ab", Mismatch(0, 4, 4, "text")),
    (_chunk([4], text="a"), 4, "ab", Mismatch(0, 4, 4, "text")),  # less than the client was shown
    (_chunk([], text="ab"), 4, "ab", Mismatch(0, 4, None, "text")),
])
def test_mismatches(chunk: dict[str, Any], token: int, text: str | None, mismatch: Mismatch) -> None:
    assert drop_first_token(pydantic_core.to_json(chunk), token, text) == mismatch


def test_events_that_carry_no_first_token_pass_untouched() -> None:
    abort = pydantic_core.to_json(_chunk([], finish="abort"))
    error = b'{"error":{"message":"x","type":"InternalServerError","param":null,"code":500}}'
    other_index = pydantic_core.to_json(_chunk([5], index=1))
    usage_only = b'{"request_id":"r","usage":{"prompt_tokens":1},"output_mode":"tokens","choices":[]}'
    for payload in (abort, error, other_index, usage_only, b"not json"):
        assert drop_first_token(payload, 4) is payload


def test_the_filter_takes_one_token_per_choice_across_attempts() -> None:
    flt = FirstTokenFilter([FirstToken(0, 4, None), FirstToken(1, 8, None)])
    error = b'{"error":{"message":"x","type":"InternalServerError","param":null,"code":500}}'
    assert flt.event(error) is error  # a failed attempt: still pending
    first = pydantic_core.to_json(_chunk([4, 5], prompt_token_ids=[1, 2]))
    out = flt.event(first)
    assert out == pydantic_core.to_json(_chunk([5]))  # prompt_token_ids: the client had them
    assert set(flt.pending) == {1}
    again = pydantic_core.to_json(_chunk([6]))
    assert flt.event(again) is again  # choice 0 is done
    assert flt.event(pydantic_core.to_json(_chunk([8], index=1))) is None
    assert flt.pending == {} and flt.event(again) is again


def test_a_mismatch_keeps_the_choice_pending_until_cleared() -> None:
    flt = FirstTokenFilter([FirstToken(0, 4, None)])
    assert isinstance(flt.event(pydantic_core.to_json(_chunk([5, 6]))), Mismatch)
    assert set(flt.pending) == {0}
    flt.clear()  # the continuation starts after P's token
    cont = pydantic_core.to_json(_chunk([5]))
    assert flt.event(cont) is cont


def test_a_choice_that_ended_with_ps_token_is_not_sent_again() -> None:
    """n=2, choice 0 ended at token 1: the client had its token and its end in P's chunk, so D's
    chunk for it (token 1 and the end) is not sent; choice 1's token 1 is taken out as usual."""
    flt = FirstTokenFilter([FirstToken(0, 4, None, final=True), FirstToken(1, 8, None)])
    assert flt.event(pydantic_core.to_json(_chunk([4], finish="stop"))) is None
    assert flt.event(pydantic_core.to_json(_chunk([8, 9], index=1))) == pydantic_core.to_json(
        _chunk([9], index=1))
    assert flt.pending == {}
    both = _chunk([4], finish="stop")  # two choices in one chunk: the ended one goes
    both["choices"].append(_chunk([8, 9], index=1)["choices"][0])
    flt = FirstTokenFilter([FirstToken(0, 4, None, final=True), FirstToken(1, 8, None)])
    out = flt.event(pydantic_core.to_json(both))
    assert isinstance(out, bytes) and json.loads(out)["choices"] == _chunk([9], index=1)["choices"]


@pytest.mark.parametrize("chunk", [_chunk([4]), _chunk([4, 5], finish="length"),
                                   _chunk([4], text="abc", finish="stop")])
def test_d_going_on_with_a_choice_that_ended_at_ps_token_is_a_mismatch(chunk: dict[str, Any]) -> None:
    text = "ab" if "text" in chunk["choices"][0] else None
    flt = FirstTokenFilter([FirstToken(0, 4, text, final=True)])
    assert flt.event(pydantic_core.to_json(chunk)) == Mismatch(0, 4, 4, "finish")


def test_a_hypothesis_example_chunk_is_vllm_shaped() -> None:
    # the merged chunks above are built like vLLM's: compare with a recorded chunk
    case = stream_cases()["gen-logprobs-tokens-stream"]
    recorded = json.loads(case.events[0])
    made = _chunk(recorded["choices"][0]["token_ids"], logprobs=recorded["choices"][0]["logprobs"]["content"])
    made["request_id"] = recorded["request_id"]
    assert pydantic_core.to_json(made) == case.events[0]
