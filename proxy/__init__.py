"""pd-proxy: one vLLM-compatible endpoint in front of disaggregated prefill/decode pools.

Public API: ``build_app`` (an ``aiohttp.web.Application``) and ``ProxySettings``. They are
re-exported lazily so that ``proxy.wire.protocol`` (the wire models shared with pd-sim and pd-bench)
stays importable without pulling in the server.
"""

import importlib

__version__ = "0.1.0"

__all__ = ["ProxySettings", "__version__", "build_app"]

_LAZY = {"build_app": "proxy.http.app", "ProxySettings": "proxy.config.settings"}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(name)
