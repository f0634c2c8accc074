"""A worker's answer to a control call (probe, abort, scrape, model length) read up to a bound:
a broken or hostile worker cannot make the proxy hold more than the bound."""

from __future__ import annotations

import aiohttp

PROBE_ANSWER_LIMIT = 1024 * 1024
"""The most of a probe's or an abort's answer read (vLLM's are a few bytes); past it the call fails."""
METRICS_PAGE_LIMIT = 16 * 1024 * 1024
"""The most of a worker's ``/metrics`` page read (vLLM's is tens of KiB); past it the scrape fails."""


class AnswerTooLarge(aiohttp.ClientPayloadError):
    """A worker's answer to a control call passed its limit: the call fails, its connection closed."""


async def read_capped(resp: aiohttp.ClientResponse, limit: int) -> bytes:
    """``resp``'s body, never holding more than ``limit`` bytes of it (plus aiohttp's read buffer):
    ``AnswerTooLarge`` past it, the connection closed rather than returned to the pool."""
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
