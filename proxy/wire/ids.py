"""Request ids: what a client may name a request, and the id the workers know it by.

vLLM takes any string as a request id (the ``X-Request-Id`` header, else the body's
``request_id``). The proxy puts the id in worker requests, log lines, metrics exemplars and abort
fan-outs, so it accepts only ids that are safe in all of them: 1 to ``MAX_ID_CHARS`` characters
(letters, digits and ``-_.:@+=/``; no spaces, quotes, control characters or
non-ASCII). Anything else is a 400 before any hop, never a 500 and never a forged log line.

With several tenants (``proxy.config.tenants``), the workers know a request as ``<tag>~<id>``: the
tenant's tag, then the client's id (``~`` is not a client character, so a namespaced id never
equals a client's). Two tenants may use the same id at once, and an abort (or its broadcast to
every worker) built from one tenant's id can only reach that tenant's requests. Responses are
written with the client's own id (``Rewrite``), as a single vLLM server would.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Final

from proxy.wire.errors import BadRequest
from proxy.wire.protocol import GENERATE_PREFIX

MAX_ID_CHARS: Final = 128
OPENAI_PREFIXES: Final = ("chatcmpl-", "cmpl-")
"""The ids vLLM's render gives chat and completions requests (``proxy.openai``)."""
NAMESPACE_SEP: Final = "~"
_ID: Final = re.compile(rf"[A-Za-z0-9_.:@+=/-]{{1,{MAX_ID_CHARS}}}")


def is_valid_id(value: str) -> bool:
    return _ID.fullmatch(value) is not None


def client_request_id(header: str | None, body_id: str | None) -> str | None:
    """The client's id for a generate call (header first, as vLLM), checked; ``None`` when the
    client named none (an empty id counts as none). Raises ``BadRequest`` (400) for an id the
    proxy will not carry."""
    if header:
        value, where = header, "X-Request-Id"
    elif body_id:
        value, where = body_id, "request_id"
    else:
        return None  # none, or an empty one: a fresh id (vLLM would use "" and collide)
    if not is_valid_id(value):
        raise BadRequest(
            f"{where} must be 1 to {MAX_ID_CHARS} characters of letters, digits and '-_.:@+=/'.",
            param=where)
    return value


def new_client_id() -> str:
    """A request's id when the client named none: 128 random bits in hex, as ``uuid4().hex``
    (unguessable: an id is what an abort names) without building a ``UUID`` (3.1 -> 0.9 us)."""
    return os.urandom(16).hex()


def upstream_id(tag: str, client_id: str) -> str:
    """The id the workers know the request by (the client's own for a single tenant)."""
    return f"{tag}{NAMESPACE_SEP}{client_id}" if tag else client_id


def abortable_id(engine_id: str) -> str | None:
    """The client part of an id named in an abort call, when it can be a vLLM generate id of
    this proxy (``generate-tokens-`` and a valid id); ``None`` for anything else (vLLM accepts
    such ids and aborts nothing: neither does the proxy, and it sends them nowhere). An OpenAI
    route's id as its client knows it (``chatcmpl-<id>``, ``cmpl-<id>``, the answer's ``id``)
    names that request (its generate id is ``generate-tokens-`` and that id)."""
    if engine_id.startswith(OPENAI_PREFIXES):
        return engine_id if is_valid_id(engine_id) else None
    if not engine_id.startswith(GENERATE_PREFIX):
        return None
    rest = engine_id[len(GENERATE_PREFIX):]
    return rest if is_valid_id(rest) else None


@dataclass(frozen=True, slots=True)
class Rewrite:
    """Replace the namespaced engine id with the client's in bytes sent to the client (every
    place a worker writes the id is the JSON string ``"generate-tokens-<id>"``)."""

    upstream: bytes
    client: bytes

    @classmethod
    def for_ids(cls, upstream: str, client: str) -> Rewrite | None:
        if upstream == client:
            return None
        return cls(f'"{GENERATE_PREFIX}{upstream}"'.encode(), f'"{GENERATE_PREFIX}{client}"'.encode())

    def apply(self, data: bytes) -> bytes:
        return data.replace(self.upstream, self.client)


__all__ = ["MAX_ID_CHARS", "OPENAI_PREFIXES", "Rewrite", "abortable_id", "client_request_id", "is_valid_id",
           "new_client_id", "upstream_id"]
