"""Transfer parameters are the proxy's, never a client's: they name worker addresses and blocks.
A request carrying a non-null one at any depth is refused before any hop (``client_transfer_params``).
"""

from __future__ import annotations

from typing import Any, Final

TRANSFER_KEYS: Final = ("kv_transfer_params", "ec_transfer_params")


def client_transfer_params(data: dict[str, Any]) -> str | None:
    """The dotted path of the first transfer key a client body's parse carries, or ``None``."""
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
