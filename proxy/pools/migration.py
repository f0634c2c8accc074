"""Mid-stream decode migration (proxy/pools/README.md): a stream whose decode worker failed goes on
elsewhere as a continuation, prompt plus the tokens already generated. Pure: feed
:class:`StreamProgress`, plan with :func:`plan_continuation`, rewrite with :func:`rewrite_choice`.

Text mode rewinds to the last point known to end on a whole character (the end of a one-token
chunk with text) and strips the regenerated tokens' ids and the text the client already has:
a prompt that ends mid-character makes vLLM's first delta garbage."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from proxy.wire.protocol import parse_stream_chunk, stream_json

MAX_REWIND = 64
"""At most this many trailing tokens are rewound (beyond it, no rewind)."""

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
    """The token id runs (``b"264,331"``) of a plain block of ``events`` single-choice chunks,
    without parsing the JSON; None unless every event holds exactly one ``"token_ids":[...]`` or
    no choices. Generated text cannot fake the key: a quote in a JSON string is escaped."""
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
    tail_tokens: int = 0
    """Text mode: tokens after the last point known to end on a whole character."""
    tail_text: str = ""
    """Text mode: the text the client received for those tokens."""

    @property
    def generated(self) -> list[int]:
        """Every id the client has of choice 0, in order."""
        if self._runs:
            joined = b",".join(filter(None, self._runs))
            if joined:
                self._ids.extend(map(int, joined.split(b",")))
            self._runs.clear()
        return self._ids

    def add_runs(self, runs: list[bytes]) -> None:
        self._runs.extend(runs)

    def feed(self, choice: Mapping[str, Any], sent: Mapping[str, Any] | None = None) -> None:
        """``choice`` as the worker sent it; ``sent`` what the client got of it, when rewritten."""
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
    replay: int
    """Tokens the continuation regenerates that the client already has."""
    replay_chars: int
    prompt_tokens: int


def plan_continuation(data: Mapping[str, Any], progress: StreamProgress, *,
                      request_id: str | None = None) -> Continuation | None:
    """None when nothing is left to generate. The caller checks :func:`migration_blocker` first."""
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

    tokens: int = 0
    chars: int = 0


def rewrite_choice(choice: dict[str, Any], replay: Replay, kept: int) -> dict[str, Any]:
    """A continuation chunk's choice as the original stream's; ``replay`` is updated."""
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
    out["completion_tokens"] = completion + (prompt - cont.prompt_tokens)
    out["total_tokens"] = out["prompt_tokens"] + out["completion_tokens"]
    return out


def _empty(choice: Mapping[str, Any]) -> bool:
    return not choice.get("token_ids") and not choice.get("text") and choice.get("finish_reason") is None


class StreamFollower:
    """Follows a migratable stream's choice 0; once continued elsewhere, ``event`` rewrites the
    continuation's payloads into the original stream's (None: only replayed tokens)."""

    def __init__(self, data: Mapping[str, Any], output_mode: str) -> None:
        self.data = data
        self.progress = StreamProgress(output_mode=output_mode)
        self.cont: Continuation | None = None
        self.replay = Replay()
        self.migrations = 0

    def block_runs(self, body: bytes, events: int) -> list[bytes] | None:
        """A plain block's id runs (tokens mode, not continued elsewhere); None: read it event by
        event. The caller adds them once the block is on its way to the client."""
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
        return plan_continuation(self.data, self.progress) is None

    def continue_elsewhere(self, request_id: str | None = None) -> Continuation | None:
        cont = plan_continuation(self.data, self.progress, request_id=request_id)
        if cont is None:
            return None
        self.cont = cont
        self.replay = Replay(cont.replay, cont.replay_chars)
        self.migrations += 1
        return cont
