"""The transport seam: every byte the proxy exchanges with a worker goes through ``Upstream``.

One pooled keep-alive ``aiohttp.ClientSession`` per process (created and closed by the app's
``cleanup_ctx``), a timeout on every call, and transport errors translated once into the
``proxy.errors.UpstreamError`` tree, naming the hop and the worker.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp

from proxy.errors import (
    UpstreamError,
    UpstreamProtocolError,
    UpstreamStatusError,
    UpstreamTimeout,
    UpstreamUnavailable,
)

GENERATE_PATH = "/inference/v1/generate"
ABORT_PATH = "/inference/v1/abort_requests"


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


class Upstream:
    def __init__(self, session: aiohttp.ClientSession, *, api_key: str | None,
                 connect_timeout: float) -> None:
        self.session = session
        self.connect_timeout = connect_timeout
        self._headers = {"Content-Type": "application/json"}
        self._timeouts: dict[tuple[float | None, float | None], aiohttp.ClientTimeout] = {}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"

    def _timeout(self, total: float | None, sock_read: float | None = None) -> aiohttp.ClientTimeout:
        # ClientTimeout is immutable: build each combination once (a handful per process).
        key = (total, sock_read)
        timeout = self._timeouts.get(key)
        if timeout is None:
            timeout = self._timeouts[key] = aiohttp.ClientTimeout(
                total=total, sock_connect=self.connect_timeout, connect=self.connect_timeout,
                sock_read=sock_read)
        return timeout

    async def open(self, hop: str, worker: str, body: dict[str, Any], *, request_id: str,
                   total: float | None, sock_read: float | None = None) -> aiohttp.ClientResponse:
        """POST a generate body and return the response once its headers arrived (status 2xx).

        The caller owns the response (``close()`` it). Error statuses are read and raised.
        """
        headers = dict(self._headers)
        headers["X-Request-Id"] = request_id
        try:
            resp = await self.session.post(
                worker + GENERATE_PATH, data=_dumps(body), headers=headers,
                timeout=self._timeout(total, sock_read),
            )
        except TimeoutError:
            raise UpstreamTimeout(hop, worker, "timed out before answering") from None
        except aiohttp.ClientError as e:
            raise UpstreamUnavailable(hop, worker, f"unreachable ({type(e).__name__})") from None
        if resp.status >= 400:
            try:
                payload = await resp.read()
            except (TimeoutError, aiohttp.ClientError):
                payload = b""
            finally:
                resp.release()
            raise UpstreamStatusError(hop, worker, resp.status, payload,
                                      resp.headers.get("Content-Type", "application/json"))
        return resp

    async def read_json(self, hop: str, worker: str, resp: aiohttp.ClientResponse) -> dict[str, Any]:
        return (await self.read_json_raw(hop, worker, resp))[0]

    async def read_json_raw(self, hop: str, worker: str,
                            resp: aiohttp.ClientResponse) -> tuple[dict[str, Any], bytes]:
        """The JSON object of a response and its bytes (to forward untouched)."""
        try:
            raw = await resp.read()
        except TimeoutError:
            raise UpstreamTimeout(hop, worker, "timed out while answering") from None
        except aiohttp.ClientError as e:
            raise UpstreamUnavailable(hop, worker, f"connection lost ({type(e).__name__})") from None
        finally:
            resp.release()
        try:
            obj = json.loads(raw)
        except ValueError:
            raise UpstreamProtocolError(hop, worker, "answered a body that is not JSON") from None
        if not isinstance(obj, dict):
            raise UpstreamProtocolError(hop, worker, "answered JSON that is not an object")
        return obj, raw

    async def post_generate(self, hop: str, worker: str, body: dict[str, Any], *, request_id: str,
                            total: float) -> dict[str, Any]:
        return (await self.post_generate_raw(hop, worker, body, request_id=request_id, total=total))[0]

    async def post_generate_raw(self, hop: str, worker: str, body: dict[str, Any], *, request_id: str,
                                total: float) -> tuple[dict[str, Any], bytes]:
        resp = await self.open(hop, worker, body, request_id=request_id, total=total)
        return await self.read_json_raw(hop, worker, resp)

    def iter_chunks(self, hop: str, worker: str, resp: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
        """The body of a streaming response as it arrives (whatever each read gave), errors
        translated. One awaitable per read: no async generator between the socket and the relay."""
        return _Chunks(hop, worker, resp.content)

    async def abort(self, worker: str, request_ids: list[str], *, limit: float) -> bool:
        """Tell a worker to abort ids; True when it answered 200."""
        try:
            async with self.session.post(
                worker + ABORT_PATH, data=_dumps({"request_ids": request_ids}),
                headers=self._headers, timeout=self._timeout(limit),
            ) as resp:
                await resp.read()
                return resp.status == 200
        except (TimeoutError, aiohttp.ClientError):
            return False

    async def health(self, worker: str, *, limit: float) -> bool:
        try:
            async with self.session.get(worker + "/health", headers=self._headers,
                                        timeout=self._timeout(limit)) as resp:
                await resp.read()
                return resp.status == 200
        except (TimeoutError, aiohttp.ClientError):
            return False


class _Chunks:
    __slots__ = ("_content", "_hop", "_worker")

    def __init__(self, hop: str, worker: str, content: aiohttp.StreamReader) -> None:
        self._hop = hop
        self._worker = worker
        self._content = content

    def __aiter__(self) -> _Chunks:
        return self

    async def __anext__(self) -> bytes:
        try:
            chunk = await self._content.readany()
        except TimeoutError:
            raise UpstreamTimeout(self._hop, self._worker, "stream stalled") from None
        except aiohttp.ClientError as e:
            raise UpstreamUnavailable(self._hop, self._worker,
                                      f"stream broken ({type(e).__name__})") from None
        if not chunk:
            raise StopAsyncIteration
        return chunk


__all__ = ["ABORT_PATH", "GENERATE_PATH", "Upstream", "UpstreamError"]
