"""The two ways a generate answer becomes OpenAI's: text-mode hops framed as they are
(``TextStream``), or tokens-mode hops derendered on the worker that rendered them (``DerenderStream``)."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

from proxy.openai.frames import DATA, DONE_PAYLOAD, Answer, Framer, full_answer
from proxy.openai.workers import TokenizerWorkers
from proxy.sse.relay import StreamOutput
from proxy.wire.errors import ProxyError, UpstreamError, UpstreamProtocolError

log = logging.getLogger("pd_proxy")


class TextStream(StreamOutput):
    """A text-mode generate stream framed as the aggregated server's."""

    def __init__(self, framer: Framer) -> None:
        self.framer = framer

    async def translate(self, data: bytes, *, last: bool) -> bytes:
        return self.framer.feed(data, last=last)


class Derendering:
    """The rendering worker, the prompt's ids (derender counts 0 prompt tokens without them) and the
    client's body."""

    def __init__(self, workers: TokenizerWorkers, worker: str, a: Answer, *, prompt: list[int],
                 client_body: dict[str, Any], sampling: dict[str, Any]) -> None:
        self.workers, self.worker, self.a = workers, worker, a
        self.prompt, self.client_body, self.sampling = prompt, client_body, sampling

    @property
    def path(self) -> str:
        return "/v1/chat/completions/derender" if self.a.chat else "/v1/completions/derender"

    async def post(self, body: dict[str, Any]) -> dict[str, Any]:
        body["chat_request" if self.a.chat else "completion_request"] = self.client_body
        reply = await self.workers.post_json(self.worker, self.path, body)
        answer = reply.json() if reply.status == 200 else None
        if not isinstance(answer, dict):
            raise UpstreamProtocolError("derender", self.worker, f"answered HTTP {reply.status}")
        return answer


def cut_at_stop(text: str, finish: Any, stop_reason: Any, include: bool, new: int | None = None) -> str:
    """The aggregated server's text ends before a matched stop string (after it with
    ``include_stop_str_in_output``); derender keeps the whole last token. The string is searched
    where the last ``new`` characters complete it (``new`` None: its first occurrence)."""
    if finish != "stop" or not isinstance(stop_reason, str) or not stop_reason:
        return text
    start = 0 if new is None else max(0, len(text) - new - len(stop_reason) + 1)
    at = text.find(stop_reason, start)
    if at < 0:
        return text
    return text[:at + len(stop_reason)] if include else text[:at]


def _longest_stop(sp: dict[str, Any]) -> int:
    stop = sp.get("stop") or []
    return max((len(x) for x in stop if isinstance(x, str)), default=0) if isinstance(stop, list) else 0


async def derender_full(d: Derendering, gen: dict[str, Any]) -> dict[str, Any]:
    """The non-stream answer for a tokens-mode generate answer ``gen``."""
    choices = gen.get("choices") or []
    if any(not c.get("token_ids") for c in choices):
        # A choice without tokens (an abort before any) decodes to no text: derender refuses it.
        return full_answer(d.a, gen)
    if d.a.chat:
        body: dict[str, Any] = {"model": d.a.model, "generate_response": gen,
                                "prompt_tokens": len(d.prompt), "prompt_token_ids": d.prompt}
    else:
        body = {"model": d.a.model, "generate_responses": [gen], "prompt_tokens": [len(d.prompt)],
                "prompt_token_ids": [d.prompt]}
    answer = await d.post(body)
    answer.update(id=d.a.rid, created=d.a.created, model=d.a.model, system_fingerprint=d.a.fingerprint)
    include = bool(d.sampling.get("include_stop_str_in_output"))
    for c in answer.get("choices") or []:
        key, holder = ("content", c.get("message")) if d.a.chat else ("text", c)
        if isinstance(holder, dict) and isinstance(holder.get(key), str):
            holder[key] = cut_at_stop(holder[key], c.get("finish_reason"), c.get("stop_reason"), include)
    return answer


class DerenderStream(StreamOutput):
    """A tokens-mode generate stream derendered chunk by chunk; a failed derender ends it in-band and
    ``on_failure`` aborts the request."""

    def __init__(self, d: Derendering, on_failure: Callable[[], None] = lambda: None) -> None:
        self.d = d
        self.on_failure = on_failure
        self.framer = Framer(d.a)
        self.states: dict[int, Any] = {}
        self.held: dict[int, str] = {}
        """Per choice: text not sent yet (``hold``: it may start a stop string)."""
        self.sent: dict[int, str] = {}
        """Per choice: the last ``context`` characters sent (where a stop string may have begun)."""
        self.include = bool(d.sampling.get("include_stop_str_in_output"))
        self.context = max(_longest_stop(d.sampling) - 1, 0)
        self.hold = 0 if self.include else self.context
        """Characters held back: the engine's ``output_text_buffer_length``, so that no part of a
        matched stop string is sent."""
        self.failed = False

    async def translate(self, data: bytes, *, last: bool) -> bytes:
        framer = self.framer
        out = [framer.start()]
        for event in framer.split(data, last=last):
            if self.failed:
                if event == DATA + DONE_PAYLOAD:
                    out.append(event + b"\n\n")
                continue
            chunk = _chunk(event)
            if chunk is None or not chunk["choices"]:
                out.append(framer.event(event))  # comments, [DONE], errors, the usage chunk
                continue
            for c in chunk["choices"]:
                try:
                    out.append(await self._choice({**chunk, "choices": [c]}, c))
                except ProxyError as e:
                    self.failed = True
                    if isinstance(e, UpstreamError):
                        log.warning("request %s: derender failed: %s", self.d.a.rid, e.message)
                    out.append(e.sse_event())
                    self.on_failure()
                    break
        return b"".join(out)

    async def _choice(self, chunk: dict[str, Any], c: dict[str, Any]) -> bytes:
        index = int(c.get("index") or 0)
        body: dict[str, Any] = {"stream": True, "model": self.d.a.model, "generate_chunk": chunk,
                                "stream_state": self.states.get(index), "prompt_tokens": len(self.d.prompt)}
        if index not in self.states:
            body["prompt_token_ids"] = self.d.prompt
        answer = await self.d.post(body)
        self.states[index] = answer.get("stream_state")
        got = answer.get("chunk")
        choices = got.get("choices") if isinstance(got, dict) else None
        if not choices:
            return b""
        choice = choices[0]
        extra = None
        if self.d.a.chat:
            delta = choice.get("delta") or {}
            text = delta.get("content") or ""
            extra = {k: v for k, v in delta.items() if v is not None and k not in ("role", "content")}
        else:
            text = choice.get("text") or ""
        finish, stop_reason = choice.get("finish_reason"), choice.get("stop_reason")
        new = len(text)
        text = self.held.pop(index, "") + text
        if finish is not None:
            sent = self.sent.pop(index, "")
            text = cut_at_stop(sent + text, finish, stop_reason, self.include, new)[len(sent):]
        elif self.hold:
            text, self.held[index] = text[:-self.hold], text[-self.hold:]
        if self.context and finish is None:
            self.sent[index] = (self.sent.get(index, "") + text)[-self.context:]
        return self.framer.framed(index, text, logprobs=choice.get("logprobs"),
                                  finish=finish, stop_reason=stop_reason,
                                  token_ids=c.get("token_ids"), extra=extra)


def _chunk(event: bytes) -> dict[str, Any] | None:
    """A generate chunk with choices (a list), else None."""
    if not event.startswith(DATA) or event[len(DATA):] == DONE_PAYLOAD:
        return None
    chunk = json.loads(event[len(DATA):])
    if not isinstance(chunk, dict) or "error" in chunk or not isinstance(chunk.get("choices"), list):
        return None
    return chunk


__all__ = ["DerenderStream", "Derendering", "TextStream", "cut_at_stop", "derender_full"]
