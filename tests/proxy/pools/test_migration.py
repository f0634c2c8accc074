"""Migration: the continuation of an interrupted greedy stream equals the uninterrupted run.

``FakeGreedyWorker`` is a deterministic stand-in for a decode worker: the next token depends on
the whole context, tokens divisible by 5 are "bytes of an unfinished character" whose text is
held back until the next complete token (as vLLM's detokenizer does), and a prompt that ends in
such a token makes the first text delta garbage (as vLLM does; see the trace
gen-text-stream-prompt-tail-utf8)."""

from __future__ import annotations

import json
from typing import Any

import pydantic_core
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.pools.migration import (
    Replay,
    StreamFollower,
    StreamProgress,
    migration_blocker,
    plan_continuation,
    rewrite_choice,
    rewrite_usage,
)

VOCAB = 40


def next_token(context: list[int]) -> int:
    h = 7
    for t in context[-4:]:
        h = (h * 31 + t) % 1_000_003
    return (h + len(context)) % VOCAB


def piece(t: int) -> str:
    return f"<{t}>"


def run(prompt: list[int], max_tokens: int, mode: str) -> list[dict[str, Any]]:
    """The choices a greedy worker streams, one token per chunk."""
    context = list(prompt)
    held: list[int] = []
    garbage = mode == "text" and prompt[-1] % 5 == 0
    out: list[dict[str, Any]] = []
    for i in range(max_tokens):
        t = next_token(context)
        context.append(t)
        choice: dict[str, Any] = {"index": 0, "token_ids": [t],
                                  "finish_reason": "length" if i == max_tokens - 1 else None,
                                  "logprobs": {"content": [{"token_id": t, "logprob": -1.0}]}}
        if mode == "text":
            if t % 5 == 0 and i != max_tokens - 1:
                choice["text"] = ""
                held.append(t)
            else:
                choice["text"] = ("#garbage#" if garbage else "") + "".join(map(piece, [*held, t]))
                garbage = False
                held = []
        out.append(choice)
    return out


def merged(choices: list[dict[str, Any]], sizes: list[int]) -> list[dict[str, Any]]:
    """``choices`` with consecutive ones merged into chunks of ``sizes`` (cycled), as vLLM merges
    the steps of a stream its client reads slower than it generates: ids, text and logprobs
    concatenated, the last finish_reason kept."""
    out: list[dict[str, Any]] = []
    i = k = 0
    while i < len(choices):
        group = choices[i: i + max(1, sizes[k % len(sizes)])]
        i, k = i + len(group), k + 1
        chunk = dict(group[-1])
        chunk["token_ids"] = [t for c in group for t in c["token_ids"]]
        chunk["logprobs"] = {"content": [e for c in group for e in c["logprobs"]["content"]]}
        if "text" in chunk:
            chunk["text"] = "".join(c["text"] for c in group)
        out.append(chunk)
    return out


def request(prompt: list[int], max_tokens: int, mode: str, **sp: Any) -> dict[str, Any]:
    return {"token_ids": prompt, "output_mode": mode, "stream": True,
            "sampling_params": {"temperature": 0, "max_tokens": max_tokens, **sp},
            "kv_transfer_params": {"do_remote_prefill": True}}


def migrate(data: dict[str, Any], cut: int, sizes: tuple[list[int], list[int]] = ([1], [1]),
            ) -> tuple[list[dict[str, Any]], int]:
    """Stream `cut` chunks from one worker, then continue on a second (each worker's steps merged
    into chunks of ``sizes``). Returns what the client received and the continuation's replay count."""
    mode = data["output_mode"]
    first = merged(run(data["token_ids"], data["sampling_params"]["max_tokens"], mode), sizes[0])[:cut]
    progress = StreamProgress(output_mode=mode)
    for choice in first:
        progress.feed(choice)
    cont = plan_continuation(data, progress, request_id="r-2")
    if cont is None:
        return first, 0
    assert cont.body["request_id"] == "r-2" and "kv_transfer_params" not in cont.body
    second = merged(run(cont.body["token_ids"], cont.body["sampling_params"]["max_tokens"], mode), sizes[1])
    replay = Replay(cont.replay, cont.replay_chars)
    rewritten = [rewrite_choice(choice, replay, cont.kept) for choice in second]
    return first + rewritten, cont.replay


def flatten(choices: list[dict[str, Any]], key: str) -> Any:
    if key == "token_ids":
        return [t for c in choices for t in c["token_ids"]]
    if key == "logprobs":
        return [e["token_id"] for c in choices for e in c["logprobs"]["content"]]
    return "".join(c.get("text", "") for c in choices)


@settings(max_examples=150, deadline=None)
@given(prompt=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12),
       max_tokens=st.integers(1, 30), cut_frac=st.floats(0, 1), mode=st.sampled_from(["tokens", "text"]))
def test_continuation_is_seamless(prompt: list[int], max_tokens: int, cut_frac: float, mode: str) -> None:
    data = request(prompt, max_tokens, mode)
    whole = run(prompt, max_tokens, mode)
    cut = min(max_tokens, int(cut_frac * max_tokens))
    got, _ = migrate(data, cut)
    assert flatten(got, "token_ids") == flatten(whole, "token_ids")
    assert flatten(got, "logprobs") == flatten(whole, "token_ids")
    if mode == "text":
        assert flatten(got, "text") == flatten(whole, "text")


@settings(max_examples=300, deadline=None)
@given(prompt=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12),
       max_tokens=st.integers(1, 30), cut=st.integers(0, 30),
       before=st.lists(st.integers(1, 6), min_size=1, max_size=5),
       after=st.lists(st.integers(1, 6), min_size=1, max_size=5))
def test_continuation_is_seamless_when_the_worker_merges_steps(
        prompt: list[int], max_tokens: int, cut: int, before: list[int], after: list[int]) -> None:
    """Seen on real vLLM under load: a chunk of several steps whose text ends before its last
    tokens (held back). The seam must still not show, in either worker's chunking."""
    data = request(prompt, max_tokens, "text")
    whole = run(prompt, max_tokens, "text")
    got, _ = migrate(data, cut, (before, after))
    assert flatten(got, "token_ids") == flatten(whole, "token_ids")
    assert flatten(got, "text") == flatten(whole, "text")


def test_text_mode_rewinds_held_back_tokens() -> None:
    # find a prompt whose run has a held-back token right at the cut
    for seed in range(200):
        prompt = [seed % VOCAB, (seed * 7) % VOCAB, 3]
        whole = run(prompt, 20, "text")
        cuts = [i + 1 for i, c in enumerate(whole[:-1]) if c["text"] == ""]
        if cuts:
            break
    else:
        pytest.fail("no held-back token in any run")
    got, replay = migrate(request(prompt, 20, "text"), cuts[0])
    assert replay >= 1
    assert flatten(got, "text") == flatten(whole, "text")
    # without the rewind, the seam would show: the prompt would end in the middle of a character
    naive = run(prompt + flatten(whole[: cuts[0]], "token_ids"), 20 - cuts[0], "text")
    assert "#garbage#" in flatten(naive, "text")


def test_plan_reduces_max_and_min_tokens_and_drops_prompt_logprobs() -> None:
    data = request([1, 2, 3], 10, "tokens", min_tokens=6, prompt_logprobs=2)
    progress = StreamProgress()
    progress.feed({"token_ids": [4, 5]})
    progress.feed({"token_ids": [6, 7]})
    cont = plan_continuation(data, progress)
    assert cont is not None
    assert cont.body["token_ids"] == [1, 2, 3, 4, 5, 6, 7]
    sp = cont.body["sampling_params"]
    assert sp["max_tokens"] == 6 and sp["min_tokens"] == 2 and "prompt_logprobs" not in sp
    assert data["sampling_params"]["max_tokens"] == 10  # the original is untouched
    progress.feed({"token_ids": [8, 9]})
    cont = plan_continuation(data, progress)
    assert cont is not None and "min_tokens" not in cont.body["sampling_params"]
    progress.feed({"token_ids": [1, 1, 1, 1]})
    assert plan_continuation(data, progress) is None  # nothing left to generate
    no_max = request([1], 5, "tokens")
    del no_max["sampling_params"]["max_tokens"]
    cont = plan_continuation(no_max, progress)
    assert cont is not None and "max_tokens" not in cont.body["sampling_params"]


def test_usage_is_the_original_requests() -> None:
    data = request([1, 2, 3], 10, "text")
    progress = StreamProgress(output_mode="text")
    progress.feed({"token_ids": [4], "text": "a"})
    progress.feed({"token_ids": [5], "text": "b"})
    progress.feed({"token_ids": [10], "text": ""})
    cont = plan_continuation(data, progress)
    assert cont is not None and cont.kept == 2 and cont.replay == 1
    # the continuation: prompt 5, it generated 8 (the replayed one included)
    usage = rewrite_usage({"prompt_tokens": 5, "completion_tokens": 8, "total_tokens": 13}, cont)
    assert usage == {"prompt_tokens": 3, "completion_tokens": 10, "total_tokens": 13}


def test_weight_versions_positions_shift() -> None:
    choice = {"token_ids": [1], "weight_versions": [{"version": "v", "start": 0, "end": 3},
                                                    {"version": "w", "start": 3, "end": 5}]}
    replay = Replay()
    out = rewrite_choice(choice, replay, 4)
    assert out["weight_versions"] == [{"version": "v", "start": 0, "end": 7},
                                      {"version": "w", "start": 7, "end": 9}]
    assert replay == Replay()


@pytest.mark.parametrize(("sp", "extra", "reason"), [
    ({"n": 2}, {}, "n > 1"),
    ({"stop": ["\n"]}, {}, "stop strings"),
    ({"presence_penalty": 0.5}, {}, "presence_penalty"),
    ({"frequency_penalty": 1}, {}, "frequency_penalty"),
    ({"structured_outputs": {"json": {}}}, {}, "structured_outputs"),
    ({"bad_words": ["x"]}, {}, "bad_words"),
    ({"truncate_prompt_tokens": 5}, {}, "truncate_prompt_tokens"),
    ({}, {"features": {"image": []}}, "multimodal input"),
])
def test_blockers(sp: dict[str, Any], extra: dict[str, Any], reason: str) -> None:
    assert migration_blocker({**request([1], 5, "tokens", **sp), **extra}) == reason


def test_plain_requests_migrate() -> None:
    assert migration_blocker(request([1], 5, "text", presence_penalty=0, stop=[], n=1,
                                     repetition_penalty=1.2, stop_token_ids=[2])) is None
    assert migration_blocker({"token_ids": [1]}) == "no sampling_params"


def events(choices: list[dict[str, Any]], rid: str = "generate-tokens-r") -> list[bytes]:
    return [json.dumps({"request_id": rid, "usage": None, "output_mode": "text", "choices": [c]}).encode()
            for c in choices]


@settings(max_examples=60, deadline=None)
@given(prompt=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8), max_tokens=st.integers(2, 25),
       cuts=st.lists(st.floats(0, 1), min_size=1, max_size=3), mode=st.sampled_from(["tokens", "text"]))
def test_follower_survives_several_migrations(prompt: list[int], max_tokens: int, cuts: list[float],
                                              mode: str) -> None:
    data = request(prompt, max_tokens, mode)
    whole = run(prompt, max_tokens, mode)
    follower = StreamFollower(data, mode)
    sent: list[dict[str, Any]] = []
    body = data
    for frac in [*cuts, 1.0]:
        stream = run(body["token_ids"], body["sampling_params"]["max_tokens"], mode)
        take = len(stream) if frac == 1.0 else int(frac * len(stream))
        for payload in events(stream[:take]):
            out = follower.event(payload)
            if out is not None:
                sent.extend(json.loads(out)["choices"])
        if frac == 1.0:
            break
        cont = follower.continue_elsewhere("r")
        if cont is None:
            break
        body = cont.body
    assert flatten(sent, "token_ids") == flatten(whole, "token_ids")
    if mode == "text":
        assert flatten(sent, "text") == flatten(whole, "text")
    assert all(c["token_ids"] or c.get("text") or c["finish_reason"] for c in sent)


def test_follower_rewrites_usage_and_passes_unknown_payloads() -> None:
    data = request([1, 2, 3], 6, "tokens")
    follower = StreamFollower(data, "tokens")
    for payload in events([{"index": 0, "token_ids": [7, 8], "finish_reason": None}]):
        assert follower.event(payload) == payload  # before a migration: untouched bytes
    assert follower.event(b"not json") == b"not json"
    cont = follower.continue_elsewhere()
    assert cont is not None and cont.body["token_ids"] == [1, 2, 3, 7, 8] and follower.migrations == 1
    usage = {"request_id": "x", "usage": {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9},
             "choices": []}
    out = follower.event(json.dumps(usage).encode())
    assert out is not None
    assert json.loads(out)["usage"] == {"prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9}
    assert not follower.finished()


def test_a_migrated_chunk_spells_floats_as_vllm_streams_do() -> None:
    """vLLM writes stream chunks with pydantic-core (``model_dump_json``): ``-1.25e-7`` and
    ``-0.00001`` where ``json.dumps`` has ``-1.25e-07`` and ``-1e-05``. A chunk the follower
    rewrote after a migration is spelled as the chunk vLLM would have sent."""
    follower = StreamFollower(request([1, 2, 3], 6, "tokens"), "tokens")
    for payload in events([{"index": 0, "token_ids": [7], "finish_reason": None}]):
        follower.event(payload)
    assert follower.continue_elsewhere() is not None
    lp = {"content": [{"token_id": 9, "logprob": -1.25e-07, "rank": 1,
                       "top_logprobs": [{"token_id": 9, "logprob": -1.25e-07, "rank": 1},
                                        {"token_id": 4, "logprob": -1e-05, "rank": 2}]}]}
    chunk = {"request_id": "generate-tokens-r", "usage": None, "output_mode": "tokens",
             "choices": [{"index": 0, "finish_reason": None, "token_ids": [9], "logprobs": lp}]}
    out = follower.event(pydantic_core.to_json(chunk))  # as the continuation's worker wrote it
    assert out is not None
    assert out == pydantic_core.to_json(chunk)  # nothing to strip: the same bytes
    assert b"-1.25e-7" in out and b"-0.00001" in out and b"e-07" not in out
