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

Imports nothing of the proxy but ``proxy.sse``.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import pydantic_core

from proxy.sse import data_event

GREEDY_TEMPERATURE: Final = 1e-5
"""vLLM's ``_SAMPLING_EPS``: a temperature below it samples greedily."""

SEED_BOUND: Final = 2**63 - 2**14
"""Generated seeds are below it: vLLM seeds the n-th choice with ``seed + n`` (n < 16384, the
proxy's cap), which stays a signed 64-bit integer."""

_CHUNK_OPTIONAL: Final = ("prompt_token_ids", "mm_placeholders")
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


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _choices(reply: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    choices = reply.get("choices")
    if not isinstance(choices, list) or not choices or not all(isinstance(c, Mapping) for c in choices):
        raise NotBuildable("the prefill reply has no choices")
    return sorted(choices, key=lambda c: _int(c.get("index")) or 0)


def _choice_ends(choice: Mapping[str, Any], sp: Mapping[str, Any]) -> bool:
    reason = choice.get("finish_reason")
    if _int(sp.get("max_tokens")) == 1:
        return reason in ("length", "stop")
    if reason != "stop" or (_int(sp.get("min_tokens")) or 0) >= 1:
        return False
    stop_reason = choice.get("stop_reason")
    if stop_reason is None:  # EOS (vLLM clears the EOS id of a request with ignore_eos)
        return not sp.get("ignore_eos")
    if _int(stop_reason) is not None:
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
    index = _int(choice.get("index"))
    ids = choice.get("token_ids")
    if index is None or not isinstance(ids, list) or len(ids) != 1 or _int(ids[0]) is None:
        raise NotBuildable("the prefill reply's choice does not hold exactly one token")
    if choice.get("finish_reason") not in ("length", "stop"):
        raise NotBuildable(f"the prefill hop ended with {choice.get('finish_reason')!r}")
    if choice.get("finish_reason") == "stop" and (_int(sp.get("min_tokens")) or 0) >= 1:
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
    return out, FirstToken(index, ids[0], shown)


def first_chunk(reply: Mapping[str, Any], *, request_id: str, output_mode: str,
                sampling_params: Mapping[str, Any], final: bool = False,
                continuous_usage: bool = False) -> tuple[bytes, list[FirstToken]]:
    """The stream events vLLM 0.32 would send for P's token, one per choice (index order), and
    what each showed. ``NotBuildable`` when P's reply cannot give them exactly.

    ``reply``: P's non-stream reply (parsed), sent with ``max_tokens`` 1, the client's
    ``output_mode`` and ``logprobs``; ``request_id``: the value the client's stream carries
    (``generate-tokens-<id>``: P's reply's own, when the relay's id rewrite applies to these
    bytes too); ``final``: P's token ends the request (``ends_at_first_token``): the chunk then
    carries P's ``finish_reason``, ``stop_reason`` and ``weight_versions`` and its whole text;
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
    n = _int(sampling_params.get("n")) or 1
    if len(choices) != n or [_int(c.get("index")) for c in choices] != list(range(n)):
        raise NotBuildable("the prefill reply does not hold one choice per index")
    usage = reply.get("usage")
    prompt_tokens = _int(usage.get("prompt_tokens")) if isinstance(usage, Mapping) else None
    if continuous_usage and prompt_tokens is None:
        raise NotBuildable("the prefill reply has no usage")
    events: list[bytes] = []
    shown: list[FirstToken] = []
    for choice in choices:
        out, first = _first_choice(choice, sampling_params, output_mode, final=final)
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
        events.append(data_event(pydantic_core.to_json(chunk)))
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
    return data_event(pydantic_core.to_json(chunk))


# -- D's first token out --------------------------------------------------------------------------
#
# D's chunk is decided on its parse; what is left to send is edited in its own bytes: the spans of
# the values to change are found by a small scanner over the JSON text (valid JSON: it was parsed),
# and everything else is kept byte for byte. A payload whose objects repeat a key is written again.


_WS: Final = b" \t\r\n"
_STRING: Final = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_TO_BRACKET: Final = re.compile(rb'(?:"(?:[^"\\]|\\.)*"|[^"\[\]{}])*', re.DOTALL)
"""A run of JSON text up to the next bracket outside a string."""
_SCALAR_END: Final = re.compile(rb"[,\]} \t\r\n]")

_Member = tuple[str, int, int, int]
"""key, where the member starts (its key's quote), where its value starts and ends."""


class _Scan:
    """Where the values of a JSON text (valid: it was parsed) start and end: one pass records
    every array's and object's end (a regex skips from bracket to bracket, strings whole)."""

    __slots__ = ("ends", "raw")

    def __init__(self, raw: bytes) -> None:
        self.raw = raw
        self.ends: dict[int, int] = {}
        stack: list[int] = []
        at, size, run = 0, len(raw), _TO_BRACKET.match
        while True:
            m = run(raw, at)
            assert m is not None
            at = m.end()
            if at >= size:
                return
            if raw[at] in b"[{":
                stack.append(at)
            else:
                self.ends[stack.pop()] = at + 1
            at += 1

    def ws(self, i: int) -> int:
        raw = self.raw
        while raw[i] in _WS:
            i += 1
        return i

    def end(self, i: int) -> int:
        """Where the value starting at ``i`` ends."""
        c = self.raw[i]
        if c == 0x22:
            m = _STRING.match(self.raw, i)
        elif c in b"[{":
            return self.ends[i]
        else:
            m = _SCALAR_END.search(self.raw, i)
            assert m is not None
            return m.start()
        assert m is not None
        return m.end()

    def members(self, i: int) -> list[_Member]:
        """The members of the object opening at ``i``."""
        out: list[_Member] = []
        j = self.ws(i + 1)
        if self.raw[j] == 0x7D:
            return out
        while True:
            ke = self.end(j)
            quoted = self.raw[j:ke]
            key = json.loads(quoted) if b"\\" in quoted else quoted[1:-1].decode()
            vs = self.ws(self.ws(ke) + 1)
            ve = self.end(vs)
            out.append((key, j, vs, ve))
            j = self.ws(ve)
            if self.raw[j] == 0x7D:
                return out
            j = self.ws(j + 1)

    def items(self, i: int) -> list[tuple[int, int]]:
        """The spans of the items of the array opening at ``i``."""
        out: list[tuple[int, int]] = []
        j = self.ws(i + 1)
        if self.raw[j] == 0x5D:
            return out
        while True:
            end = self.end(j)
            out.append((j, end))
            j = self.ws(end)
            if self.raw[j] == 0x5D:
                return out
            j = self.ws(j + 1)

    def unique_members(self, i: int) -> dict[str, _Member] | None:
        """The members of the object at ``i`` by key; None when it is not an object or repeats a
        key (its layout cannot be told for certain)."""
        if self.raw[i] != 0x7B:
            return None
        members = self.members(i)
        found = {m[0]: m for m in members}
        return found if len(found) == len(members) else None

    def first_item(self, member: _Member) -> tuple[int, int]:
        """The span that takes the first item out of the array ``member`` holds: up to the next
        item, or everything between the brackets when it is the only one."""
        items = self.items(member[2])
        if len(items) > 1:
            return items[0][0], items[1][0]
        return member[2] + 1, member[3] - 1


def _skip_chars(raw: bytes, i: int, count: int) -> int:
    """Where the JSON string text starting at ``raw[i]`` (inside the quotes) holds ``count``
    characters (Python's: code points; an escaped surrogate pair is one)."""
    for _ in range(count):
        c = raw[i]
        if c == 0x5C:
            if raw[i + 1] == 0x75:  # \uXXXX
                cp = int(raw[i + 2 : i + 6], 16)
                i += 6
                if 0xD800 <= cp < 0xDC00 and raw[i : i + 2] == b"\\u" \
                        and 0xDC00 <= int(raw[i + 2 : i + 6], 16) < 0xE000:
                    i += 6
            else:
                i += 2
        else:
            i += 1 if c < 0x80 else 4 if c >= 0xF0 else 3 if c >= 0xE0 else 2
    return i


def _is_empty(choice: Mapping[str, Any]) -> bool:
    return not choice.get("token_ids") and not choice.get("text") and choice.get("finish_reason") is None


@dataclass(slots=True)
class _Cut:
    """What to take out of one choice of D's chunk (by its position in ``choices``)."""

    pos: int
    chars: int
    """Characters at the head of its text."""
    logprob: bool
    """Its first logprobs entry."""


def _take_first(chunk: dict[str, Any], pos: int, first: FirstToken) -> _Cut | Mismatch | None:
    """Take token 1 out of the parsed ``pos``-th choice (index ``first.index``): how, or why not
    (None: it holds no token, an end without tokens such as an abort)."""
    choice = chunk["choices"][pos]
    ids = choice.get("token_ids") or []
    text = choice.get("text")
    if not ids:
        return Mismatch(first.index, first.token_id, None, "text") if isinstance(text, str) and text else None
    if ids[0] != first.token_id:
        return Mismatch(first.index, first.token_id, ids[0], "token")
    if first.text is not None and isinstance(text, str) and not text.startswith(first.text):
        return Mismatch(first.index, first.token_id, ids[0], "text")
    choice["token_ids"] = ids[1:]
    chars = 0
    if first.text and isinstance(text, str):
        chars = len(first.text)
        choice["text"] = text[chars:]
    logprobs = choice.get("logprobs")
    cut_logprob = isinstance(logprobs, dict) and isinstance(logprobs.get("content"), list) \
        and bool(logprobs["content"])
    if cut_logprob:
        choice["logprobs"] = {**logprobs, "content": logprobs["content"][1:]}
    return _Cut(pos, chars, cut_logprob)


def _spliced(raw: bytes, cuts: list[_Cut], drop_keys: list[str]) -> bytes | None:
    """``raw`` with the cuts made in its own bytes; None when its layout cannot be told for
    certain (a repeated key)."""
    scan = _Scan(raw)
    top = scan.unique_members(scan.ws(0))
    if top is None or "choices" not in top:
        return None
    spans: list[tuple[int, int]] = []
    items = scan.items(top["choices"][2])
    for cut in cuts:
        choice = scan.unique_members(items[cut.pos][0])
        if choice is None:
            return None
        spans.append(scan.first_item(choice["token_ids"]))
        if cut.chars:
            vs = choice["text"][2]
            spans.append((vs + 1, _skip_chars(raw, vs + 1, cut.chars)))
        if cut.logprob:
            logprobs = scan.unique_members(choice["logprobs"][2])
            if logprobs is None:
                return None
            spans.append(scan.first_item(logprobs["content"]))
    members = sorted(top.values(), key=lambda m: m[1])
    for key in drop_keys:  # a top-level member, with its comma
        at = next(i for i, m in enumerate(members) if m[0] == key)
        spans.append((members[at - 1][3], members[at][3]) if at > 0 else (members[0][1], members[1][1]))
    for start, end in sorted(spans, reverse=True):
        raw = raw[:start] + raw[end:]
    return raw


def _parse_chunk(payload: bytes) -> dict[str, Any] | None:
    try:
        chunk = pydantic_core.from_json(payload, allow_inf_nan=True)
    except ValueError:
        return None
    if not isinstance(chunk, dict) or not isinstance(chunk.get("choices"), list):
        return None
    return chunk


def _drop(payload: bytes, chunk: dict[str, Any], firsts: Mapping[int, FirstToken], *,
          first_event: bool) -> tuple[bytes | Mismatch | None, list[int]]:
    """``payload`` (parsed: ``chunk``) without token 1 of each choice in ``firsts``; which of
    those indexes it held. The chunk is decided on parsed; its bytes are edited only when
    something is left to send."""
    cuts: list[_Cut] = []
    seen: list[int] = []
    for pos, choice in enumerate(chunk["choices"]):
        if not isinstance(choice, dict):
            continue
        first = firsts.get(_int(choice.get("index", 0)) or 0)
        if first is None:
            continue
        seen.append(first.index)
        cut = _take_first(chunk, pos, first)
        if isinstance(cut, Mismatch):
            return cut, seen
        if cut is not None:
            cuts.append(cut)
    if not seen:
        return payload, seen
    choices = chunk["choices"]
    if choices and all(isinstance(c, dict) and _is_empty(c) for c in choices):
        return None, seen
    drop_keys = [key for key in _CHUNK_OPTIONAL if first_event and chunk.get(key) is not None]
    for key in drop_keys:  # the client had them with P's chunk
        chunk.pop(key)
    if not cuts and not drop_keys:
        return payload, seen
    spliced = _spliced(payload, cuts, drop_keys)
    return (spliced if spliced is not None else pydantic_core.to_json(chunk)), seen


def drop_first_token(payload: bytes, expected_token: int, expected_text: str | None = None, *,
                     index: int = 0) -> bytes | Mismatch | None:
    """D's first data event for choice ``index`` (its ``data`` payload) without token 1.

    ``expected_token`` is P's token; ``expected_text`` what the client was shown of its text
    (``FirstToken.text``; None in tokens mode). D's chunk may hold several tokens merged (under
    load): its ``token_ids[0]``, ``logprobs.content[0]`` and the shown text's characters at the
    head of ``text`` are taken out, and so are ``prompt_token_ids`` / ``mm_placeholders`` (the
    client had them with P's chunk); every other byte is kept (``usage``: D's counts are the
    client's, token 1 included).

    Returns the payload to relay; None when nothing is left to send: no token, no text and no
    ``finish_reason`` (a continuous ``usage`` alone does not keep it: vLLM never sends a chunk for
    usage alone, and the next chunk carries the running count). A chunk whose only token was token
    1 and that also ends the choice (``finish_reason``; D reached a limit P could not see, such as
    the model length) is kept with ``token_ids: []``, as vLLM itself sends an abort. A ``Mismatch``
    when D's token 1 is another token, or its text does not start with the shown text. A payload
    that is not a chunk, or has no choice ``index``, is returned as it is."""
    chunk = _parse_chunk(payload)
    if chunk is None:
        return payload
    result, _ = _drop(payload, chunk, {index: FirstToken(index, expected_token, expected_text)},
                      first_event=True)
    return result


class FirstTokenFilter:
    """Takes token 1 out of D's stream, once per choice, whichever attempt (retry, decode-only
    fallback) produces the events: feed it each ``data`` payload before the relay sees it."""

    __slots__ = ("pending", "started")

    def __init__(self, firsts: Sequence[FirstToken]) -> None:
        self.pending: dict[int, FirstToken] = {f.index: f for f in firsts}
        """Choices whose token 1 has not come from D yet."""
        self.started = False
        """An event has gone through (``prompt_token_ids`` are only on a stream's first)."""

    def event(self, payload: bytes) -> bytes | Mismatch | None:
        """The payload to relay (``payload`` itself when untouched), None to send nothing, or a
        ``Mismatch`` (the caller stops this stream and continues from prompt + P's token)."""
        if not self.pending:
            return payload
        chunk = _parse_chunk(payload)
        if chunk is None:
            return payload  # an error event, or not a chunk: the caller's checks apply
        result, seen = _drop(payload, chunk, self.pending, first_event=not self.started)
        self.started = True
        if not isinstance(result, Mismatch):
            for index in seen:
                self.pending.pop(index, None)
        return result

    def clear(self) -> None:
        """Stop filtering: the stream goes on as a continuation that starts after P's token."""
        self.pending.clear()


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
    "GREEDY_TEMPERATURE",
    "SEED_BOUND",
    "FirstToken",
    "FirstTokenFilter",
    "Mismatch",
    "NotBuildable",
    "drop_first_token",
    "ends_at_first_token",
    "first_chunk",
    "holdback",
    "seed_for",
    "stop_strings",
    "usage_event",
    "visible_text",
]
