"""Text mode, stop rules, logprobs, n>1, the queue and the heartbeat of a queued decode request."""

from __future__ import annotations

import asyncio
import itertools
import random
from typing import Any

import aiohttp
import pytest

from tests.fixtures_sim import SimFactory
from tests.sim.helpers import ABORT, GEN, body, eventually, post_json, stream_events, stream_tokens
from tests.sim.test_pd import PROMPT, do_prefill, metric_value, releases
from workers.sim.tokenizer import ByteTokenizer, DecodeStream, IncrementalDecoder, gpt2_byte_order

TOK = ByteTokenizer()


def text_body(**kw: Any) -> dict[str, Any]:
    return body(output_mode="text", **kw)


def stream_text(events: list[Any]) -> str:
    return "".join(e["choices"][0]["text"] for e in events if isinstance(e, dict) and e.get("choices"))


def test_tokenizer_layout_matches_the_traces() -> None:
    assert TOK.token_text(0) == "<s>" and TOK.token_text(1) == "</s>" and TOK.token_text(2) == "<pad>"
    assert TOK.token_text(3) == "!"
    ids = {0xC3: 130, 0xA9: 105, 0xE2: 161, 0x82: 227, 0xAC: 108, 0xF0: 175, 0x9F: 256, 0x98: 249, 0x80: 225}
    for byte, tid in ids.items():
        assert TOK.token_bytes[tid] == bytes([byte])
    assert sorted(gpt2_byte_order()) == list(range(256))
    assert len(set(TOK.token_bytes[3:])) == 512  # every id decodes to distinct bytes
    dec = IncrementalDecoder(TOK)
    assert [dec.feed(t) for t in (130, 105, 175, 256, 249, 225)] == ["", "é", "", "", "", "😀"]
    assert TOK.decode([0, 130, 105], skip_special_tokens=False) == "<s>é"


async def test_text_stream_equals_nonstream_and_utf8_splits(sim_factory: SimFactory) -> None:
    w = await sim_factory(zero_latency=True)
    allowed = {"allowed_token_ids": [130, 105, 161, 227, 108]}
    async with aiohttp.ClientSession() as s:
        _, full = await post_json(s, w.url + GEN, text_body(max_tokens=24, sp=allowed))
        evs = await stream_events(s, w.url + GEN, text_body(max_tokens=24, stream=True, sp=allowed))
    toks = full["choices"][0]["token_ids"]
    assert stream_tokens(evs) == toks
    assert stream_text(evs) == full["choices"][0]["text"]
    deltas = [e["choices"][0]["text"] for e in evs if isinstance(e, dict)]
    assert "" in deltas  # a byte that leaves a character unfinished adds no text
    dec = IncrementalDecoder(TOK)
    assert deltas == [dec.feed(t) for t in toks]


async def test_stop_string_straddling_chunks_is_held_back(sim_factory: SimFactory) -> None:
    w = await sim_factory(zero_latency=True)
    words = {"allowed_token_ids": list(range(259, 283))}  # multi-character pieces only
    async with aiohttp.ClientSession() as s:
        _, ref = await post_json(s, w.url + GEN, text_body(max_tokens=12, sp=words))
        toks = ref["choices"][0]["token_ids"]
        pieces = [TOK.token_text(t) for t in toks]
        # a stop string made of the end of token 4's text and the start of token 5's
        stop = pieces[4][-2:] + pieces[5][:2]
        cut = "".join(pieces[:4]) + pieces[4][:-2]
        evs = await stream_events(
            s, w.url + GEN, text_body(max_tokens=12, stream=True, sp={**words, "stop": [stop]})
        )
        _, full = await post_json(s, w.url + GEN, text_body(max_tokens=12, sp={**words, "stop": [stop]}))
        inc = await stream_events(
            s,
            w.url + GEN,
            text_body(
                max_tokens=12, stream=True, sp={**words, "stop": stop, "include_stop_str_in_output": True}
            ),
        )
    last = evs[-2]["choices"][0]
    assert (last["finish_reason"], last["stop_reason"]) == ("stop", stop)
    assert stream_tokens(evs) == toks[:6]  # the token that completes the stop string is included
    assert stream_text(evs) == cut == full["choices"][0]["text"]
    # while running, the last len(stop)-1 characters are always held back
    assert all(
        len(stream_text(evs[: i + 1])) <= max(0, len("".join(pieces[: i + 1])) - (len(stop) - 1))
        for i in range(len(evs) - 2)
    )
    assert stream_text(inc) == cut + stop


async def test_tokens_mode_stop_string_cuts_tokens_not_text(sim_factory: SimFactory) -> None:
    w = await sim_factory(zero_latency=True)
    async with aiohttp.ClientSession() as s:
        _, ref = await post_json(s, w.url + GEN, body(max_tokens=12))
        toks = ref["choices"][0]["token_ids"]
        stop = TOK.token_text(toks[3])
        _, res = await post_json(s, w.url + GEN, body(max_tokens=12, sp={"stop": [stop]}))
    c = res["choices"][0]
    dec = IncrementalDecoder(TOK)
    texts: list[str] = []
    for t in toks:
        texts.append((texts[-1] if texts else "") + dec.feed(t))
    first = next(i for i, text in enumerate(texts) if stop in text)
    assert (c["finish_reason"], c["stop_reason"], c["token_ids"]) == ("stop", stop, toks[: first + 1])
    assert "text" not in c


async def test_special_tokens_and_skip(sim_factory: SimFactory) -> None:
    w = await sim_factory(zero_latency=True)
    sp = {"allowed_token_ids": [0, 2, 300]}
    async with aiohttp.ClientSession() as s:
        _, skip = await post_json(s, w.url + GEN, text_body(max_tokens=8, sp=sp))
        _, keep = await post_json(
            s, w.url + GEN, text_body(max_tokens=8, sp={**sp, "skip_special_tokens": False})
        )
    toks = skip["choices"][0]["token_ids"]
    assert toks == keep["choices"][0]["token_ids"]
    assert skip["choices"][0]["text"] == TOK.decode(toks, skip_special_tokens=True)
    assert keep["choices"][0]["text"] == TOK.decode(toks, skip_special_tokens=False)
    assert "<s>" in keep["choices"][0]["text"] or "<pad>" in keep["choices"][0]["text"]


async def test_stop_token_ids_eos_min_tokens_ignore_eos(sim_factory: SimFactory) -> None:
    w = await sim_factory(zero_latency=True, tokens_only=True, enable_scale_out=False)
    async with aiohttp.ClientSession() as s:
        _, st = await post_json(
            s, w.url + GEN, body(max_tokens=50, sp={"allowed_token_ids": [5, 6, 7], "stop_token_ids": [6]})
        )
        _, eos = await post_json(s, w.url + GEN, body(max_tokens=50, sp={"allowed_token_ids": [1, 5]}))
        _, mn = await post_json(
            s, w.url + GEN, body(max_tokens=50, sp={"allowed_token_ids": [1, 5], "min_tokens": 10})
        )
        _, ign = await post_json(
            s, w.url + GEN, body(max_tokens=20, sp={"allowed_token_ids": [1, 5], "ignore_eos": True})
        )
    c = st["choices"][0]
    assert (c["finish_reason"], c["stop_reason"], c["token_ids"][-1]) == ("stop", 6, 6)
    assert 6 not in c["token_ids"][:-1]
    c = eos["choices"][0]
    assert (c["finish_reason"], c["stop_reason"], c["token_ids"][-1]) == ("stop", None, 1)
    c = mn["choices"][0]
    assert 1 not in c["token_ids"][:10] and len(c["token_ids"]) >= 10
    c = ign["choices"][0]
    assert c["finish_reason"] == "length" and len(c["token_ids"]) == 20 and 1 in c["token_ids"]


async def test_logprob_shapes(sim_factory: SimFactory) -> None:
    w = await sim_factory(zero_latency=True)
    async with aiohttp.ClientSession() as s:
        _, tok = await post_json(s, w.url + GEN, body(max_tokens=3, sp={"logprobs": 2, "prompt_logprobs": 1}))
        _, txt = await post_json(s, w.url + GEN, text_body(max_tokens=3, sp={"logprobs": 0}))
        evs = await stream_events(
            s, w.url + GEN, body(max_tokens=3, stream=True, sp={"logprobs": 1, "prompt_logprobs": 1})
        )
        st, err = await post_json(s, w.url + GEN, body(sp={"logprobs": 21}))
    content = tok["choices"][0]["logprobs"]["content"]
    assert [c["token_id"] for c in content] == tok["choices"][0]["token_ids"]
    assert list(content[0]) == ["token_id", "logprob", "rank", "top_logprobs"]
    assert [t["rank"] for t in content[0]["top_logprobs"]] == [1, 2]
    assert content[0]["top_logprobs"][0]["token_id"] == content[0]["token_id"]
    plp = tok["prompt_logprobs"]
    assert plp[0] is None and len(plp) == 7
    assert all(str(t) in entry for t, entry in zip(body()["token_ids"][1:], plp[1:], strict=True))
    tc = txt["choices"][0]["logprobs"]["content"][0]
    assert list(tc) == ["token", "logprob", "bytes", "top_logprobs"] and len(tc["top_logprobs"]) == 1
    assert tc["bytes"] == list(tc["token"].encode())
    assert all(len(e["choices"][0]["logprobs"]["content"]) == 1 for e in evs[:3])
    assert st == 400 and err["error"]["param"] == "logprobs"


async def test_n2_sampled_is_seeded_and_interleaved(sim_factory: SimFactory) -> None:
    w = await sim_factory(zero_latency=True)
    sp = {"n": 2, "temperature": 1.0, "seed": 1234}
    async with aiohttp.ClientSession() as s:
        _, a = await post_json(s, w.url + GEN, body(max_tokens=5, sp=sp))
        _, b = await post_json(s, w.url + GEN, body(max_tokens=5, sp=sp))
        evs = await stream_events(s, w.url + GEN, body(max_tokens=5, stream=True, sp=sp))
        st, err = await post_json(s, w.url + GEN, body(sp={"n": 2}))
    assert a["choices"] == b["choices"]
    t0, t1 = a["choices"][0]["token_ids"], a["choices"][1]["token_ids"]
    assert t0 != t1
    assert stream_tokens(evs, 0) == t0 and stream_tokens(evs, 1) == t1
    assert a["usage"]["completion_tokens"] == 10
    assert (st, err["error"]["message"]) == (400, "n must be 1 when using greedy sampling, got 2.")


async def test_models_endpoint(sim_factory: SimFactory) -> None:
    w = await sim_factory(zero_latency=True, model_name="m1", max_model_len=256)
    async with aiohttp.ClientSession() as s, s.get(w.url + "/v1/models") as r:
        data = await r.json()
    assert (
        data["object"] == "list" and data["data"][0]["id"] == "m1" and data["data"][0]["max_model_len"] == 256
    )


async def test_waiting_queue_and_metric(sim_factory: SimFactory) -> None:
    w = await sim_factory(max_running=1, itl_ms=5.0, prefill_base_ms=0.0)
    async with aiohttp.ClientSession() as s:
        first = asyncio.ensure_future(
            post_json(s, w.url + GEN, body(max_tokens=400, request_id="q1", sp={"ignore_eos": True}))
        )
        second = asyncio.ensure_future(post_json(s, w.url + GEN, body(max_tokens=3, request_id="q2")))

        async def queued() -> bool:
            st = await w.state()
            return bool(st["running"] == 1 and st["waiting"] == 1)

        assert await eventually(queued)
        async with s.get(w.url + "/metrics") as r:
            text = await r.text()
        assert metric_value(text, 'vllm:num_requests_waiting{engine="0",model_name="tiny-llama"}') == 1.0
        await post_json(s, w.url + ABORT, {"request_ids": ["generate-tokens-q1"]})
        (_, a), (_, b) = await asyncio.gather(first, second)
    assert a["choices"][0]["finish_reason"] == "abort"
    assert b["choices"][0]["finish_reason"] == "length" and len(b["choices"][0]["token_ids"]) == 3


async def test_queued_decode_heartbeat_keeps_the_lease(sim_factory: SimFactory) -> None:
    p = await sim_factory(role="prefill", zero_latency=True, lease_seconds=1.0)
    d = await sim_factory(role="decode", max_running=1, itl_ms=5.0, prefill_base_ms=0.0, kv_heartbeat_s=0.1)
    async with aiohttp.ClientSession() as s:
        blocker = asyncio.ensure_future(
            post_json(s, d.url + GEN, body(max_tokens=400, request_id="hb-blk", sp={"ignore_eos": True}))
        )
        kv = await do_prefill(s, p, "hb")
        queued = asyncio.ensure_future(
            post_json(s, d.url + GEN, body(PROMPT, max_tokens=3, kv_transfer_params=kv))
        )
        await asyncio.sleep(1.6)  # longer than the lease: only the heartbeats keep it
        assert (await releases(p))["expired"] == 0
        await post_json(s, d.url + ABORT, {"request_ids": ["generate-tokens-hb-blk"]})
        await blocker
        st, res = await queued
    assert st == 200 and res["choices"][0]["finish_reason"] == "length"
    assert await releases(p) == {"pulled": 1, "aborted": 0, "expired": 0}


def _hf_tokenizer() -> Any:
    """The same vocabulary as a ``tokenizers`` byte-level BPE (decoding only needs the vocab)."""
    tk = pytest.importorskip("tokenizers")
    order = gpt2_byte_order()
    printable = order[:188]
    b2u: dict[int, str] = {}
    extra = 0
    for b in range(256):
        if b in printable:
            b2u[b] = chr(b)
        else:
            b2u[b] = chr(256 + extra)
            extra += 1
    vocab = {"<s>": 0, "</s>": 1, "<pad>": 2}
    for i, tb in enumerate(TOK.token_bytes[3:], start=3):
        vocab["".join(b2u[x] for x in tb)] = i
    hf = tk.Tokenizer(tk.models.BPE(vocab=vocab, merges=[]))
    hf.decoder = tk.decoders.ByteLevel()
    hf.add_special_tokens(["<s>", "</s>", "<pad>"])
    return hf


def test_decode_stream_matches_tokenizers_decodestream() -> None:
    hf = _hf_tokenizer()
    hf_decode_stream = pytest.importorskip("tokenizers.decoders").DecodeStream

    rng = random.Random(7)
    alphabet = [
        0,
        1,
        2,
        130,
        105,
        161,
        227,
        108,
        175,
        256,
        249,
        225,
        300,
        301,
        264,
        56,
        163,
        118,
        5,
        6,
        283,
        290,
    ]
    for _ in range(1500):
        prompt = [rng.choice(alphabet) for _ in range(rng.randint(1, 8))]
        out = [rng.choice(alphabet) for _ in range(rng.randint(1, 10))]
        skip = rng.random() < 0.5
        ours = DecodeStream(TOK, prompt, skip)
        theirs = hf_decode_stream(ids=prompt, skip_special_tokens=skip)
        assert [ours.step(t) for t in out] == [theirs.step(hf, t) for t in out], (prompt, out, skip)
        assert TOK.decode(prompt + out, skip) == hf.decode(prompt + out, skip_special_tokens=skip)


async def test_prompt_ending_mid_character_repeats_the_prompt_text(sim_factory: SimFactory) -> None:
    w = await sim_factory(zero_latency=True)
    prompt = [300, 301, 302, 130]  # ends with the first byte of "é"
    async with aiohttp.ClientSession() as s:
        evs = await stream_events(
            s,
            w.url + GEN,
            text_body(tokens=prompt, max_tokens=2, stream=True, sp={"allowed_token_ids": [105, 300]}),
        )
    first_text = next(e["choices"][0]["text"] for e in evs if isinstance(e, dict) and e["choices"][0]["text"])
    assert first_text.startswith(TOK.decode(prompt[:3]))  # vLLM's DecodeStream re-emits the prompt's text


async def test_stop_terminating_token_text_is_left_out(sim_factory: SimFactory) -> None:
    w = await sim_factory(zero_latency=True)
    sp = {"allowed_token_ids": [0, 300], "skip_special_tokens": False, "stop_token_ids": [0]}
    async with aiohttp.ClientSession() as s:
        _, out = await post_json(s, w.url + GEN, text_body(max_tokens=30, sp=sp))
        _, inc = await post_json(
            s, w.url + GEN, text_body(max_tokens=30, sp={**sp, "include_stop_str_in_output": True})
        )
    c = out["choices"][0]
    assert (c["finish_reason"], c["stop_reason"], c["token_ids"][-1]) == ("stop", 0, 0)
    assert not c["text"].endswith("<s>")
    assert inc["choices"][0]["text"] == c["text"] + "<s>"


async def test_text_logprob_tokens_complete_split_characters(sim_factory: SimFactory) -> None:
    w = await sim_factory(zero_latency=True)
    async with aiohttp.ClientSession() as s:
        _, res = await post_json(
            s, w.url + GEN, text_body(max_tokens=12, sp={"allowed_token_ids": [130, 105], "logprobs": 0})
        )
    toks = res["choices"][0]["token_ids"]
    content = res["choices"][0]["logprobs"]["content"]
    assert any(a == 130 and b == 105 for a, b in itertools.pairwise(toks))  # the case under test occurs
    for i, (t, entry) in enumerate(zip(toks, content, strict=True)):
        prev = toks[i - 1] if i else None
        if t == 105 and prev == 130:
            assert entry["token"] == "é" and entry["bytes"] == [195, 169]
        if t == 130 and i == 0:
            assert entry["token"] == "" and entry["bytes"] == []


async def test_top_logprobs_are_cut_at_k_and_placeholders(sim_factory: SimFactory) -> None:
    w = await sim_factory(zero_latency=True)
    p = await sim_factory(zero_latency=True, return_tokens_as_token_ids=True)
    sampled = {"temperature": 1.0, "seed": 5, "logprobs": 1}
    async with aiohttp.ClientSession() as s:
        _, res = await post_json(s, w.url + GEN, body(max_tokens=40, sp=sampled))
        _, ph = await post_json(s, p.url + GEN, text_body(max_tokens=3, sp={"logprobs": 2}))
    content = res["choices"][0]["logprobs"]["content"]
    assert any(c["rank"] > 1 for c in content)  # some sampled tokens are not the top choice
    for c in content:
        assert len(c["top_logprobs"]) == 1 and c["top_logprobs"][0]["token_id"] == c["token_id"]
    first = ph["choices"][0]["logprobs"]["content"][0]
    assert first["token"] == f"token_id:{ph['choices'][0]['token_ids'][0]}" and first["bytes"] is None
    assert all(t["token"].startswith("token_id:") for t in first["top_logprobs"])
