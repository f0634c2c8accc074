"""The prefill worker's first token, streamed at once as the chunk vLLM would send (pure, no I/O).
D's token 1 is then stripped from its stream (``first_token_filter``). This holds only if the
prefill hop carries the client's stop settings, ``logprobs``, ``n``, seed, ``max_tokens`` 1 and
``min_tokens`` capped at 1 (``kv_transfer.handoff.prefill_body``).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from proxy.sse.events import data_event
from proxy.wire.protocol import stream_json

GREEDY_TEMPERATURE: Final = 1e-5
"""vLLM's ``_SAMPLING_EPS``: a temperature below it samples greedily."""

SEED_BOUND: Final = 2**63 - 2**14
"""Generated seeds are below it, so vLLM's per-choice ``seed + n`` (n < 16384) stays 64-bit."""

CHUNK_OPTIONAL: Final = ("prompt_token_ids", "mm_placeholders")
"""Top-level keys vLLM writes on a stream's first chunk only (``return_token_ids``)."""


class NotBuildable(ValueError):
    """P's reply cannot give the exact chunk vLLM would stream: D's stream is relayed as it is."""


@dataclass(frozen=True, slots=True)
class FirstToken:
    """What the client was sent of one choice's first token (from P)."""

    index: int
    token_id: int
    text: str | None
    """The text shown for it (text mode, after the stop-string hold-back); None in tokens mode."""
    final: bool = False
    """The choice ended at this token (sent with its finish), so D's token 1 of it is not sent."""


@dataclass(frozen=True, slots=True)
class Mismatch:
    """D's first token of a choice is not the one the client got from P."""

    index: int
    expected: int
    got: int | None
    """D's token (None when D sent text before any token)."""
    reason: str
    """``token``: another token id; ``text``: the same id, text not starting with what was shown."""


def stop_strings(sampling_params: Mapping[str, Any]) -> list[str]:
    stop = sampling_params.get("stop")
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else [s for s in stop if isinstance(s, str)]


def holdback(sampling_params: Mapping[str, Any]) -> int:
    """Trailing characters vLLM withholds while a request runs (its ``stop_buffer_length``)."""
    stops = stop_strings(sampling_params)
    if not stops or sampling_params.get("include_stop_str_in_output"):
        return 0
    return max(len(s) for s in stops) - 1


def visible_text(text: str, sampling_params: Mapping[str, Any], *, finished: bool = False) -> str:
    """What vLLM's stream shows of the first token's ``text`` (D withholds the same tail)."""
    if finished:
        return text
    return text[: max(0, len(text) - holdback(sampling_params))]


def as_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _choices(reply: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    choices = reply.get("choices")
    if not isinstance(choices, list) or not choices or not all(isinstance(c, Mapping) for c in choices):
        raise NotBuildable("the prefill reply has no choices")
    return sorted(choices, key=lambda c: as_int(c.get("index")) or 0)


def _choice_ends(choice: Mapping[str, Any], sp: Mapping[str, Any]) -> bool:
    reason = choice.get("finish_reason")
    if as_int(sp.get("max_tokens")) == 1:
        return reason in ("length", "stop")
    if reason != "stop" or (as_int(sp.get("min_tokens")) or 0) >= 1:
        return False
    stop_reason = choice.get("stop_reason")
    if stop_reason is None:  # EOS (vLLM clears the EOS id of a request with ignore_eos)
        return not sp.get("ignore_eos")
    if as_int(stop_reason) is not None:
        return stop_reason in (sp.get("stop_token_ids") or ())
    return isinstance(stop_reason, str) and stop_reason in stop_strings(sp)


def ends_at_first_token(reply: Mapping[str, Any], sampling_params: Mapping[str, Any]) -> bool:
    """Whether P's token ends the client's request in every choice, as vLLM's ``check_stop`` would
    (given the prefill hop's stop settings and ``min_tokens`` capped at 1)."""
    return all(_choice_ends(c, sampling_params) for c in _choices(reply))


def _first_choice(choice: Mapping[str, Any], sp: Mapping[str, Any], output_mode: str, *,
                  final: bool) -> tuple[dict[str, Any], FirstToken]:
    index = as_int(choice.get("index"))
    ids = choice.get("token_ids")
    if index is None or not isinstance(ids, list) or len(ids) != 1 or as_int(ids[0]) is None:
        raise NotBuildable("the prefill reply's choice does not hold exactly one token")
    if choice.get("finish_reason") not in ("length", "stop"):
        raise NotBuildable(f"the prefill hop ended with {choice.get('finish_reason')!r}")
    if choice.get("finish_reason") == "stop" and (as_int(sp.get("min_tokens")) or 0) >= 1:
        raise NotBuildable("the prefill hop stopped at token 1 although min_tokens forbids it "
                           "(it was sent without min_tokens)")
    if choice.get("routed_experts") is not None or choice.get("sampling_mask") is not None:
        raise NotBuildable("routed_experts / sampling_mask are not rebuilt for a stream chunk")
    logprobs = choice.get("logprobs")
    if sp.get("logprobs") is not None:
        if not isinstance(logprobs, Mapping) or not isinstance(logprobs.get("content"), list) \
                or len(logprobs["content"]) != 1:
            raise NotBuildable("the prefill reply lacks the token's logprobs")
    elif logprobs is not None:
        raise NotBuildable("the prefill reply has logprobs the client did not ask for")
    out: dict[str, Any] = {
        "index": index,
        "finish_reason": choice["finish_reason"] if final else None,
        "stop_reason": choice.get("stop_reason") if final else None,
        "token_ids": [ids[0]],
        "routed_experts": None,
        "sampling_mask": None,
        "weight_versions": choice.get("weight_versions") if final else None,
    }
    shown: str | None = None
    if output_mode == "text":
        text = choice.get("text")
        if not isinstance(text, str):
            raise NotBuildable("the prefill reply has no text (was it sent output_mode tokens?)")
        shown = out["text"] = visible_text(text, sp, finished=final)
    out["logprobs"] = logprobs
    return out, FirstToken(index, ids[0], shown, final)


def first_chunk(reply: Mapping[str, Any], *, request_id: str, output_mode: str,
                sampling_params: Mapping[str, Any], final: bool = False,
                continuous_usage: bool = False) -> tuple[bytes, list[FirstToken]]:
    """The stream events vLLM 0.32 would send for P's token, one per choice, byte for byte, with
    what each showed; ``NotBuildable`` when P's reply cannot give them exactly."""
    if output_mode not in ("tokens", "text"):
        raise NotBuildable(f"output_mode {output_mode!r} does not stream")
    choices = _choices(reply)
    n = as_int(sampling_params.get("n")) or 1
    if len(choices) != n or [as_int(c.get("index")) for c in choices] != list(range(n)):
        raise NotBuildable("the prefill reply does not hold one choice per index")
    usage = reply.get("usage")
    prompt_tokens = as_int(usage.get("prompt_tokens")) if isinstance(usage, Mapping) else None
    if continuous_usage and prompt_tokens is None:
        raise NotBuildable("the prefill reply has no usage")
    events: list[bytes] = []
    shown: list[FirstToken] = []
    for choice in choices:
        ends = final or _choice_ends(choice, sampling_params)
        out, first = _first_choice(choice, sampling_params, output_mode, final=ends)
        chunk: dict[str, Any] = {"request_id": request_id, "usage": None}
        if continuous_usage:
            assert prompt_tokens is not None
            chunk["usage"] = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + 1,
                              "completion_tokens": 1, "prompt_tokens_details": None,
                              "completion_tokens_details": None}
        if not events and reply.get("prompt_token_ids") is not None:
            chunk["prompt_token_ids"] = reply["prompt_token_ids"]
            if reply.get("mm_placeholders") is not None:
                chunk["mm_placeholders"] = reply["mm_placeholders"]
        chunk["output_mode"] = output_mode
        chunk["choices"] = [out]
        events.append(data_event(stream_json(chunk)))
        shown.append(first)
    return b"".join(events), shown


def usage_event(*, request_id: str, output_mode: str, prompt_tokens: int, completion_tokens: int,
                prompt_tokens_details: Any = None) -> bytes:
    """The ``include_usage`` chunk that ends a stream before ``[DONE]`` (``exclude_none``)."""
    usage: dict[str, Any] = {"prompt_tokens": prompt_tokens,
                             "total_tokens": prompt_tokens + completion_tokens,
                             "completion_tokens": completion_tokens}
    if prompt_tokens_details is not None:
        usage["prompt_tokens_details"] = prompt_tokens_details
    chunk = {"request_id": request_id, "usage": usage, "output_mode": output_mode, "choices": []}
    return data_event(stream_json(chunk))


def seed_for(sampling_params: Mapping[str, Any],
             randbelow: Callable[[int], int] = secrets.randbelow) -> int | None:
    """A seed for both hops of a request sampling at random without one (-1 is none), else None."""
    temperature = sampling_params.get("temperature", 1.0)
    if temperature is None:
        temperature = 1.0
    if isinstance(temperature, int | float) and temperature < GREEDY_TEMPERATURE:
        return None
    seed = sampling_params.get("seed")
    if seed is not None and seed != -1:
        return None
    return randbelow(SEED_BOUND)


__all__ = [
    "CHUNK_OPTIONAL",
    "GREEDY_TEMPERATURE",
    "SEED_BOUND",
    "FirstToken",
    "Mismatch",
    "NotBuildable",
    "as_int",
    "ends_at_first_token",
    "first_chunk",
    "holdback",
    "seed_for",
    "stop_strings",
    "usage_event",
    "visible_text",
]
