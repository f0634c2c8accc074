"""A worker's answer to a control call read up to a bound, whatever the worker sends."""

from __future__ import annotations

import aiohttp

PROBE_ANSWER_LIMIT = 1024 * 1024
"""The most of a probe's or an abort's answer read (vLLM's are a few bytes); past it the call fails."""
METRICS_PAGE_LIMIT = 16 * 1024 * 1024
"""The most of a worker's ``/metrics`` page read (vLLM's is tens of KiB); past it the scrape fails."""


class AnswerTooLarge(aiohttp.ClientPayloadError):
    """A worker's answer to a control call passed its limit: the call fails, its connection closed."""


async def read_capped(resp: aiohttp.ClientResponse, limit: int) -> bytes:
    """``resp``'s body up to ``limit`` bytes, else ``AnswerTooLarge`` (the connection closed)."""
    length = resp.content_length
    if length is None or length <= limit:
        body = bytearray()
        while len(body) <= limit:
            chunk = await resp.content.read(limit + 1 - len(body))
            if not chunk:
                return bytes(body)
            body += chunk
    resp.close()
    raise AnswerTooLarge(f"{resp.url.origin()} answered more than {limit} bytes")


__all__ = ["METRICS_PAGE_LIMIT", "PROBE_ANSWER_LIMIT", "AnswerTooLarge", "read_capped"]
