"""proxy.first_token: P's first token as vLLM would stream it, and D's stream without it.

The byte-exact cases are vLLM 0.32's recorded streams (``tests/data/traces``): for every stream whose
first chunk of each choice holds one token, that chunk is rebuilt from a non-stream reply (P's own
in the P/D traces; else the non-stream reply to the same prompt and parameters, cut to its first
token; else, for prompts recorded only as streams, a recorded non-stream reply holding the stream's
token). Then D's stream (the recorded one) goes through the filter, and P's chunk plus what is left
must be the recorded stream again.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from typing import Any

import pydantic_core
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.first_token import (
    SEED_BOUND,
    FirstToken,
    FirstTokenFilter,
    Mismatch,
    NotBuildable,
    drop_first_token,
    ends_at_first_token,
    first_chunk,
    holdback,
    seed_for,
    usage_event,
    visible_text,
)
from proxy.sse import data_event
from tests.traces import Block, Trace, load_trace, trace_files

# -- the traces -----------------------------------------------------------------------------------


@dataclass
class StreamCase:
    name: str
    request: dict[str, Any]
    request_id: str
    events: list[bytes]
    """The stream's data payloads, ``[DONE]`` left out."""
    raw: bytes
    """The whole body as recorded."""


def _request_id(block: Block, body: Mapping[str, Any]) -> str:
    rid = block.header("X-Request-Id") or body.get("request_id")
    assert isinstance(rid, str)
    return "generate-tokens-" + rid


@cache
def _traces() -> list[Trace]:
    return [load_trace(p) for p in trace_files()]


@cache
def stream_cases() -> dict[str, StreamCase]:
    out: dict[str, StreamCase] = {}
    for t in _traces():
        for b in t.blocks:
            if b.kind != "response" or "event-stream" not in (b.header("content-type") or ""):
                continue
            req = t.request(b.label)
            body = req.json()
            events = [e.encode() for e in b.sse_events() if e != "[DONE]"]
            out[t.name] = StreamCase(t.name, body, _request_id(req, body), events, b.body)
    return out


@cache
def nonstream_replies() -> list[tuple[str, str, dict[str, Any], dict[str, Any]]]:
    """(trace, label, request, reply) of every non-stream generate answered 200."""
    out = []
    for t in _traces():
        for b in t.blocks:
            if b.kind != "response" or b.status != 200 or "json" not in (b.header("content-type") or ""):
                continue
            reply = b.json()
            if isinstance(reply, dict) and "choices" in reply:
                out.append((t.name, b.label, t.request(b.label).json(), reply))
    return out


def _first_choices(case: StreamCase) -> dict[int, dict[str, Any]]:
    firsts: dict[int, dict[str, Any]] = {}
    for raw in case.events:
        for c in json.loads(raw)["choices"]:
            firsts.setdefault(c["index"], c)
    return firsts


def _same_sampling(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    keys = ("logprobs", "n", "seed", "temperature", "allowed_token_ids", "skip_special_tokens")
    return all(a.get(k) == b.get(k) for k in keys)


def _text_key(req: Mapping[str, Any], token: int) -> tuple[Any, ...]:
    return tuple(req["token_ids"]), token, req["sampling_params"].get("skip_special_tokens", True)


@cache
def first_token_texts() -> dict[tuple[Any, ...], str]:
    """The text of token 1 after each recorded prompt, from the streams that hold nothing back."""
    out = {}
    for case in stream_cases().values():
        sp = case.request["sampling_params"]
        if case.request.get("output_mode") == "text" and holdback(sp) == 0:
            first = _first_choices(case)[0]
            out[_text_key(case.request, first["token_ids"][0])] = first["text"]
    return out


def prefill_reply(case: StreamCase) -> tuple[str, dict[str, Any]]:
    """A one-token non-stream reply for the stream's request, from the recorded non-stream ones,
    and where it came from."""
    req = case.request
    sp = req["sampling_params"]
    mode = req.get("output_mode", "tokens")
    firsts = _first_choices(case)
    ids = [firsts[i]["token_ids"][0] for i in sorted(firsts)]
    source, reply = "", None
    for trace, label, _, nreply in nonstream_replies():
        if trace == case.name and label == "prefill":  # the P/D traces: P's own reply
            source, reply = "prefill", copy.deepcopy(nreply)
            break
    if reply is None:
        for trace, _, nreq, nreply in nonstream_replies():
            if nreq["token_ids"] == req["token_ids"] and nreq.get("output_mode", "tokens") == mode \
                    and _same_sampling(nreq["sampling_params"], sp) \
                    and [c["token_ids"][0] for c in nreply["choices"]] == ids:
                source, reply = "twin:" + trace, copy.deepcopy(nreply)
                break
    if reply is None:  # recorded as a stream only: a recorded reply holding the stream's token
        _, _, _, template = next(r for r in nonstream_replies() if r[0] == "gen-tokens-nonstream")
        source, reply = "template", copy.deepcopy(template)
        reply["choices"][0]["token_ids"] = ids[:1]
        reply["usage"]["prompt_tokens"] = len(req["token_ids"])
    prompt = reply["usage"]["prompt_tokens"]
    reply["usage"].update(completion_tokens=len(ids), total_tokens=prompt + len(ids))
    reply["output_mode"] = mode
    if req.get("return_token_ids"):
        reply["prompt_token_ids"] = req["token_ids"]
    for c in reply["choices"]:
        c["token_ids"] = c["token_ids"][:1]
        c["weight_versions"] = [{"version": "default", "start": 0, "end": 1}]
        if c["finish_reason"] != "stop":  # a one-token run ends on the length
            c["finish_reason"], c["stop_reason"] = "length", None
        if isinstance(c.get("logprobs"), dict):
            c["logprobs"]["content"] = c["logprobs"]["content"][:1]
        if mode == "text":
            # the one field no non-stream record holds for one token: taken from a stream that
            # holds nothing back (the stream itself, unless it has stop strings)
            c["text"] = first_token_texts()[_text_key(req, c["token_ids"][0])]
        else:
            c.pop("text", None)
    return source, reply


def _continuous(req: Mapping[str, Any]) -> bool:
    opts = req.get("stream_options") or {}
    return bool(opts.get("include_usage") and opts.get("continuous_usage_stats"))


def build(case: StreamCase) -> tuple[bytes, list[FirstToken]]:
    _, reply = prefill_reply(case)
    req = case.request
    return first_chunk(reply, request_id=case.request_id, output_mode=req.get("output_mode", "tokens"),
                       sampling_params=req["sampling_params"],
                       final=ends_at_first_token(reply, req["sampling_params"]),
                       continuous_usage=_continuous(req))


STREAMS = sorted(stream_cases())


def test_every_recorded_stream_is_covered() -> None:
    # every stream in the set starts with one token per choice; each is checked below, and the
    # sources say how many were rebuilt from real non-stream data
    assert len(STREAMS) == 32
    sources = {name: prefill_reply(stream_cases()[name])[0] for name in STREAMS}
    assert sum(s == "prefill" for s in sources.values()) == 3
    assert sum(s.startswith("twin:") for s in sources.values()) == 18
    assert sorted(n for n, s in sources.items() if s == "template") == [
        "abort-inference-during-stream", "abort-request-ids-string-during-stream",
        "abort-unprefixed-id-during-stream", "apikey-abort-inference-no-key-during-stream",
        "apikey-abort-legacy-no-key-during-stream", "disconnect-mid-stream",
        "gen-text-skip-special-false", "gen-text-skip-special-true", "pd-prefill-stream",
        "tokonly-abort-inference-during-stream", "tokonly-abort-legacy-during-stream",
    ]


@pytest.mark.parametrize("name", STREAMS)
def test_first_chunk_is_vllms_byte_for_byte(name: str) -> None:
    case = stream_cases()[name]
    events, shown = build(case)
    expected = b""
    seen: set[int] = set()
    for raw in case.events:  # the first event of each choice, in index order
        choices = json.loads(raw)["choices"]
        index = choices[0]["index"] if choices else None
        if index is not None and index not in seen:
            seen.add(index)
            expected += data_event(raw)
    assert events == expected
    assert [f.index for f in shown] == sorted(seen)


@pytest.mark.parametrize("name", STREAMS)
def test_p_chunk_plus_filtered_d_stream_is_the_recorded_stream(name: str) -> None:
    case = stream_cases()[name]
    events, shown = build(case)
    if ends_at_first_token(prefill_reply(case)[1], case.request["sampling_params"]):
        assert name == "pd-prefill-stream"  # max_tokens 1: P's chunk is the whole stream
        assert events == b"".join(data_event(e) for e in case.events)
        return
    flt = FirstTokenFilter(shown)
    rest = []
    for raw in case.events:
        out = flt.event(raw)
        assert not isinstance(out, Mismatch)
        if out is not None:
            rest.append(data_event(out))
    assert flt.pending == {}
    client = events + b"".join(rest)
    original = b"".join(data_event(e) for e in case.events)
    if name == "gen-n2-sampled-stream":  # choice 1's first chunk moves ahead of choice 0's second
        assert sorted(client.split(b"\n\n")) == sorted(original.split(b"\n\n"))
        return
    assert client == original
    assert case.raw.startswith(original)


# -- floats as a vLLM stream writes them ----------------------------------------------------------

# What vLLM 0.32's stream serializer (``model_dump_json``, pydantic-core 2.50.5, in vLLM's own
# environment) wrote for a float, against ``repr`` (which is how a non-stream reply spells it).
VLLM_STREAM_FLOATS = [
    (1e-06, "1e-6"), (1.5e-06, "1.5e-6"), (9.9e-07, "9.9e-7"), (1e-05, "0.00001"),
    (1.2345e-05, "0.000012345"), (1e15, "1000000000000000.0"), (1e16, "1e+16"), (123.456, "123.456"),
    (2.5e-08, "2.5e-8"), (100.0, "100.0"), (1.0, "1.0"), (-9999.0, "-9999.0"),
    (-1.1920928955078125e-07, "-1.1920928955078125e-7"), (0.0001, "0.0001"),
]


@pytest.mark.parametrize(("value", "written"), VLLM_STREAM_FLOATS)
def test_logprobs_floats_are_spelled_as_in_a_stream(value: float, written: str) -> None:
    nonstream = json.dumps(value)  # the prefill reply's spelling
    reply = json.loads(
        '{"usage":{"prompt_tokens":3},"choices":[{"index":0,"finish_reason":"length","stop_reason":null,'
        '"token_ids":[5],"routed_experts":null,"sampling_mask":null,"weight_versions":null,'
        '"logprobs":{"content":[{"token_id":5,"logprob":' + nonstream + ',"rank":1,"top_logprobs":[]}]}}]}')
    events, _ = first_chunk(reply, request_id="r", output_mode="tokens", sampling_params={"logprobs": 0})
    assert b'"logprob":' + written.encode() + b',' in events


# -- does P's token end the request? --------------------------------------------------------------


def _reply(*choices: dict[str, Any], text: bool = False, prompt: int = 4) -> dict[str, Any]:
    out = []
    for i, c in enumerate(choices):
        choice = {"index": i, "finish_reason": "length", "stop_reason": None, "token_ids": [7],
                  "routed_experts": None, "sampling_mask": None,
                  "weight_versions": [{"version": "default", "start": 0, "end": 1}]}
        if text:
            choice["text"] = "abc"
        choice["logprobs"] = None
        choice.update(c)
        out.append(choice)
    return {"request_id": "generate-tokens-x", "usage": {"prompt_tokens": prompt, "total_tokens": prompt + 1,
            "completion_tokens": 1}, "prompt_token_ids": None, "output_mode": "text" if text else "tokens",
            "choices": out}


EOS = {"finish_reason": "stop", "stop_reason": None, "token_ids": [2]}


@pytest.mark.parametrize(("choice", "sp", "ends"), [
    ({}, {"max_tokens": 1}, True),
    (EOS, {"max_tokens": 1}, True),
    ({}, {"max_tokens": 5}, False),
    ({}, {}, False),  # max_tokens left to the server
    (EOS, {"max_tokens": 5}, True),
    (EOS, {"max_tokens": 5, "ignore_eos": True}, False),
    ({"finish_reason": "stop", "stop_reason": 9}, {"max_tokens": 5, "stop_token_ids": [8, 9]}, True),
    ({"finish_reason": "stop", "stop_reason": 9}, {"max_tokens": 5, "stop_token_ids": [8]}, False),
    ({"finish_reason": "stop", "stop_reason": "ab"}, {"max_tokens": 5, "stop": ["ab", "x"]}, True),
    ({"finish_reason": "stop", "stop_reason": "ab"}, {"max_tokens": 5, "stop": "ab"}, True),
    ({"finish_reason": "stop", "stop_reason": "ab"}, {"max_tokens": 5, "stop": ["x"]}, False),
    (EOS, {"max_tokens": 5, "min_tokens": 1}, False),  # vLLM masks EOS before min_tokens
    ({"finish_reason": "stop", "stop_reason": "ab"}, {"max_tokens": 5, "stop": ["ab"], "min_tokens": 2},
     False),
    ({"finish_reason": "abort"}, {"max_tokens": 5}, False),
])
def test_ends_at_first_token(choice: dict[str, Any], sp: dict[str, Any], ends: bool) -> None:
    assert ends_at_first_token(_reply(choice), sp) is ends


def test_every_choice_must_end() -> None:
    sp = {"max_tokens": 5, "n": 2, "temperature": 1.0}
    assert ends_at_first_token(_reply(EOS, EOS), sp)
    assert not ends_at_first_token(_reply(EOS, {}), sp)
    assert ends_at_first_token(_reply({}, {}), {**sp, "max_tokens": 1})


def test_a_final_first_chunk_carries_ps_end_and_its_whole_text() -> None:
    reply = _reply({"finish_reason": "stop", "stop_reason": "c", "text": "ab"}, text=True)
    sp = {"max_tokens": 5, "stop": ["c", "abcdef"]}
    assert ends_at_first_token(reply, sp)
    events, shown = first_chunk(reply, request_id="generate-tokens-x", output_mode="text",
                                sampling_params=sp, final=True)
    choice = json.loads(events[6:-2])["choices"][0]
    assert (choice["finish_reason"], choice["stop_reason"], choice["text"]) == ("stop", "c", "ab")
    assert choice["weight_versions"] == [{"version": "default", "start": 0, "end": 1}]
    assert shown == [FirstToken(0, 7, "ab")]  # not held back: the request is over
    partial, shown = first_chunk(reply, request_id="generate-tokens-x", output_mode="text",
                                 sampling_params=sp)
    assert json.loads(partial[6:-2])["choices"][0]["finish_reason"] is None
    assert shown == [FirstToken(0, 7, "")]  # 5 characters held back


@pytest.mark.parametrize(("name", "prompt", "completion"), [
    ("gen-tokens-stream-include-usage", 7, 5), ("gen-text-stream-include-usage", 7, 3),
    ("pd-decode-stream", 320, 8), ("tokonly-gen-tokens-stream", 7, 5),
])
def test_usage_event_is_vllms(name: str, prompt: int, completion: int) -> None:
    case = stream_cases()[name]
    made = usage_event(request_id=case.request_id, output_mode=case.request.get("output_mode", "tokens"),
                       prompt_tokens=prompt, completion_tokens=completion)
    assert made == data_event(case.events[-1])


def test_replies_that_cannot_give_vllms_chunk_are_refused() -> None:
    sp: dict[str, Any] = {"max_tokens": 5}
    good = _reply({})
    first_chunk(good, request_id="r", output_mode="tokens", sampling_params=sp)
    bad = [
        (_reply({"token_ids": []}), sp, "tokens"),
        (_reply({"token_ids": [1, 2]}), sp, "tokens"),
        (_reply({"finish_reason": "abort"}), sp, "tokens"),
        (_reply(EOS), {"max_tokens": 5, "min_tokens": 1}, "tokens"),  # P was sent without min_tokens
        (_reply({"routed_experts": "AAAA"}), sp, "tokens"),
        (_reply({}), {**sp, "logprobs": 1}, "tokens"),  # no logprobs in the reply
        (_reply({"logprobs": {"content": []}}), sp, "tokens"),  # logprobs not asked
        (_reply({}), sp, "text"),  # P answered in tokens mode
        (_reply({}), {**sp, "n": 2}, "tokens"),
        (_reply({}), sp, "derender"),
        ({"choices": []}, sp, "tokens"),
    ]
    for reply, params, mode in bad:
        with pytest.raises(NotBuildable):
            first_chunk(reply, request_id="r", output_mode=mode, sampling_params=params)


def test_prompt_token_ids_go_on_the_first_event_only() -> None:
    reply = _reply({}, {"token_ids": [9]})
    reply["prompt_token_ids"] = [1, 2, 3, 4]
    events, _ = first_chunk(reply, request_id="r", output_mode="tokens",
                            sampling_params={"n": 2, "temperature": 1.0})
    first, second = (json.loads(e[6:]) for e in events.split(b"\n\n")[:2])
    assert first["prompt_token_ids"] == [1, 2, 3, 4] and "prompt_token_ids" not in second
    assert list(first) == ["request_id", "usage", "prompt_token_ids", "output_mode", "choices"]


# -- the hold-back --------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "sp", "finished", "shown"), [
    (" apple", {"stop": ["lazy"]}, False, " ap"),
    (" apple", {"stop": "lazy"}, False, " ap"),
    (" apple", {"stop": ["lazy", "x"]}, False, " ap"),  # the longest stop string counts
    (" apple", {"stop": ["x", "ab"]}, False, " appl"),
    (" apple", {"stop": ["x"]}, False, " apple"),  # one character: nothing held
    (" apple", {"stop": ["lazy"], "include_stop_str_in_output": True}, False, " apple"),
    (" apple", {"stop": ["lazy"]}, True, " apple"),  # the request ended: all of it
    (" apple", {"stop": ["a very long stop"]}, False, ""),
    (" apple", {"stop": ["lazy"], "min_tokens": 3}, False, " ap"),  # min_tokens delays the check only
    (" apple", {}, False, " apple"),
    (" apple", {"stop": []}, False, " apple"),
    ("", {"stop": ["lazy"]}, False, ""),
])
def test_visible_text(text: str, sp: dict[str, Any], finished: bool, shown: str) -> None:
    assert visible_text(text, sp, finished=finished) == shown


def test_holdback_matches_a_recorded_stream_token_by_token() -> None:
    """The same run with and without ``include_stop_str_in_output``: at every chunk the text shown
    so far is the full text so far minus ``holdback`` characters (until the last chunk)."""
    held = stream_cases()["gen-text-stop-stream"]
    full = stream_cases()["gen-text-stop-include-stream"]
    sp = held.request["sampling_params"]
    assert holdback(sp) == 3 and holdback(full.request["sampling_params"]) == 0
    shown = so_far = ""
    for a, b in zip(held.events[:-1], full.events[:-1], strict=True):
        shown += json.loads(a)["choices"][0]["text"]
        so_far += json.loads(b)["choices"][0]["text"]
        assert shown == visible_text(so_far, sp)


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


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
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


# -- one seed for both hops -----------------------------------------------------------------------


@pytest.mark.parametrize(("sp", "seeded"), [
    ({}, True),  # vLLM's default temperature is 1.0
    ({"temperature": 0.7}, True),
    ({"temperature": 0.7, "seed": -1}, True),  # vLLM reads -1 as no seed
    ({"temperature": None}, True),
    ({"temperature": 0}, False),
    ({"temperature": 0.0, "seed": None}, False),
    ({"temperature": 0.7, "seed": 0}, False),  # the client's seed stays
    ({"temperature": 0.7, "seed": 12345}, False),
])
def test_seed_for(sp: dict[str, Any], seeded: bool) -> None:
    bounds: list[int] = []

    def draw(bound: int) -> int:
        bounds.append(bound)
        return 42

    assert seed_for(sp, draw) == (42 if seeded else None)
    assert bounds == ([SEED_BOUND] if seeded else [])


def test_generated_seeds_are_per_request_and_leave_room_for_n() -> None:
    seeds = {seed_for({"temperature": 1.0}) for _ in range(64)}
    assert len(seeds) == 64  # drawn per request
    assert all(isinstance(s, int) and 0 <= s < SEED_BOUND for s in seeds)
    assert SEED_BOUND + 16384 <= 2**63  # vLLM seeds choice i with seed + i; n is at most 16384


def test_a_hypothesis_example_chunk_is_vllm_shaped() -> None:
    # the merged chunks above are built like vLLM's: compare with a recorded chunk
    case = stream_cases()["gen-logprobs-tokens-stream"]
    recorded = json.loads(case.events[0])
    made = _chunk(recorded["choices"][0]["token_ids"], logprobs=recorded["choices"][0]["logprobs"]["content"])
    made["request_id"] = recorded["request_id"]
    assert pydantic_core.to_json(made) == case.events[0]
