"""Client keys and tenants: a tenant only reaches its own requests (``<tag>~<id>`` on the workers
with two or more keys, ``proxy.wire.ids``); keys are checked in constant time."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

_TAG_CONTEXT = b"pd-proxy tenant\x00"


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    """For logs (``tenant=`` in the access line): the key file's name, else the tag."""
    tag: str
    """Prefix of the ids the workers know this tenant's requests by; empty for a single tenant."""


OPEN = Tenant("-", "")
"""The caller when no key is configured."""


def key_bytes(key: str) -> bytes:
    """A key as the bytes it came in: aiohttp decodes a header's bytes that are not UTF-8 to lone
    surrogates (``surrogateescape``), which give them back; such a key matches no configured key."""
    return key.encode("utf-8", "surrogateescape")


def key_tag(key: str) -> str:
    return hashlib.sha256(_TAG_CONTEXT + key_bytes(key)).hexdigest()[:12]


class Tenants:
    def __init__(self, keys: Iterable[tuple[str | None, str]]) -> None:
        """``keys``: (name or None, key) pairs. Raises ``ValueError`` for an empty or repeated key."""
        entries: list[tuple[bytes, Tenant]] = []
        seen: set[bytes] = set()
        pairs = list(keys)
        for name, key in pairs:
            if not key:
                raise ValueError("an API key is empty")
            digest = hashlib.sha256(key_bytes(key)).digest()
            if digest in seen:
                raise ValueError("an API key is given twice")
            seen.add(digest)
            tag = key_tag(key) if len(pairs) > 1 else ""
            entries.append((digest, Tenant(name or key_tag(key), tag)))
        self._entries = tuple(entries)

    @property
    def enabled(self) -> bool:
        return bool(self._entries)

    @property
    def namespaced(self) -> bool:
        return len(self._entries) > 1

    def __len__(self) -> int:
        return len(self._entries)

    def identify(self, authorization: str | None) -> Tenant | None:
        if not authorization:
            return None
        scheme, _, param = authorization.partition(" ")
        if scheme.lower() != "bearer":
            return None
        digest = hashlib.sha256(key_bytes(param)).digest()
        found: Tenant | None = None
        for key_digest, tenant in self._entries:  # all of them: the time does not tell which matched
            if hmac.compare_digest(digest, key_digest):
                found = tenant
        return found


def read_key_file(path: Path) -> list[tuple[str | None, str]]:
    """One key per line, ``KEY`` or ``NAME KEY``; blank lines and ``#`` comments are skipped."""
    keys: list[tuple[str | None, str]] = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        parts = text.split()
        if len(parts) == 1:
            keys.append((None, parts[0]))
        elif len(parts) == 2:
            keys.append((parts[0], parts[1]))
        else:
            raise ValueError(f"{path}:{number}: expected 'KEY' or 'NAME KEY'")
    return keys


__all__ = ["OPEN", "Tenant", "Tenants", "key_bytes", "key_tag", "read_key_file"]
