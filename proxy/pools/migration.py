"""Mid-stream decode migration: continue a stream on another decode worker with no visible seam.

When a decode worker dies or errors in the middle of a stream, the request goes on elsewhere as
a *continuation*: the prompt plus the tokens already generated is the new prompt, ``max_tokens``
(and ``min_tokens``) reduced by as many. With greedy sampling the next token of the continuation
is the next token of the uninterrupted run, so the token ids the client sees are the same.

Everything here is pure: :class:`StreamProgress` is fed each choice the client was sent,
:func:`plan_continuation` builds the continuation request, :func:`rewrite_choice` /
:func:`rewrite_usage` turn the continuation's chunks into the original stream's.

Text mode continuity
--------------------
vLLM detokenizes incrementally, starting a new request from the tail of its prompt, so the text
of a continuation token equals the uninterrupted run's text for it, with one exception: when the
last streamed tokens are bytes of an unfinished UTF-8 character (or any token whose text vLLM
held back), the old worker never sent that text, and a prompt that ends in the middle of a
character makes vLLM's first delta garbage: it repeats the prompt's text (trace
``gen-text-stream-prompt-tail-utf8``). So the continuation *rewinds* to the last point known to
end on a whole character, the end of a chunk of exactly one token with text (vLLM sends text only
when the decoded tail is complete); the tokens after it are left out of its prompt and
regenerated (greedy: the same ids). Their ids, which the client already has, are stripped from
the continuation's chunks (``replay``), and so is as much of their text as the client already
got (``replay_chars``): under load vLLM merges several steps into one chunk, whose text may end
before its last tokens' (held back), so a chunk with text can still end mid-character.

Stop strings are the other hold-back: vLLM withholds text that could be the start of a stop
string, and checks stop strings only on text it generated itself, so one spanning the seam would
be missed. Requests with stop strings are therefore not migrated (see :func:`migration_blocker`),
nor are others whose sampling depends on which tokens were *generated* rather than prompt
(presence/frequency penalties, structured outputs, bad words), ``n > 1``, prompt truncation and
multimodal inputs. Those fail as before; everything else migrates.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from proxy.wire.protocol import parse_stream_chunk, stream_json

MAX_REWIND = 64
"""At most this many trailing tokens are rewound (beyond it the seam risks the garbage delta; it
takes 64 tokens merged into chunks with no one-token chunk with text between them)."""

_GENERATED_DEPENDENT = ("presence_penalty", "frequency_penalty")
_NOT_NULL_BLOCKERS = ("structured_outputs", "guided_decoding", "bad_words", "truncate_prompt_tokens",
                      "logits_processors")
_MULTIMODAL = ("features", "content_parts", "token_offsets")


def migration_blocker(data: Mapping[str, Any]) -> str | None:
    """Why this request cannot be continued seamlessly elsewhere (None: it can)."""
    sp = data.get("sampling_params")
    if not isinstance(sp, Mapping):
        return "no sampling_params"
    n = sp.get("n")
    if n is not None and n != 1:
        return "n > 1"
    if sp.get("stop"):
        return "stop strings"
    return _option_blocker(sp, data)


def _option_blocker(sp: Mapping[str, Any], data: Mapping[str, Any]) -> str | None:
    """``migration_blocker``'s last checks, in plain loops, not generators (they run on every
    streamed request)."""
    for key in _GENERATED_DEPENDENT:
        if sp.get(key) not in (None, 0, 0.0):
            return key
    for key in _NOT_NULL_BLOCKERS:
        if sp.get(key):
            return key
    for key in _MULTIMODAL:
        if data.get(key):
            return "multimodal input"
    return None


_TOKEN_IDS = re.compile(rb'"token_ids":\[((?:[0-9]+(?:, ?[0-9]+)*)?)\]')
_NO_CHOICES = b'"choices":[]'


def token_id_runs(body: bytes, events: int) -> list[bytes] | None:
    """The generated token ids in a plain block of ``events`` single-choice stream chunks (a
    plain ``sse.Batch`` body, or chunks of them, of a request with ``n == 1``), in order, as the
    runs D wrote (``b"264,331"``; ``b""`` for an empty list), without parsing the JSON; the ids
    themselves are parsed only when a migration needs them (``StreamProgress.generated``).

    None unless every event holds exactly one ``"token_ids":[...]`` of decimal integers or is a
    chunk without choices (the usage chunk): the caller then parses event by event. In JSON text
    a quote inside a string is escaped, so the key cannot be faked by generated text. One regex
    pass for the whole block.
    """
    found: list[bytes] = _TOKEN_IDS.findall(body)
    if len(found) + body.count(_NO_CHOICES) != events:
        return None
    return found


@dataclass(slots=True)
class StreamProgress:
    """What the client has received of choice 0 so far."""

    output_mode: str = "tokens"
    _ids: list[int] = field(default_factory=list)
    _runs: list[bytes] = field(default_factory=list)
    """Ids taken unparsed from plain blocks (``token_id_runs``), after those in ``_ids``."""
    tail_tokens: int = 0
    """Text mode: tokens after the last point known to end on a whole character."""
    tail_text: str = ""
    """Text mode: the text the client received for those tokens."""

    @property
    def generated(self) -> list[int]:
        """Every id the client has of choice 0, in order (the unparsed runs parsed now)."""
        if self._runs:
            joined = b",".join(filter(None, self._runs))
            if joined:
                self._ids.extend(map(int, joined.split(b",")))
            self._runs.clear()
        return self._ids

    def add_runs(self, runs: list[bytes]) -> None:
        """Ids of a plain block, as ``token_id_runs`` found them."""
        self._runs.extend(runs)

    def feed(self, choice: Mapping[str, Any], sent: Mapping[str, Any] | None = None) -> None:
        """``choice`` as the worker sent it; ``sent`` what the client got of it, when that was
        rewritten (a continuation's replayed ids and text stripped)."""
        whole = choice.get("token_ids") or []
        if sent is not None:
            choice = sent
        ids = choice.get("token_ids") or []
        self.generated.extend(int(t) for t in ids)
        if self.output_mode != "text":
            return
        text = choice.get("text") or ""
        if len(whole) == 1 and ids and text:
            self.tail_tokens, self.tail_text = 0, ""  # one token whose text came: a whole character
        elif ids or self.tail_tokens:
            self.tail_tokens += len(ids)
            self.tail_text += text

    @property
    def rewind(self) -> int:
        if self.output_mode != "text" or self.tail_tokens > MAX_REWIND:
            return 0
        return min(self.tail_tokens, len(self.generated))


@dataclass(frozen=True, slots=True)
class Continuation:
    body: dict[str, Any]
    kept: int
    """Generated tokens moved into the continuation's prompt."""
    replay: int
    """Tokens the continuation regenerates that the client already has (their ids get stripped)."""
    replay_chars: int
    """Characters of their text the client already has (stripped from the continuation's text)."""
    prompt_tokens: int
    """The original prompt's length (for usage)."""


def plan_continuation(data: Mapping[str, Any], progress: StreamProgress, *,
                      request_id: str | None = None) -> Continuation | None:
    """The continuation request for ``data`` after ``progress``; None when nothing is left to
    generate (``max_tokens`` reached). The caller checks :func:`migration_blocker` first."""
    prompt = list(data["token_ids"])
    generated = progress.generated
    replay = progress.rewind
    replay_chars = len(progress.tail_text) if replay else 0
    kept = len(generated) - replay
    sp = dict(data["sampling_params"])
    max_tokens = sp.get("max_tokens")
    if max_tokens is not None:
        remaining = int(max_tokens) - kept
        if remaining - replay <= 0:
            return None
        sp["max_tokens"] = remaining
    min_tokens = sp.get("min_tokens")
    if min_tokens:
        left = int(min_tokens) - kept
        if left > 0:
            sp["min_tokens"] = left
        else:
            sp.pop("min_tokens")
    for key in ("prompt_logprobs", "prompt_logprob_token_ids"):
        sp.pop(key, None)
    body = dict(data)
    body["token_ids"] = prompt + generated[:kept]
    body["sampling_params"] = sp
    body.pop("kv_transfer_params", None)
    if request_id is not None:
        body["request_id"] = request_id
    return Continuation(body, kept=kept, replay=replay, replay_chars=replay_chars,
                        prompt_tokens=len(prompt))


@dataclass(slots=True)
class Replay:
    """What is still to strip from a continuation's chunks: token ids and text characters."""

    tokens: int = 0
    chars: int = 0


def rewrite_choice(choice: dict[str, Any], replay: Replay, kept: int) -> dict[str, Any]:
    """A continuation chunk's choice as the original stream's: strips the ``replay`` token ids
    (and their logprobs) and text characters still due, shifts ``weight_versions`` positions by
    ``kept``. ``replay`` is updated."""
    out = dict(choice)
    ids = list(choice.get("token_ids") or [])
    if replay.tokens > 0 and ids:
        cut = min(replay.tokens, len(ids))
        out["token_ids"] = ids[cut:]
        replay.tokens -= cut
        logprobs = choice.get("logprobs")
        if isinstance(logprobs, dict) and isinstance(logprobs.get("content"), list):
            out["logprobs"] = {**logprobs, "content": logprobs["content"][cut:]}
    text = choice.get("text")
    if replay.chars > 0 and isinstance(text, str) and text:
        cut = min(replay.chars, len(text))
        out["text"] = text[cut:]
        replay.chars -= cut
    versions = choice.get("weight_versions")
    if isinstance(versions, list) and kept:
        out["weight_versions"] = [
            {**v, "start": v["start"] + kept if v.get("start") else v.get("start"),
             "end": v["end"] + kept if isinstance(v.get("end"), int) else v.get("end")}
            if isinstance(v, dict) else v for v in versions]
    return out


def rewrite_usage(usage: Mapping[str, Any], cont: Continuation) -> dict[str, Any]:
    """The continuation's usage as the original request's: its prompt counted the kept tokens."""
    out = dict(usage)
    prompt = int(usage.get("prompt_tokens", 0))
    completion = int(usage.get("completion_tokens", 0))
    out["prompt_tokens"] = cont.prompt_tokens
    # the client got `kept` tokens before the seam, and all the continuation generated but the
    # `replay` tokens it already had... which were among the tokens before the seam too.
    out["completion_tokens"] = completion + (prompt - cont.prompt_tokens)
    out["total_tokens"] = out["prompt_tokens"] + out["completion_tokens"]
    return out


def _empty(choice: Mapping[str, Any]) -> bool:
    return not choice.get("token_ids") and not choice.get("text") and choice.get("finish_reason") is None


class StreamFollower:
    """Follows the events of a migratable stream (choice 0) and, once it has been continued
    elsewhere, rewrites the continuation's events into the original stream's.

    ``event`` takes one SSE ``data:`` payload (not ``[DONE]``) and returns the payload to send
    the client, or None when the event carried only replayed tokens (nothing new for the client).
    """

    def __init__(self, data: Mapping[str, Any], output_mode: str) -> None:
        self.data = data
        self.progress = StreamProgress(output_mode=output_mode)
        self.cont: Continuation | None = None
        self.replay = Replay()
        self.migrations = 0

    def block_runs(self, body: bytes, events: int) -> list[bytes] | None:
        """The ids of a plain block of ``events`` events, unparsed (``token_id_runs``), when they
        may be taken so: tokens mode, not continued elsewhere (a continuation's events are
        rewritten one by one). None: the block is read event by event. The caller adds them
        (``progress.add_runs``) once the block is on its way to the client."""
        if self.cont is not None or self.progress.output_mode != "tokens":
            return None
        return token_id_runs(body, events)

    def event(self, payload: bytes) -> bytes | None:
        chunk = parse_stream_chunk(payload)
        if chunk is None:
            return payload
        if self.cont is None:
            for choice in chunk["choices"]:
                if isinstance(choice, dict) and choice.get("index", 0) == 0:
                    self.progress.feed(choice)
            return payload
        choices = []
        for original in chunk["choices"]:
            choice = original
            if isinstance(original, dict):
                choice = rewrite_choice(original, self.replay, self.cont.kept)
                if original.get("index", 0) == 0:
                    self.progress.feed(original, choice)
                if _empty(choice):
                    continue
            choices.append(choice)
        usage = chunk.get("usage")
        if not choices and chunk["choices"] and usage is None:
            return None
        chunk["choices"] = choices
        if isinstance(usage, dict):
            chunk["usage"] = rewrite_usage(usage, self.cont)
        return stream_json(chunk)

    def finished(self) -> bool:
        """The client already has every token it asked for (nothing to continue)."""
        return plan_continuation(self.data, self.progress) is None

    def continue_elsewhere(self, request_id: str | None = None) -> Continuation | None:
        """Plan the next continuation; None when nothing is left to generate."""
        cont = plan_continuation(self.data, self.progress, request_id=request_id)
        if cont is None:
            return None
        self.cont = cont
        self.replay = Replay(cont.replay, cont.replay_chars)
        self.migrations += 1
        return cont
