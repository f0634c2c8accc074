"""Transfer parameters are the proxy's, never a client's.

vLLM's engine reads ``kv_transfer_params`` and ``ec_transfer_params`` from
``sampling_params.extra_args`` (``vllm/v1/request.py``); its HTTP server copies the top-level fields
of the same names there when they are not null. Both name worker-side addresses and blocks: the
decode worker pulls KV from ``remote_host:remote_port`` (NIXL side channel) whatever the request
says, and a real engine id reads whatever blocks it names. So a client that could set them would
steer a worker's KV pull to any address, or read another tenant's KV.

pd-proxy builds every hop's transfer params itself and refuses a request that carries such a key
anywhere (``client_transfer_params``): at the top level (a ``null`` there names nothing and is
allowed, as a plain vLLM client may send it), inside ``sampling_params.extra_args``, or at any
other depth, so that a future vLLM reading them from elsewhere is covered too. One rule, applied
once before any hop: no path (two-hop, decode-only, retries, rescue, migration, KV release) can
forward them.
"""

from __future__ import annotations

from typing import Any, Final

TRANSFER_KEYS: Final = ("kv_transfer_params", "ec_transfer_params")
_MARK: Final = b"transfer_params"
_ESCAPE: Final = b"\\u"


def client_transfer_params(raw: bytes, data: dict[str, Any]) -> str | None:
    """The dotted path of the first transfer key a client body carries (``None`` when there is
    none). ``raw`` is the body as sent, ``data`` its parse. A key can only be spelled with the
    mark's bytes or with a ``\\u`` escape, so a body with neither (nearly all) is not walked."""
    if _MARK not in raw and (b"\\" not in raw or _ESCAPE not in raw):  # one byte searched first: faster
        return None
    for key in TRANSFER_KEYS:
        if data.get(key) is not None:
            return key
    for key, value in data.items():
        if key == "token_ids":  # ints only (validated): nothing to walk
            continue
        found = _find(value, key)
        if found is not None:
            return found
    return None


def _find(value: Any, path: str) -> str | None:
    # Depth is bounded by the body parser (JSON nested deeper than 64 levels is refused).
    if isinstance(value, dict):
        for key, inner in value.items():
            here = f"{path}.{key}"
            if key in TRANSFER_KEYS:
                return here
            found = _find(inner, here)
            if found is not None:
                return found
    elif isinstance(value, list):
        for i, inner in enumerate(value):
            if isinstance(inner, dict | list):
                found = _find(inner, f"{path}[{i}]")
                if found is not None:
                    return found
    return None


__all__ = ["TRANSFER_KEYS", "client_transfer_params"]
