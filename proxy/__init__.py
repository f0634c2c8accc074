"""pd-proxy, one vLLM endpoint over prefill/decode pools; ``build_app`` and ``ProxySettings`` load lazily."""

import importlib

__version__ = "0.1.0"

__all__ = ["ProxySettings", "__version__", "build_app"]

_LAZY = {"build_app": "proxy.http.app", "ProxySettings": "proxy.config.settings"}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(name)
