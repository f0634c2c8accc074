"""The stream relay between a decode worker and a (possibly slow) client.

A producer reads the decode worker's SSE stream and puts events into a ``StreamBuffer``; the
handler takes whatever has queued and writes it. While the client keeps up there is one event
per write and its bytes go out untouched. When the client lags, everything queued meanwhile
goes out as one merged chunk per choice (``merge_chunks``): token ids, text and logprobs are
concatenated and the last ``finish_reason`` is kept, so the concatenation of what the client
receives always equals what the decode worker sent, and memory is bounded by a byte cap past
which the stream is ended with a clear in-band error.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from proxy.sse import data_event

_COMPACT = {"separators": (",", ":"), "ensure_ascii": False}


def _merge_choice(acc: dict[str, Any], new: dict[str, Any]) -> None:
    for key, value in new.items():
        if key in ("token_ids", "routed_experts"):
            old = acc.get(key)
            if isinstance(old, list) and isinstance(value, list):
                acc[key] = old + value
            elif value is not None:
                acc[key] = value
        elif key == "text":
            acc[key] = (acc.get(key) or "") + (value or "")
        elif key == "logprobs":
            old = acc.get(key)
            if isinstance(old, dict) and isinstance(value, dict):
                merged = dict(old)
                merged.update({k: v for k, v in value.items() if k != "content"})
                merged["content"] = (old.get("content") or []) + (value.get("content") or [])
                acc[key] = merged
            elif value is not None:
                acc[key] = value
        elif key == "finish_reason":
            if value is not None:
                acc["finish_reason"] = value
                acc["stop_reason"] = new.get("stop_reason")
        elif key == "stop_reason":
            continue
        elif value is not None or key not in acc:
            acc[key] = value


def merge_chunks(datas: list[bytes]) -> list[bytes]:
    """Merge queued stream chunks (their ``data`` payloads) into as few as possible.

    Chunks with choices are grouped by choice index (one merged chunk per index, in order of
    first appearance); chunks without choices (the ``include_usage`` chunk) follow, the last
    one kept with the latest ``usage``. Anything that is not a chunk object is kept as is.
    """
    if len(datas) < 2:
        return datas
    by_index: dict[int, dict[str, Any]] = {}
    order: list[int] = []
    tail: list[bytes] = []
    usage_only: dict[str, Any] | None = None
    latest_usage: Any = None
    for raw in datas:
        try:
            chunk = json.loads(raw)
        except ValueError:
            chunk = None
        if not isinstance(chunk, dict) or "error" in chunk or not isinstance(chunk.get("choices"), list):
            tail.append(raw)
            continue
        if chunk.get("usage") is not None:
            latest_usage = chunk["usage"]
        choices = chunk["choices"]
        if not choices:
            usage_only = chunk
            continue
        for choice in choices:
            index = int(choice.get("index", 0))
            env = by_index.get(index)
            if env is None:
                env = {k: v for k, v in chunk.items() if k != "choices"}
                env["choices"] = [dict(choice)]
                by_index[index] = env
                order.append(index)
            else:
                for k, v in chunk.items():
                    if k != "choices" and v is not None:
                        env[k] = v
                _merge_choice(env["choices"][0], choice)
    out: list[bytes] = []
    for index in order:
        env = by_index[index]
        if usage_only is None and latest_usage is not None and env.get("usage") is not None:
            env["usage"] = latest_usage
        out.append(json.dumps(env, **_COMPACT).encode())  # type: ignore[arg-type]
    if usage_only is not None:
        out.append(json.dumps(usage_only, **_COMPACT).encode())  # type: ignore[arg-type]
    out.extend(tail)
    return out


class StreamBuffer:
    """What the producer has read and the client has not yet been sent.

    ``put`` never blocks (the producer keeps draining the worker); the queued bytes are capped.
    """

    __slots__ = ("_closed", "_done", "_error", "_event", "_items", "_raw", "_size", "max_bytes",
                 "overflowed")

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._items: list[bytes] = []
        self._raw: list[bytes] = []
        self._size = 0
        self._event = asyncio.Event()
        self._closed = False
        self._done = False
        self._error: bytes | None = None
        self.overflowed = False

    def put(self, raw: bytes, data: bytes) -> None:
        if self._closed:
            return
        self._raw.append(raw)
        self._items.append(data)
        self._size += len(raw)
        if self._size > self.max_bytes:
            self.overflowed = True
            self._closed = True
        self._event.set()

    def finish(self, *, done: bool, error: bytes | None = None) -> None:
        """The producer is finished: ``done`` when ``[DONE]`` was seen; ``error`` an in-band
        error event to send after what is queued."""
        if self._closed:
            return
        self._closed = True
        self._done = done
        self._error = error
        self._event.set()

    @property
    def closed(self) -> bool:
        return self._closed

    async def take(self, *, merge: bool) -> tuple[list[bytes], bool]:
        """Wait for something; return the bytes to write and whether the producer is finished.

        With ``merge`` (the client is lagging) several queued chunks become one per choice;
        without it the events go out untouched."""
        while not self._items and not self._closed:
            self._event.clear()
            await self._event.wait()
        raws, datas = self._raw, self._items
        self._raw, self._items, self._size = [], [], 0
        if len(raws) == 1 or not merge:
            out = raws
        elif raws:
            out = [data_event(d) for d in merge_chunks(datas)]
        else:
            out = []
        return out, self._closed

    @property
    def ended_with_done(self) -> bool:
        return self._done

    @property
    def error_event(self) -> bytes | None:
        return self._error
