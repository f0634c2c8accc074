"""OpenAI answers in the shapes of vLLM's aggregated server, built from text-mode generate answers
(pure). The generate text is the aggregated server's own, so no token is decoded here."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from proxy.wire.protocol import compact_json

DATA = b"data: "
DONE_PAYLOAD = b"[DONE]"


@dataclass(slots=True)
class Answer:
    """What the client's answer needs besides the generate answer: id, model, ``n``, usage, chat or not."""

    rid: str
    model: str | None
    chat: bool
    n: int = 1
    include_usage: bool = False
    return_token_ids: bool = False
    fingerprint: str | None = None
    created: int = field(default_factory=lambda: int(time.time()))


def usage_of(u: Any, *, details: bool) -> dict[str, Any]:
    """A generate usage in OpenAI's key order (``details``: the non-stream answer's two keys)."""
    u = u if isinstance(u, dict) else {}
    prompt, completion = int(u.get("prompt_tokens") or 0), int(u.get("completion_tokens") or 0)
    out: dict[str, Any] = {"prompt_tokens": prompt, "total_tokens": prompt + completion,
                           "completion_tokens": completion}
    if details:
        out["prompt_tokens_details"] = u.get("prompt_tokens_details")
        out["completion_tokens_details"] = u.get("completion_tokens_details")
    return out


class Framer:
    """One client's stream: generate events in, the aggregated server's events out."""

    __slots__ = ("_carry", "_head", "_started", "a")

    def __init__(self, answer: Answer) -> None:
        self.a = answer
        self._carry = b""
        self._started = False
        obj = "chat.completion.chunk" if answer.chat else "text_completion"
        self._head = {"id": answer.rid, "object": obj, "created": answer.created, "model": answer.model}

    def feed(self, data: bytes, *, last: bool = False) -> bytes:
        """The client's bytes for ``data`` (any split of the generate stream; ``last``: its end)."""
        return self.start() + b"".join(self.event(e) for e in self.split(data, last=last))

    def start(self) -> bytes:
        if self._started:
            return b""
        self._started = True
        return self.role_chunk() if self.a.chat else b""

    def split(self, data: bytes, *, last: bool = False) -> list[bytes]:
        """The whole events in what came so far (a partial one waits for its end, or ``last``)."""
        buf = self._carry + data if self._carry else data
        events = buf.split(b"\n\n")
        self._carry = b"" if last else events.pop()
        return [e for e in events if e.strip()]

    def role_chunk(self) -> bytes:
        """vLLM's first chat chunk: the role, and an empty content, for each choice."""
        chunks = [{**self._head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                              "logprobs": None, "finish_reason": None}],
                   "prompt_token_ids": None, "prompt_text": None} for i in range(self.a.n)]
        return b"".join(_data(c) for c in chunks)

    def event(self, event: bytes) -> bytes:
        """One generate event (without its blank line) as the client's bytes."""
        if not event.startswith(DATA):
            return event + b"\n\n"  # a comment (``: server-timing``)
        payload = event[len(DATA):]
        if payload == DONE_PAYLOAD:
            return event + b"\n\n"
        chunk = json.loads(payload)
        if not isinstance(chunk, dict) or "error" in chunk or not isinstance(chunk.get("choices"), list):
            return event + b"\n\n"  # an in-band error: as vLLM writes it
        if not chunk["choices"]:
            return self.usage_chunk(chunk.get("usage"))
        return b"".join(self.choice_chunk(c) for c in chunk["choices"] if isinstance(c, dict))

    def usage_chunk(self, usage: Any) -> bytes:
        if not self.a.include_usage:
            return b""
        return _data({**self._head, "choices": [], "usage": usage_of(usage, details=False),
                      "system_fingerprint": self.a.fingerprint})

    def choice_chunk(self, c: dict[str, Any]) -> bytes:
        """One generate choice as the client's chunk; nothing for a chat token that gave no text, no
        logprobs and no end (as vLLM)."""
        return self.framed(int(c.get("index") or 0), c.get("text") or "", logprobs=c.get("logprobs"),
                           finish=c.get("finish_reason"), stop_reason=c.get("stop_reason"),
                           token_ids=c.get("token_ids"))

    def framed(self, index: int, text: str, *, logprobs: Any, finish: Any, stop_reason: Any,
               token_ids: Any, extra: dict[str, Any] | None = None) -> bytes:
        """A choice's chunk as the aggregated server writes it (``extra``: more delta keys)."""
        choice: dict[str, Any]
        if self.a.chat:
            delta: dict[str, Any] = {"content": text} if text else {}
            if extra:
                delta.update(extra)
            if not delta and finish is None and logprobs is None:
                return b""
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            if finish is not None:
                choice["stop_reason"] = stop_reason
        else:
            choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish,
                      "stop_reason": stop_reason, "prompt_token_ids": None}
        choice["token_ids"] = token_ids if self.a.return_token_ids else None
        out = {**self._head, "choices": [choice]}
        if finish is not None and not self.a.include_usage:
            out["system_fingerprint"] = self.a.fingerprint
        return _data(out)


def _data(obj: Any) -> bytes:
    return DATA + compact_json(obj) + b"\n\n"


def _message(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text, "refusal": None, "annotations": None, "audio": None,
            "function_call": None, "reasoning": None}


def full_answer(a: Answer, gen: dict[str, Any]) -> dict[str, Any]:
    """The non-stream answer for a text-mode generate answer ``gen``."""
    choices = []
    for c in gen.get("choices") or []:
        ids = c.get("token_ids") if a.return_token_ids else None
        common = {"logprobs": c.get("logprobs"), "finish_reason": c.get("finish_reason"),
                  "stop_reason": c.get("stop_reason"), "token_ids": ids}
        text = c.get("text") or ""
        if a.chat:
            choices.append({"index": c.get("index", 0), "message": _message(text), **common,
                            "routed_experts": None})
        else:
            choices.append({"index": c.get("index", 0), "text": text, **common, "prompt_logprobs": None,
                            "prompt_token_ids": None, "routed_experts": None})
    return shaped_answer(a, choices, usage_of(gen.get("usage"), details=True))


def shaped_answer(a: Answer, choices: list[dict[str, Any]], usage: dict[str, Any]) -> dict[str, Any]:
    """The aggregated server's answer object around ``choices`` and ``usage``."""
    out: dict[str, Any] = {"id": a.rid, "object": "chat.completion" if a.chat else "text_completion",
                           "created": a.created, "model": a.model, "choices": choices,
                           "service_tier": None, "system_fingerprint": a.fingerprint, "usage": usage}
    if a.chat:
        out.update(prompt_logprobs=None, prompt_token_ids=None, prompt_text=None)
    out.update(kv_transfer_params=None, ec_transfer_params=None, metrics=None)
    return out


__all__ = ["Answer", "Framer", "full_answer", "shaped_answer", "usage_of"]
