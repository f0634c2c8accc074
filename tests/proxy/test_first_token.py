"""proxy.sse.first_token: P's first token as vLLM would stream it, and D's stream without it.

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

import pytest

from proxy.sse.events import data_event
from proxy.sse.first_token import (
    SEED_BOUND,
    FirstToken,
    Mismatch,
    NotBuildable,
    ends_at_first_token,
    first_chunk,
    holdback,
    seed_for,
    usage_event,
    visible_text,
)
from proxy.sse.first_token_filter import FirstTokenFilter
from tests import sse
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
    assert shown == [FirstToken(0, 7, "ab", final=True)]  # not held back: the request is over
    going_on = _reply({"finish_reason": "length", "text": "ab"}, text=True)
    partial, shown = first_chunk(going_on, request_id="generate-tokens-x", output_mode="text",
                                 sampling_params=sp)
    assert json.loads(partial[6:-2])["choices"][0]["finish_reason"] is None
    assert shown == [FirstToken(0, 7, "")]  # 5 characters held back


def test_each_choice_that_ends_at_its_first_token_carries_its_end() -> None:
    """n=2, choice 0 stops at token 1 (EOS), choice 1 goes on: the request is not over, but choice
    0's chunk carries its end with its token, as vLLM streams it (one chunk, not a second empty one)."""
    sp = {"max_tokens": 5, "n": 2, "temperature": 1.0}
    reply = _reply(EOS, {})
    assert not ends_at_first_token(reply, sp)
    events, shown = first_chunk(reply, request_id="generate-tokens-x", output_mode="tokens",
                                sampling_params=sp)
    first, second = (e["choices"][0] for e in sse.json_events(events)[:2])
    assert (first["finish_reason"], second["finish_reason"]) == ("stop", None)
    assert [t.final for t in shown] == [True, False]


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
    first, second = sse.json_events(events)[:2]
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
