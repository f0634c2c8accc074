"""The transport seam: every byte the proxy exchanges with a worker goes through ``Upstream``
(generate hops on ``hop.HopClient``, control calls on one aiohttp session), with a timeout on
every call and transport errors translated once into ``UpstreamError``s naming hop and worker.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import aiohttp

from proxy import __version__
from proxy.upstream.capped import PROBE_ANSWER_LIMIT, read_capped
from proxy.upstream.hop import (
    HopClient,
    HopConnectTimeout,
    HopDisconnected,
    HopProtocolError,
    HopResponse,
    HopStale,
    HopTooLarge,
    SinkError,
    header_lines,
)
from proxy.wire.errors import (
    UpstreamError,
    UpstreamProtocolError,
    UpstreamStatusError,
    UpstreamTimeout,
    UpstreamUnavailable,
)
from proxy.wire.protocol import engine_request_id, hop_json, parse_worker_json
from proxy.wire.token_ids import encode_body

GENERATE_PATH = "/inference/v1/generate"
ABORT_PATH = "/inference/v1/abort_requests"

HeaderInjector = Callable[[dict[str, str]], None]
"""Adds headers to a hop (the tracing's ``traceparent``)."""
ResendCounter = Callable[[str, str], None]
"""Counts a stale kept-alive hop: (hop, ``resent`` or ``abort_failed``)."""
DecodeObserver = Callable[[str, dict[str, Any]], None]
"""Told of every decode hop as it goes out: (worker URL, body)."""


def _broken(e: BaseException) -> str:
    if isinstance(e, HopDisconnected):
        return "closed the connection"
    return type(e).__name__


_LIMIT_FLAGS = {"head": "--max-upstream-header-bytes", "body": "--max-upstream-body-bytes",
                "error": "--max-upstream-error-bytes"}


def _failed(hop: str, worker: str, e: BaseException, doing: str) -> UpstreamError:
    """A hop's transport failure as the proxy's error: broken HTTP/1.1 or a passed limit is the
    worker's protocol error (502, not retried); a reset or lost connection is ``doing``."""
    if isinstance(e, HopTooLarge):
        return UpstreamProtocolError(hop, worker, f"answered {e} ({_LIMIT_FLAGS[e.part]})")
    if isinstance(e, HopProtocolError) and not isinstance(e, HopDisconnected):
        return UpstreamProtocolError(hop, worker, f"broke HTTP/1.1 ({e})")
    return UpstreamUnavailable(hop, worker, f"{doing} ({_broken(e)})")


class Upstream:
    def __init__(self, session: aiohttp.ClientSession, *, api_key: str | None, connect_timeout: float,
                 hops: HopClient | None = None, inject: HeaderInjector | None = None,
                 keepalive: float = 4.0, abort_limit: float = 5.0,
                 count_resend: ResendCounter | None = None) -> None:
        self.session = session
        self.connect_timeout = connect_timeout
        self.hops = hops or HopClient(connect_timeout=connect_timeout, keepalive=keepalive)
        self._inject = inject
        self.abort_limit = abort_limit
        """The abort sent before a stale hop goes out again (``open``): at most this long."""
        self._count_resend = count_resend
        self.on_decode: DecodeObserver | None = None
        """Told of each decode hop (what D should compute itself)."""
        self._headers = {"Content-Type": "application/json"}
        self._timeouts: dict[float, aiohttp.ClientTimeout] = {}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        self._hop_headers = header_lines({**self._headers, "User-Agent": f"pd-proxy/{__version__}"})

    def _timeout(self, total: float) -> aiohttp.ClientTimeout:
        timeout = self._timeouts.get(total)
        if timeout is None:
            timeout = self._timeouts[total] = aiohttp.ClientTimeout(
                total=total, sock_connect=self.connect_timeout, connect=self.connect_timeout)
        return timeout

    async def open(self, hop: str, worker: str, body: dict[str, Any], *, request_id: str,
                   total: float | None, sock_read: float | None = None, stream: bool = False) -> HopResponse:
        """POST a generate body; the response once its 2xx head arrived (the caller ``close()``s
        it). ``total`` bounds the exchange, ``sock_read`` each wait for bytes. Error statuses are
        read (within the error limit) and raised.

        A ``HopStale`` hop is sent once more only after the worker answered an abort of its id (so
        any copy it read is ended); when that abort fails, the hop fails as a disconnect.
        """
        if hop == "decode" and self.on_decode is not None:
            self.on_decode(worker, body)
        extra = {"X-Request-Id": request_id}
        if self._inject is not None:
            self._inject(extra)
        headers = self._hop_headers + header_lines(extra)
        hops = self.hops
        deadline = hops.loop.time() + total if total is not None else None
        data = encode_body(body)
        try:
            try:
                resp = await hops.request(worker, GENERATE_PATH, headers, data, deadline=deadline,
                                          read_limit=sock_read, stream=stream)
            except HopStale:
                if not await self._abort_stale(hop, worker, request_id, deadline):
                    raise
                resp = await hops.request(worker, GENERATE_PATH, headers, data, deadline=deadline,
                                          read_limit=sock_read, stream=stream)
        except HopConnectTimeout as e:
            raise UpstreamTimeout(hop, worker, str(e)) from None
        except TimeoutError:
            raise UpstreamTimeout(hop, worker, "timed out before answering") from None
        except (OSError, HopProtocolError) as e:
            raise _failed(hop, worker, e, "unreachable") from None
        if resp.status >= 400:
            try:
                payload = await resp.read()
            except (TimeoutError, OSError):  # (a disconnect too)
                payload = b""
            except HopProtocolError as e:  # never passed on cut short, or past its limit
                raise _failed(hop, worker, e, "connection lost") from None
            finally:
                resp.close()
            raise UpstreamStatusError(hop, worker, resp.status, payload,
                                      resp.headers.get("content-type", "application/json"))
        return resp

    async def _abort_stale(self, hop: str, worker: str, request_id: str, deadline: float | None) -> bool:
        """Abort the request's id on the worker before sending it again; True when it answered."""
        limit = self.abort_limit
        if deadline is not None:
            # tenths of a second: ``_timeout`` keeps one ClientTimeout per distinct limit
            limit = min(limit, math.floor((deadline - self.hops.loop.time()) * 10) / 10)
        ok = limit > 0 and await self.abort(worker, [engine_request_id(request_id)], limit=limit)
        if self._count_resend is not None:
            self._count_resend(hop, "resent" if ok else "abort_failed")
        return ok

    async def read_json_raw(self, hop: str, worker: str, resp: HopResponse) -> tuple[dict[str, Any], bytes]:
        """The JSON object of a response and its bytes (to forward untouched)."""
        try:
            raw = await resp.read()
        except TimeoutError:
            raise UpstreamTimeout(hop, worker, "timed out while answering") from None
        except (OSError, HopProtocolError) as e:
            raise _failed(hop, worker, e, "connection lost") from None
        finally:
            resp.close()
        try:
            obj = parse_worker_json(raw)
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

    async def pipe(self, hop: str, worker: str, resp: HopResponse, sink: Callable[[bytes], bool]) -> None:
        """The body of a streaming response to ``sink`` as it arrives, until it ends or the sink
        returns False; the hop's failures translated, the sink's own raised as they are."""
        try:
            await resp.pipe(sink)
        except SinkError as e:
            raise e.error from None
        except TimeoutError:
            raise UpstreamTimeout(hop, worker, "stream stalled") from None
        except (OSError, HopProtocolError) as e:
            raise _failed(hop, worker, e, "stream broken") from None

    async def abort(self, worker: str, request_ids: list[str], *, limit: float) -> bool:
        """Tell a worker to abort ids; True when it answered 200."""
        try:
            async with self.session.post(
                worker + ABORT_PATH, data=hop_json({"request_ids": request_ids}),
                headers=self._headers, timeout=self._timeout(limit),
            ) as resp:
                await read_capped(resp, PROBE_ANSWER_LIMIT)
                return resp.status == 200
        except (TimeoutError, aiohttp.ClientError):
            return False

    async def health(self, worker: str, *, limit: float) -> bool:
        try:
            async with self.session.get(worker + "/health", headers=self._headers,
                                        timeout=self._timeout(limit)) as resp:
                await read_capped(resp, PROBE_ANSWER_LIMIT)
                return resp.status == 200
        except (TimeoutError, aiohttp.ClientError):
            return False


__all__ = ["ABORT_PATH", "GENERATE_PATH", "Upstream", "UpstreamError", "encode_body"]
