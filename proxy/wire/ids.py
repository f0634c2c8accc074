"""Request ids: only ids safe in worker requests, logs, exemplars and aborts are accepted (else a
400). With several tenants the workers know a request as ``<tag>~<id>`` (``~`` is not a client
character, so tenants never reach each other's requests); clients see their own id (``Rewrite``).
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
    """The client's id (header first, as vLLM), or ``None``; ``BadRequest`` for an unsafe id."""
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
    """A request's id when the client named none: unguessable, since an abort names it."""
    return os.urandom(16).hex()


def upstream_id(tag: str, client_id: str) -> str:
    """The id the workers know the request by (the client's own for a single tenant)."""
    return f"{tag}{NAMESPACE_SEP}{client_id}" if tag else client_id


def abortable_id(engine_id: str) -> str | None:
    """The client part of an id named in an abort call, or ``None`` when it cannot be a generate
    id of this proxy (sent nowhere: vLLM aborts nothing for it either). An OpenAI route's id as its
    client knows it (``chatcmpl-<id>``, ``cmpl-<id>``) names that request."""
    if engine_id.startswith(OPENAI_PREFIXES):
        return engine_id if is_valid_id(engine_id) else None
    if not engine_id.startswith(GENERATE_PREFIX):
        return None
    rest = engine_id[len(GENERATE_PREFIX):]
    return rest if is_valid_id(rest) else None


@dataclass(frozen=True, slots=True)
class Rewrite:
    """Replace the namespaced engine id (always the JSON string ``"generate-tokens-<id>"``) with the
    client's in bytes sent to the client."""

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
