"""The prefill worker's first token, streamed at once: the pure pieces (no I/O).

A streaming client can get its first token when the prefill hop answers, instead of after the
hand-off and the decode worker's first step. The prefill worker (P) already sampled that token;
the decode worker (D) is sent the request unchanged and generates every token itself, token 1
included. So the proxy:

1. builds the exact stream chunk vLLM would have sent for P's token (``first_chunk``, one event
   per choice; the bytes of a vLLM 0.32 stream: same keys, order and number spelling);
2. when P's token ends the request (``ends_at_first_token``), sends that chunk as the last one,
   with the usage chunk (``usage_event``) when asked, and never calls D;
3. otherwise strips token 1 from D's stream (``FirstTokenFilter`` / ``drop_first_token``): its id,
   its logprobs and the text the client was already shown, after checking that D's token 1 is
   P's; a ``Mismatch`` is reported when it is not, and the stream goes on from prompt + P's token
   (the caller's continuation), never contradicting what the client holds;
4. gives unseeded random sampling one generated seed on both hops (``seed_for``), so that P and D
   draw the same token 1 (the stream is then a seeded sample, as valid as an unseeded one).

In text mode with stop strings vLLM withholds the tail of the text that could start a stop string
(``visible_text``); the first chunk withholds exactly as much, so nothing is shown that D's stop
handling would later cut, and D's first chunk shows exactly the same text for token 1.

What the prefill hop must carry for this to hold (``kv_transfer.handoff.prefill_body``): the
client's ``output_mode`` (P's text), ``stop``, ``stop_token_ids``, ``ignore_eos``,
``include_stop_str_in_output``, ``logprobs``, ``n`` and seed, ``max_tokens`` 1, and ``min_tokens``
``min(client's, 1)``: with ``min_tokens`` >= 1 vLLM masks EOS and the stop token ids when it
samples token 1 and does not check stop strings on it; a prefill hop without it may sample a token
the client's request cannot produce (``first_chunk`` refuses such a reply: ``NotBuildable``).

Imports nothing of the proxy but ``proxy.sse.events``. D's side (token 1 out of its stream) is
``proxy.sse.first_token_filter``.
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
"""Generated seeds are below it: vLLM seeds the n-th choice with ``seed + n`` (n < 16384, the
proxy's cap), which stays a signed 64-bit integer."""

CHUNK_OPTIONAL: Final = ("prompt_token_ids", "mm_placeholders")
"""Top-level keys vLLM writes on a stream's first chunk only (``return_token_ids``)."""


class NotBuildable(ValueError):
    """P's reply cannot be turned into the exact chunk vLLM would stream for it: the caller
    relays D's stream as it is, token 1 included (the feature is off for this request)."""


@dataclass(frozen=True, slots=True)
class FirstToken:
    """What the client was sent of one choice's first token (from P)."""

    index: int
    token_id: int
    text: str | None
    """The text shown for it (text mode, after the stop-string hold-back); None in tokens mode."""
    final: bool = False
    """The choice ended at this token: the client was sent its finish with it (as vLLM sends a
    token that ends its choice: one chunk), so D's token 1 of it ends there too and is not sent."""


@dataclass(frozen=True, slots=True)
class Mismatch:
    """D's first token of a choice is not the one the client got from P."""

    index: int
    expected: int
    got: int | None
    """D's token (None when D sent text before any token)."""
    reason: str
    """``token``: another token id; ``text``: the same id but text that does not start with what
    the client was shown."""


# -- the stop-string hold-back ------------------------------------------------------------------


def stop_strings(sampling_params: Mapping[str, Any]) -> list[str]:
    stop = sampling_params.get("stop")
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else [s for s in stop if isinstance(s, str)]


def holdback(sampling_params: Mapping[str, Any]) -> int:
    """How many trailing characters of its text vLLM withholds while a request runs.

    vLLM 0.32.0, ``vllm/v1/engine/detokenizer.py``, ``BaseIncrementalDetokenizer.__init__``::

        if self.stop and not self.include_stop_str_in_output:
            self.stop_buffer_length = max(len(s) for s in self.stop) - 1
        else:
            self.stop_buffer_length = 0

    ``stop`` is the request's stop list (a single string counts as a list of one). ``min_tokens``
    does not change it (it only delays the stop-string *check*)."""
    stops = stop_strings(sampling_params)
    if not stops or sampling_params.get("include_stop_str_in_output"):
        return 0
    return max(len(s) for s in stops) - 1


def visible_text(text: str, sampling_params: Mapping[str, Any], *, finished: bool = False) -> str:
    """The part of the first token's ``text`` vLLM's stream shows with that token.

    vLLM 0.32.0, ``BaseIncrementalDetokenizer.get_next_output_text(finished, delta=True)`` (called
    for each stream chunk by ``output_processor.RequestState._new_completion_output`` with
    ``finished = finish_reason is not None``)::

        buffer_length = 0 if finished else self.stop_buffer_length
        length = len(self.output_text) - buffer_length
        if last_offset < length:
            self._last_output_text_offset = length
            return self.output_text[last_offset:length]
        return ""

    For the first chunk ``last_offset`` is 0 and ``output_text`` is token 1's text, which is what
    P's one-token reply holds: P's text finished (max_tokens 1), so it is not held back, and it was
    already cut by P's own stop-string check (``update`` truncates ``output_text`` at a match,
    which then ends the request: ``finished``). A token that stop-terminated the request (EOS, a
    stop token id) is not detokenized unless ``include_stop_str_in_output`` (``update``'s
    ``skipped_stop_token_id``), so P's text is already empty then. The text withheld here reaches
    the client in D's later chunks (D withholds the same: same text, same rule)."""
    if finished:
        return text
    return text[: max(0, len(text) - holdback(sampling_params))]


# -- does P's token end the request? --------------------------------------------------------------


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
    """Whether P's token ends the client's request (every choice): ``max_tokens`` 1, or P
    stopped on it as the client's request would (EOS without ``ignore_eos``, one of its
    ``stop_token_ids``, one of its stop strings completed within the token's text).

    Right when the prefill hop carried the client's ``stop``, ``stop_token_ids``, ``ignore_eos``
    and ``min_tokens`` capped at 1 (vLLM 0.32's ``check_stop`` tests EOS, then the stop token ids,
    then the length; the detokenizer's stop-string check then may turn any of them into ``stop``).
    P reports ``length`` for max_tokens 1 whatever the client's limit, so a ``length`` ends the
    request only when the client asked for one token. With ``min_tokens`` >= 1 nothing but the
    length can end it at token 1 (vLLM masks EOS and stop ids, and checks stop strings only past
    ``min_tokens``)."""
    return all(_choice_ends(c, sampling_params) for c in _choices(reply))


# -- the first chunk ------------------------------------------------------------------------------


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
    """The stream events vLLM 0.32 would send for P's token, one per choice (index order), and
    what each showed. ``NotBuildable`` when P's reply cannot give them exactly.

    ``reply``: P's non-stream reply (parsed), sent with ``max_tokens`` 1, the client's
    ``output_mode`` and ``logprobs``; ``request_id``: the value the client's stream carries
    (``generate-tokens-<id>``: P's reply's own, when the relay's id rewrite applies to these
    bytes too); ``final``: P's token ends the request (``ends_at_first_token``). A choice's chunk
    carries P's ``finish_reason``, ``stop_reason`` and ``weight_versions`` and its whole text when
    its token ends that choice (``final``, or the choice stopped on it as the client's request
    would: with ``n`` > 1 one choice may end at token 1 while the others go on);
    ``continuous_usage``: the client asked ``stream_options.include_usage`` and
    ``continuous_usage_stats``, so each chunk carries the usage so far (its choice's one token).

    Key order and spelling are those of vLLM's ``model_dump_json`` of
    ``GenerateTokensStreamResponse`` / ``GenerateTextStreamResponse`` (pydantic-core, which also
    writes this module's JSON: floats as ``0.00001`` and ``1e-7`` where a non-stream reply, written
    by ``json.dumps``, has ``1e-05`` and ``1e-07``). ``prompt_token_ids`` (and ``mm_placeholders``
    when set) go on the first event only, as vLLM does, when P's reply has them (the client asked
    ``return_token_ids``)."""
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
    """The ``include_usage`` chunk that ends a stream before ``[DONE]`` (vLLM writes it with
    ``exclude_none``: no ``*_details`` keys unless the server counts cached prompt tokens)."""
    usage: dict[str, Any] = {"prompt_tokens": prompt_tokens,
                             "total_tokens": prompt_tokens + completion_tokens,
                             "completion_tokens": completion_tokens}
    if prompt_tokens_details is not None:
        usage["prompt_tokens_details"] = prompt_tokens_details
    chunk = {"request_id": request_id, "usage": usage, "output_mode": output_mode, "choices": []}
    return data_event(stream_json(chunk))


# -- one seed for both hops -----------------------------------------------------------------------


def seed_for(sampling_params: Mapping[str, Any],
             randbelow: Callable[[int], int] = secrets.randbelow) -> int | None:
    """A seed for both hops of a request that samples at random without one (None: leave the
    request as it is). Greedy requests are left alone (no seed changes them), and so is a client's
    seed; vLLM reads a seed of -1 as none, so that request gets one too. The seed is drawn per
    request below ``SEED_BOUND`` (63 bits)."""
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
