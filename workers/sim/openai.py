"""vLLM 0.32's OpenAI surface for pd-sim's byte tokenizer: the scale-out render/derender endpoints
(``vllm/entrypoints/scale_out/{render,derender}``) and the plain ``/v1/chat/completions`` and
``/v1/completions`` of one aggregated server, with the shapes of the traces in
``tests/data/traces/vllm-0.32.0-cpu/openai/``.

The plain endpoints are render -> the worker's own ``/inference/v1/generate`` (over loopback, so
timing, faults and KV behave as for any generate call) -> the aggregated server's response shape.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Sequence
from typing import Any

import aiohttp
from aiohttp import web

from .errors import BadRequest, InternalError, NotFound, SimError
from .protocol import unsupported_media_type, usage_body, validation_error, vllm_error
from .state import DUMPS, SIM, SimState, json_response, read_json
from .tokenizer import NUM_SPECIAL, SPECIAL_TOKENS, ByteTokenizer, gpt2_byte_order, logprob_token_text

# The tiny-llama chat template (and pd-sim's): one "role: content" line per message, then "assistant:".
CHAT_TEMPLATE = "{role}: {content}\n"
GENERATION_PROMPT = "assistant:"
SYSTEM_FINGERPRINT = "vllm-0.32.0-5eed51a1"
_DETOK_OFFSET = 5  # vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET
_OUTPUT_KIND_DELTA = 1
_OUTPUT_KIND_FINAL_ONLY = 2


def _byte_unicode() -> dict[int, str]:
    order = gpt2_byte_order()
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(ord("¡"), ord("¬") + 1))
    printable |= set(range(ord("®"), ord("ÿ") + 1))
    out: dict[int, str] = {}
    extra = 0
    for b in order:
        if b in printable:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


class TokenStrings:
    """``convert_ids_to_tokens`` / ``convert_tokens_to_string`` of a byte-level BPE over pd-sim's
    vocabulary: a token's string is its bytes in GPT-2's byte-to-unicode alphabet."""

    def __init__(self, tokenizer: ByteTokenizer) -> None:
        self.tok = tokenizer
        b2u = _byte_unicode()
        self._u2b = {u: b for b, u in b2u.items()}
        self.strings = [
            SPECIAL_TOKENS[i] if i < NUM_SPECIAL else "".join(b2u[b] for b in tb)
            for i, tb in enumerate(tokenizer.token_bytes)
        ]

    def ids_to_tokens(self, ids: Sequence[int], skip_special: bool) -> list[str]:
        n = len(self.strings)
        return [
            self.strings[i] if 0 <= i < n else "" for i in ids if not (skip_special and 0 <= i < NUM_SPECIAL)
        ]

    def to_string(self, tokens: Sequence[str]) -> str:
        data = bytearray()
        for t in tokens:
            if t in SPECIAL_TOKENS:
                data += t.encode()
            else:
                data += bytes(self._u2b.get(c, 63) for c in t)
        return data.decode("utf-8", errors="replace")


def seed_state(
    ts: TokenStrings, prompt_ids: Sequence[int] | None, skip_special: bool = True
) -> dict[str, Any]:
    """vLLM's ``_seed_stream_state``: the prompt tail primes the incremental decoder."""
    state = new_stream_state()
    if not prompt_ids:
        return state
    toks = ts.ids_to_tokens(list(prompt_ids)[-_DETOK_OFFSET - 2 :], skip_special)
    state["prev_tokens"] = toks
    state["read_offset"] = len(toks)
    state["prefix_offset"] = max(len(toks) - _DETOK_OFFSET, 0)
    return state


def new_stream_state() -> dict[str, Any]:
    return {
        "prev_tokens": [],
        "prefix_offset": 0,
        "read_offset": 0,
        "role_sent": False,
        "logprob_context_token_ids": [],
        "logprob_text_offset": 0,
        "output_token_ids": [],
        "output_chunk_lens": [],
        "tools_streamed": False,
        "last_tool_call_ids": [],
    }


def detokenize_delta(
    ts: TokenStrings, ids: Sequence[int], state: dict[str, Any], skip_special: bool = True
) -> tuple[str, dict[str, Any]]:
    """vLLM's ``OnlineDerenderer._detokenize_delta`` (``detokenize_incrementally`` per token, the
    window trimmed to ``prefix_offset`` and rebased after each)."""
    prev: list[str] = list(state["prev_tokens"])
    prefix_offset: int = state["prefix_offset"]
    read_offset: int = state["read_offset"]
    parts: list[str] = []
    for tok in ids:
        new = ts.ids_to_tokens([tok], skip_special)
        out = prev + new
        prefix_text = ts.to_string(out[prefix_offset:read_offset])
        new_text = ts.to_string(out[prefix_offset:])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            text = ""
        else:
            text = new_text[len(prefix_text) :]
            prefix_offset, read_offset = read_offset, len(out)
        prev = out[prefix_offset:]
        read_offset -= prefix_offset
        prefix_offset = 0
        parts.append(text)
    return "".join(parts), {
        **state,
        "prev_tokens": prev,
        "prefix_offset": prefix_offset,
        "read_offset": read_offset,
    }


# -- render --------------------------------------------------------------------------------------


def _check_model(st: SimState, body: dict[str, Any]) -> None:
    model = body.get("model")
    name = st.settings.model_name
    if model is not None and model != name:
        raise NotFound(f"The model `{model}` does not exist. Valid aliases: {name}.", param="model")


def _require(body: Any, field: str) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise validation_error(
            [
                {
                    "type": "model_attributes_type",
                    "loc": ("body",),
                    "msg": "Input should be a valid dictionary or object to extract fields from",
                    "input": body,
                }
            ]
        )
    if field not in body:
        raise validation_error(
            [{"type": "missing", "loc": ("body", field), "msg": "Field required", "input": body}]
        )
    return body


def chat_prompt(messages: Any) -> str:
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list", param="messages")
    out = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest("each message needs a string role", param="messages")
        content = m.get("content")
        if isinstance(content, list):  # text parts only
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        out.append(CHAT_TEMPLATE.format(role=m["role"], content="" if content is None else content))
    return "".join(out) + GENERATION_PROMPT


def _int_param(body: dict[str, Any], name: str) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise validation_error(
            [
                {
                    "type": "int_type",
                    "loc": ("body", name),
                    "msg": "Input should be a valid integer",
                    "input": v,
                }
            ]
        )
    return v


def sampling_params(st: SimState, body: dict[str, Any], prompt_len: int, *, chat: bool) -> dict[str, Any]:
    """The ``SamplingParams`` vLLM 0.32's render dumps (msgspec ``omit_defaults``: explicitly set
    floats and lists always appear; greedy drops top_p/top_k/min_p)."""
    s = st.settings
    max_len = s.max_model_len
    requested = _int_param(body, "max_completion_tokens") if chat else None
    param = "max_completion_tokens"
    if requested is None:
        requested, param = _int_param(body, "max_tokens"), "max_tokens"
    if requested is not None and requested > max_len:
        raise vllm_error(
            f"{param}={requested} cannot be greater than max_model_len={max_len}. "
            "Please request fewer output tokens.",
            param,
            requested,
        )
    if prompt_len > max_len:
        raise vllm_error(
            f"This model's maximum context length is {max_len} tokens. However, your prompt contains "
            f"{prompt_len} input tokens, which exceeds this limit even without any output tokens. "
            "Please reduce the length of the input prompt.",
            "input_tokens",
            prompt_len,
        )
    room = max_len - prompt_len
    max_tokens = room if requested is None else min(requested, room)
    if max_tokens < 1:
        raise vllm_error(f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens", max_tokens)
    temperature = float(body["temperature"]) if body.get("temperature") is not None else 1.0
    n = _int_param(body, "n") or 1
    greedy = temperature < 1e-5
    if greedy and n > 1:
        raise BadRequest(f"n must be 1 when using greedy sampling, got {n}.")
    if body.get("use_beam_search"):
        raise BadRequest("Beam search is not supported by the render endpoint")
    sp: dict[str, Any] = {}
    if n != 1:
        sp["n"] = n
    sp["presence_penalty"] = float(body.get("presence_penalty") or 0.0)
    sp["frequency_penalty"] = float(body.get("frequency_penalty") or 0.0)
    sp["repetition_penalty"] = float(body.get("repetition_penalty") or 1.0)
    sp["temperature"] = temperature
    if not greedy:
        sp["top_p"] = float(body["top_p"]) if body.get("top_p") is not None else 1.0
        top_k = _int_param(body, "top_k")
        if top_k not in (None, 0, -1):
            sp["top_k"] = top_k
        sp["min_p"] = float(body["min_p"]) if body.get("min_p") is not None else 0.0
    seed = _int_param(body, "seed")
    if seed is not None:
        sp["seed"] = seed
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else list(stop) if isinstance(stop, list) else []
    sp["stop"] = stops
    sp["stop_token_ids"] = list(body.get("stop_token_ids") or [])
    if body.get("ignore_eos"):
        sp["ignore_eos"] = True
    sp["max_tokens"] = max_tokens
    min_tokens = _int_param(body, "min_tokens")
    if min_tokens:
        sp["min_tokens"] = min_tokens
    if chat:
        if body.get("logprobs"):
            sp["logprobs"] = _int_param(body, "top_logprobs") or 0
    else:
        lp = _int_param(body, "logprobs")
        if lp is not None:
            sp["logprobs"] = lp
    if body.get("skip_special_tokens") is False:
        sp["skip_special_tokens"] = False
    if body.get("spaces_between_special_tokens") is False:
        sp["spaces_between_special_tokens"] = False
    include_stop = bool(body.get("include_stop_str_in_output"))
    if include_stop:
        sp["include_stop_str_in_output"] = True
    sp["output_kind"] = _OUTPUT_KIND_DELTA if body.get("stream") else _OUTPUT_KIND_FINAL_ONLY
    sp["skip_clone"] = True
    if stops and not include_stop:
        buffer = max(len(x) for x in stops) - 1
        if buffer > 0:
            sp["output_text_buffer_length"] = buffer
    if body.get("allowed_token_ids") is not None:
        sp["allowed_token_ids"] = list(body["allowed_token_ids"])
    sp["bad_words"] = list(body.get("bad_words") or [])
    sp["skip_reading_prefix_cache"] = False
    return sp


def _request_id(request: web.Request, body: dict[str, Any], prefix: str) -> str:
    base = request.headers.get("X-Request-Id")
    if base is None:
        rid = body.get("request_id")
        base = rid if isinstance(rid, str) else secrets.token_hex(8)
    return f"{prefix}-{base}"


def _generate_request(
    request_id: str, token_ids: list[int], sp: dict[str, Any], body: dict[str, Any]
) -> dict[str, Any]:
    stream = bool(body.get("stream"))
    opts = body.get("stream_options") if stream else None
    if isinstance(opts, dict):
        opts = {
            "include_usage": bool(opts.get("include_usage", False)),
            "continuous_usage_stats": bool(opts.get("continuous_usage_stats", False)),
        }
    return {
        "request_id": request_id,
        "token_ids": token_ids,
        "token_offsets": None,
        "features": None,
        "content_parts": None,
        "sampling_params": sp,
        "model": body.get("model"),
        "reasoning_ended": None,
        "reasoning_parser_kwargs": None,
        "return_token_ids": None,
        "output_mode": "tokens",
        "stream": stream,
        "stream_options": opts,
        "cache_salt": body.get("cache_salt"),
        "priority": body.get("priority", 0),
        "kv_transfer_params": None,
        "ec_transfer_params": None,
    }


def _tokenizer(st: SimState) -> ByteTokenizer:
    if st.tokenizer is None:
        raise BadRequest("This endpoint needs a tokenizer; this server does not load one (--tokens-only).")
    return st.tokenizer


def render_chat(st: SimState, request: web.Request, body: Any) -> dict[str, Any]:
    body = _require(body, "messages")
    _check_model(st, body)
    tok = _tokenizer(st)
    ids = tok.encode(chat_prompt(body["messages"]))
    sp = sampling_params(st, body, len(ids), chat=True)
    return _generate_request(_request_id(request, body, "chatcmpl"), ids, sp, body)


def _completion_prompts(tok: ByteTokenizer, prompt: Any) -> list[list[int]]:
    empty = vllm_error("Either prompt or prompt_embeds must be provided and non-empty.", "prompt")
    if isinstance(prompt, str):
        prompts: list[Any] = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        prompts = [prompt]
    elif isinstance(prompt, list):
        prompts = prompt
    else:
        raise empty
    out = []
    for p in prompts:
        ids = tok.encode(p) if isinstance(p, str) else list(p) if isinstance(p, list) else []
        if not ids:
            raise empty
        out.append(ids)
    if not out:
        raise empty
    return out


def render_completion(st: SimState, request: web.Request, body: Any) -> list[dict[str, Any]]:
    body = _require(body, "prompt")
    _check_model(st, body)
    tok = _tokenizer(st)
    prompts = _completion_prompts(tok, body["prompt"])
    if body.get("use_beam_search"):
        raise BadRequest("Beam search is not supported by the render endpoint")
    base = _request_id(request, body, "cmpl")
    out = []
    for i, ids in enumerate(prompts):
        sp = sampling_params(st, body, len(ids), chat=False)
        rid = base if len(prompts) == 1 else f"{base}-{i}"
        out.append(_generate_request(rid, ids, sp, body))
    return out


# -- derender ------------------------------------------------------------------------------------


def _chat_logprobs(ts: TokenStrings, lp: Any, context: Sequence[int] = ()) -> dict[str, Any] | None:
    """Generate's integer-id logprobs in the chat shape (token text and bytes filled in)."""
    if not isinstance(lp, dict):
        return None
    content = lp.get("content")
    if content is None:
        return {"content": None}
    ctx = list(context)
    out = []
    for e in content:

        def item(tid: int, logprob: float) -> dict[str, Any]:
            text = logprob_token_text(ts.tok, tid, ctx)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        entry = item(e["token_id"], e["logprob"])
        entry["top_logprobs"] = [item(t["token_id"], t["logprob"]) for t in e.get("top_logprobs") or []]
        out.append(entry)
        ctx.append(e["token_id"])
    return {"content": out}


def _completion_logprobs(chat_lp: dict[str, Any] | None, offset: int = 0) -> dict[str, Any] | None:
    if chat_lp is None:
        return None
    content = chat_lp.get("content") or []
    text_offset, tokens, token_logprobs, tops = [], [], [], []
    for e in content:
        text_offset.append(offset)
        tokens.append(e["token"])
        token_logprobs.append(e["logprob"])
        tops.append({t["token"]: t["logprob"] for t in e["top_logprobs"]} if e["top_logprobs"] else None)
        offset += len(e["token"])
    return {
        "text_offset": text_offset,
        "token_logprobs": token_logprobs,
        "tokens": tokens,
        "top_logprobs": tops,
    }


def _bad(msg: str) -> BadRequest:
    return BadRequest(msg)


def _gen_choices(gen: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(gen, dict) or not isinstance(gen.get("choices"), list):
        raise validation_error(
            [{"type": "missing", "loc": ("body", where), "msg": "Field required", "input": gen}]
        )
    if gen.get("output_mode", "tokens") != "tokens":
        raise validation_error(
            [
                {
                    "type": "literal_error",
                    "loc": ("body", where, "output_mode"),
                    "msg": "Input should be 'tokens'",
                    "input": gen.get("output_mode"),
                }
            ]
        )
    return [c for c in gen["choices"] if isinstance(c, dict)]


def _skip_special(req: Any) -> bool:
    return not (isinstance(req, dict) and req.get("skip_special_tokens") is False)


def derender_chat(st: SimState, body: dict[str, Any]) -> dict[str, Any]:
    _check_model(st, body)
    ts = TokenStrings(_tokenizer(st))
    gen = body.get("generate_response")
    if gen is None:
        raise _derender_missing("Chat", body)
    choices_in = _gen_choices(gen, "generate_response")
    skip = _skip_special(body.get("chat_request"))
    seed_ids = body.get("prompt_token_ids") or gen.get("prompt_token_ids")
    choices = []
    completion = 0
    for c in choices_in:
        ids = c.get("token_ids")
        if not ids:
            raise _bad(f"choice {c.get('index')} has empty or null token_ids")
        text, _ = detokenize_delta(ts, ids, seed_state(ts, seed_ids, skip), skip)
        completion += len(ids)
        choices.append(_chat_choice(c, text, _chat_logprobs(ts, c.get("logprobs"))))
    prompt = body.get("prompt_tokens") or 0
    return _chat_response(
        gen.get("request_id"),
        body.get("model") or st.settings.model_name,
        choices,
        usage=usage_body(prompt, completion),
        kv=gen.get("kv_transfer_params"),
        fingerprint=None,
    )


def _chat_choice(c: dict[str, Any], text: str, logprobs: Any) -> dict[str, Any]:
    return {
        "index": c.get("index", 0),
        "message": {
            "role": "assistant",
            "content": text,
            "refusal": None,
            "annotations": None,
            "audio": None,
            "function_call": None,
            "reasoning": None,
        },
        "logprobs": logprobs,
        "finish_reason": c.get("finish_reason", "stop"),
        "stop_reason": c.get("stop_reason"),
        "token_ids": None,
        "routed_experts": None,
    }


def _chat_response(
    rid: Any,
    model: str,
    choices: list[dict[str, Any]],
    *,
    usage: dict[str, Any],
    kv: Any,
    fingerprint: str | None,
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "service_tier": None,
        "system_fingerprint": fingerprint,
        "usage": usage,
        "prompt_logprobs": None,
        "prompt_token_ids": None,
        "prompt_text": None,
        "kv_transfer_params": kv,
        "ec_transfer_params": None,
        "metrics": None,
    }


def _completion_choice(index: int, c: dict[str, Any], text: str, logprobs: Any) -> dict[str, Any]:
    return {
        "index": index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": c.get("finish_reason", "stop"),
        "stop_reason": c.get("stop_reason"),
        "token_ids": None,
        "prompt_logprobs": None,
        "prompt_token_ids": None,
        "routed_experts": None,
    }


def _completion_response(
    rid: Any,
    model: str,
    choices: list[dict[str, Any]],
    *,
    usage: dict[str, Any],
    kv: Any,
    fingerprint: str | None,
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "service_tier": None,
        "system_fingerprint": fingerprint,
        "usage": usage,
        "kv_transfer_params": kv,
        "ec_transfer_params": None,
        "metrics": None,
    }


def derender_completion(st: SimState, body: dict[str, Any]) -> dict[str, Any]:
    _check_model(st, body)
    ts = TokenStrings(_tokenizer(st))
    gens = body.get("generate_responses")
    if gens is None:
        raise _derender_missing("Completion", body)
    if not isinstance(gens, list) or not gens:
        raise _bad("generate_responses must not be empty")
    pts = body.get("prompt_tokens")
    pids = body.get("prompt_token_ids")
    for name, v in (("prompt_tokens", pts), ("prompt_token_ids", pids)):
        if v is not None and (not isinstance(v, list) or len(v) != len(gens)):
            raise _bad(
                f"{name} length ({len(v) if isinstance(v, list) else 0}) must equal generate_responses "
                f"length ({len(gens)})"
            )
    skip = _skip_special(body.get("completion_request"))
    choices: list[dict[str, Any]] = []
    prompt = completion = 0
    for k, gen in enumerate(gens):
        seed_ids = (pids[k] if pids is not None else None) or gen.get("prompt_token_ids")
        for c in _gen_choices(gen, "generate_responses"):
            ids = c.get("token_ids")
            if not ids:
                raise _bad(
                    f"choice {c.get('index')} in response {gen.get('request_id')} has empty or null token_ids"
                )
            text, _ = detokenize_delta(ts, ids, seed_state(ts, seed_ids, skip), skip)
            lp = _completion_logprobs(_chat_logprobs(ts, c.get("logprobs")))
            choices.append(_completion_choice(len(choices), c, text, lp))
            completion += len(ids)
        prompt += pts[k] if pts is not None else 0
    kv = gens[0].get("kv_transfer_params")
    if any(g.get("kv_transfer_params") != kv for g in gens[1:]):
        kv = None
    return _completion_response(
        gens[0].get("request_id"),
        body.get("model") or st.settings.model_name,
        choices,
        usage=usage_body(prompt, completion),
        kv=kv,
        fingerprint=None,
    )


def _derender_missing(kind: str, body: dict[str, Any]) -> SimError:
    field = "generate_response" if kind == "Chat" else "generate_responses"
    return validation_error(
        [
            {
                "type": "missing",
                "loc": ("body", f"Derender{kind}Request", field),
                "msg": "Field required",
                "input": body,
            },
            {
                "type": "missing",
                "loc": ("body", f"Derender{kind}StreamRequest", "stream"),
                "msg": "Field required",
                "input": body,
            },
            {
                "type": "missing",
                "loc": ("body", f"Derender{kind}StreamRequest", "generate_chunk"),
                "msg": "Field required",
                "input": body,
            },
        ]
    )


def _stream_usage(chunk: dict[str, Any], prompt_tokens: Any) -> dict[str, Any] | None:
    u = chunk.get("usage")
    if not isinstance(u, dict):
        return None
    pt = prompt_tokens if isinstance(prompt_tokens, int) else (u.get("prompt_tokens") or 0)
    return usage_body(pt, u.get("completion_tokens") or 0)


def derender_stream(st: SimState, body: dict[str, Any], *, chat: bool) -> dict[str, Any]:
    """One generate SSE chunk + the carried ``stream_state`` -> ``{"chunk", "stream_state"}``."""
    _check_model(st, body)
    ts = TokenStrings(_tokenizer(st))
    gen = body.get("generate_chunk")
    kind = "Chat" if chat else "Completion"
    if gen is None:
        raise validation_error(
            [
                {
                    "type": "missing",
                    "loc": ("body", f"Derender{kind}StreamRequest", "generate_chunk"),
                    "msg": "Field required",
                    "input": body,
                }
            ]
        )
    choices_in = _gen_choices(gen, "generate_chunk")
    if len(choices_in) > 1:
        what = "derender_chat_stream" if chat else "derender_completion_stream"
        raise _bad(f"{what} expects at most one choice per chunk (got {len(choices_in)}).")
    req = body.get("chat_request" if chat else "completion_request")
    skip = _skip_special(req)
    state = body.get("stream_state")
    if state is None:
        state = seed_state(ts, body.get("prompt_token_ids") or gen.get("prompt_token_ids"), skip)
    elif not isinstance(state, dict):
        raise validation_error(
            [
                {
                    "type": "model_type",
                    "loc": ("body", f"Derender{kind}StreamRequest", "stream_state"),
                    "msg": "Input should be a valid dictionary or instance of DerenderStreamState",
                    "input": state,
                }
            ]
        )
    else:
        state = {**new_stream_state(), **state}
    model = body.get("model") or st.settings.model_name
    out_choices = []
    new_state = state
    for c in choices_in:
        ids = list(c.get("token_ids") or [])
        try:
            text, new_state = detokenize_delta(ts, ids, new_state, skip)
        except (KeyError, IndexError, TypeError) as e:
            raise _bad(f"invalid stream_state: detokenization failed ({e})") from None
        ctx = list(state["logprob_context_token_ids"])
        lp = _chat_logprobs(ts, c.get("logprobs"), ctx)
        new_state = {**new_state, "logprob_context_token_ids": (ctx + ids)[-4:]}
        if chat:
            role = not new_state["role_sent"]
            new_state["role_sent"] = True
            out_choices.append(
                {
                    "index": c.get("index", 0),
                    "delta": {
                        "role": "assistant" if role else None,
                        "content": text or None,
                        "reasoning": None,
                    },
                    "logprobs": lp,
                    "finish_reason": c.get("finish_reason"),
                    "stop_reason": c.get("stop_reason"),
                    "token_ids": None,
                }
            )
        else:
            offset = state["logprob_text_offset"]
            new_state["logprob_text_offset"] = offset + len(text)
            out_choices.append(
                {
                    "index": c.get("index", 0),
                    "text": text,
                    "logprobs": _completion_logprobs(lp, offset),
                    "finish_reason": c.get("finish_reason"),
                    "stop_reason": c.get("stop_reason"),
                    "prompt_token_ids": None,
                    "token_ids": None,
                }
            )
    usage = _stream_usage(gen, body.get("prompt_tokens"))
    common = {
        "id": gen.get("request_id"),
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": out_choices,
        "usage": usage,
    }
    if chat:
        chunk = {
            **common,
            "system_fingerprint": None,
            "prompt_token_ids": None,
            "prompt_text": None,
            "metrics": None,
        }
    else:
        chunk = {**common, "system_fingerprint": None, "metrics": None}
    return {"chunk": chunk, "stream_state": new_state}


# -- handlers ------------------------------------------------------------------------------------


async def _json_body(request: web.Request) -> Any:
    content_type = request.headers.get("Content-Type", "").lower().split(";", 1)[0].strip()
    if content_type != "application/json":
        raise unsupported_media_type()
    return await read_json(request)


SAMPLING_DEFAULT_MAX_TOKENS = 16
"""vLLM's ``SamplingParams`` default: render's sparse dump leaves out a ``max_tokens`` equal to it."""


def sparse(rendered: dict[str, Any]) -> dict[str, Any]:
    """The render answer as vLLM 0.32 dumps it: ``max_tokens`` left out when it is 16 (the default)."""
    sp = rendered.get("sampling_params")
    if isinstance(sp, dict) and sp.get("max_tokens") == SAMPLING_DEFAULT_MAX_TOKENS:
        rendered = {**rendered, "sampling_params": {k: v for k, v in sp.items() if k != "max_tokens"}}
    return rendered


async def chat_render(request: web.Request) -> web.Response:
    st = request.app[SIM]
    return json_response(sparse(render_chat(st, request, await _json_body(request))))


async def completions_render(request: web.Request) -> web.Response:
    st = request.app[SIM]
    return json_response([sparse(r) for r in render_completion(st, request, await _json_body(request))])


async def chat_derender(request: web.Request) -> web.Response:
    return await _derender(request, chat=True)


async def completions_derender(request: web.Request) -> web.Response:
    return await _derender(request, chat=False)


async def _derender(request: web.Request, *, chat: bool) -> web.Response:
    st = request.app[SIM]
    body = await _json_body(request)
    body = _require(body, "stream") if not isinstance(body, dict) else body
    if body.get("stream") is True:
        return json_response(derender_stream(st, body, chat=chat))
    return json_response(derender_chat(st, body) if chat else derender_completion(st, body))


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _aggregated(request, chat=True)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _aggregated(request, chat=False)


def _loopback_url(request: web.Request) -> str:
    transport = request.transport
    sock = transport.get_extra_info("sockname") if transport is not None else None
    if not (isinstance(sock, tuple) and len(sock) >= 2):
        raise InternalError()
    host = str(sock[0])
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{sock[1]}/inference/v1/generate"


async def _aggregated(request: web.Request, *, chat: bool) -> web.StreamResponse:
    """One aggregated vLLM server's /v1/chat/completions or /v1/completions (n=1 per prompt; a
    completions list of prompts is answered for its first prompt only)."""
    st = request.app[SIM]
    body = await _json_body(request)
    gen_req = render_chat(st, request, body) if chat else render_completion(st, request, body)[0]
    assert isinstance(body, dict)
    if st.tokenizer is None:
        raise InternalError()
    ts = TokenStrings(st.tokenizer)
    rid = gen_req["request_id"]
    model = body.get("model") or st.settings.model_name
    headers = {"Content-Type": "application/json"}
    auth = request.headers.get("Authorization")
    if auth is not None:
        headers["Authorization"] = auth
    session = st.client_session()
    async with session.post(_loopback_url(request), data=DUMPS(gen_req).encode(), headers=headers) as r:
        if r.status != 200:
            return web.Response(status=r.status, body=await r.read(), content_type="application/json")
        if not gen_req["stream"]:
            gen = json.loads(await r.read())
            return json_response(_aggregate_full(ts, gen, gen_req, rid, model, chat=chat))
        resp = web.StreamResponse()
        resp.content_type = "text/event-stream"
        resp.charset = "utf-8"
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        await _aggregate_stream(ts, r, resp, gen_req=gen_req, rid=rid, model=model, chat=chat)
        return resp


class OutputText:
    """One choice's text as vLLM's output processor makes it from the generated tokens: decoded
    token by token, ended before a matched stop string (after it with ``include_stop_str_in_output``),
    and in a stream held back by ``output_text_buffer_length`` characters until the end, so that no
    part of a stop string is ever sent."""

    def __init__(self, ts: TokenStrings, gen_req: dict[str, Any]) -> None:
        sp = gen_req["sampling_params"]
        self.ts = ts
        self.state = seed_state(ts, gen_req["token_ids"])
        self.include = bool(sp.get("include_stop_str_in_output"))
        self.hold = int(sp.get("output_text_buffer_length") or 0)
        self.text = ""
        self.sent = 0

    def add(self, ids: Sequence[int], finish: Any, stop_reason: Any) -> None:
        """Decode ``ids``; on a stop string's match, end the text there. The engine finished on
        the token that completed the string, so it is searched where that token's text could
        complete it (vLLM's ``check_stop_strings``)."""
        piece = ""
        for tok in ids:
            piece, self.state = detokenize_delta(self.ts, [tok], self.state)
            self.text += piece
        if finish == "stop" and isinstance(stop_reason, str) and stop_reason:
            at = self.text.find(stop_reason, max(0, len(self.text) - len(piece) - len(stop_reason) + 1))
            if at >= 0:
                end = at + len(stop_reason) if self.include else at
                self.text = self.text[: max(end, self.sent)]

    def delta(self, finished: bool) -> str:
        """The text not sent yet, less the hold-back while the choice runs."""
        end = len(self.text) if finished else max(self.sent, len(self.text) - self.hold)
        out = self.text[self.sent : end]
        self.sent = max(self.sent, end)
        return out


def _aggregate_full(
    ts: TokenStrings, gen: dict[str, Any], gen_req: dict[str, Any], rid: str, model: str, *, chat: bool
) -> dict[str, Any]:
    choices = []
    for c in gen["choices"]:
        out = OutputText(ts, gen_req)
        out.add(c.get("token_ids") or [], c.get("finish_reason"), c.get("stop_reason"))
        text = out.text
        lp = _chat_logprobs(ts, c.get("logprobs"))
        choices.append(
            _chat_choice(c, text, lp)
            if chat
            else _completion_choice(c.get("index", 0), c, text, _completion_logprobs(lp))
        )
    u = gen["usage"]
    usage = usage_body(u["prompt_tokens"], u["completion_tokens"])
    build = _chat_response if chat else _completion_response
    return build(
        rid, model, choices, usage=usage, kv=gen.get("kv_transfer_params"), fingerprint=SYSTEM_FINGERPRINT
    )


async def _aggregate_stream(
    ts: TokenStrings,
    r: aiohttp.ClientResponse,
    resp: web.StreamResponse,
    *,
    gen_req: dict[str, Any],
    rid: str,
    model: str,
    chat: bool,
) -> None:
    """vLLM's aggregated stream: (chat) a role chunk, one chunk per token with text, the finish
    chunk; the usage chunk when asked for; ``[DONE]``. Error events pass through. The text is
    ``OutputText``'s: held back by the longest stop string less one, never past a stop string."""
    created = int(time.time())
    obj = "chat.completion.chunk" if chat else "text_completion"
    include_usage = bool((gen_req.get("stream_options") or {}).get("include_usage"))
    out_text = OutputText(ts, gen_req)
    ctx: list[int] = []

    async def send(d: dict[str, Any]) -> None:
        await resp.write(b"data: " + DUMPS(d).encode() + b"\n\n")

    def head() -> dict[str, Any]:
        return {"id": rid, "object": obj, "created": created, "model": model}

    if chat:
        await send(
            {
                **head(),
                "choices": [
                    {
                        "index": 0,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ],
                "prompt_token_ids": None,
                "prompt_text": None,
            }
        )
    buffer = b""
    offset = 0
    async for data in r.content.iter_any():
        buffer += data
        while b"\n\n" in buffer:
            event, buffer = buffer.split(b"\n\n", 1)
            payload = event[len(b"data: ") :]
            if payload == b"[DONE]":
                await resp.write(b"data: [DONE]\n\n")
                return
            d = json.loads(payload)
            if "error" in d:
                await resp.write(event + b"\n\n")
                continue
            if not d.get("choices"):
                u = d.get("usage") or {}
                if include_usage:
                    await send(
                        {
                            **head(),
                            "choices": [],
                            "usage": usage_body(u.get("prompt_tokens", 0),
                                                u.get("completion_tokens", 0), False),
                            "system_fingerprint": SYSTEM_FINGERPRINT,
                        }
                    )
                continue
            c = d["choices"][0]
            ids = c.get("token_ids") or []
            finish = c.get("finish_reason")
            out_text.add(ids, finish, c.get("stop_reason"))
            text = out_text.delta(finish is not None)
            lp = _chat_logprobs(ts, c.get("logprobs"), ctx)
            ctx = (ctx + ids)[-4:]
            if chat:
                if not text and finish is None and lp is None:
                    continue
                choice: dict[str, Any] = {
                    "index": 0,
                    "delta": {"content": text} if text else {},
                    "logprobs": lp,
                    "finish_reason": finish,
                }
            else:
                choice = {
                    "index": 0,
                    "text": text,
                    "logprobs": _completion_logprobs(lp, offset),
                    "finish_reason": finish,
                }
                offset += len(text)
            if finish is not None or not chat:
                choice["stop_reason"] = c.get("stop_reason")
            if not chat:
                choice["prompt_token_ids"] = None
            choice["token_ids"] = None
            out = {**head(), "choices": [choice]}
            if finish is not None and not include_usage:
                out["system_fingerprint"] = SYSTEM_FINGERPRINT
            await send(out)
