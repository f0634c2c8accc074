"""The P->D hand-off: the prefill, decode and release hops' bodies, and the check of P's answer.
Transfer params are built here and nowhere else; a client never sets them."""

from __future__ import annotations

import functools
import ipaddress
from collections.abc import Mapping
from itertools import repeat
from typing import Any, Final
from urllib.parse import urlsplit

PREFILL_REQUEST: Final[Mapping[str, bool]] = {"do_remote_decode": True, "do_remote_prefill": False}
"""The ``kv_transfer_params`` of every prefill hop (copied per hop: bodies are mutable)."""

PREFILL_REPLY_REQUIRED: Final[Mapping[str, type]] = {
    "do_remote_prefill": bool,
    "remote_block_ids": list,
    "remote_engine_id": str,
    "remote_host": str,
    "remote_port": int,
}
"""What the decode worker's connector needs of P's ``kv_transfer_params``, with its type."""

_PROMPT_ONLY: Final = ("prompt_logprobs", "prompt_logprob_token_ids")
_RELEASE_DROPS: Final = ("min_tokens", "prompt_logprobs", "logprobs", "stop", "prompt_logprob_token_ids")


def prefill_params() -> dict[str, Any]:
    return dict(PREFILL_REQUEST)


def prefill_body(data: Mapping[str, Any], base_id: str, *, stream: bool,
                 keep_stop: bool = True, first_token: bool = False) -> dict[str, Any]:
    """The prefill hop for a checked client request (``first_token``: P samples token 1 as the
    client's request would: its ``output_mode``, ``min_tokens`` capped at 1)."""
    body = dict(data)
    sp = dict(data["sampling_params"])
    sp["max_tokens"] = 1
    min_tokens = sp.pop("min_tokens", None)
    if first_token and isinstance(min_tokens, int) and min_tokens >= 1:
        sp["min_tokens"] = 1
    if not keep_stop:
        sp.pop("stop", None)
    if stream:
        sp.pop("prompt_logprobs", None)
    body["sampling_params"] = sp
    body["request_id"] = base_id
    body["stream"] = False
    body.pop("stream_options", None)
    body["output_mode"] = (data.get("output_mode") or "tokens") if first_token else "tokens"
    body["kv_transfer_params"] = prefill_params()
    return body


def decode_body(data: Mapping[str, Any], base_id: str, kv_params: dict[str, Any] | None) -> dict[str, Any]:
    """The decode hop: the client's request with P's params (``None``: decode-only, no params)."""
    body = dict(data)
    body["request_id"] = base_id
    sp = data["sampling_params"]
    if "prompt_logprobs" in sp or "prompt_logprob_token_ids" in sp:
        # The prefill worker computed them; the decode worker cannot for transferred tokens.
        body["sampling_params"] = {k: v for k, v in sp.items() if k not in _PROMPT_ONLY}
    if kv_params is not None:
        body["kv_transfer_params"] = kv_params
    else:
        body.pop("kv_transfer_params", None)
    return body


def release_body(data: Mapping[str, Any], base_id: str, kv_params: dict[str, Any]) -> dict[str, Any]:
    """A decode request whose only job is to make D pull (so P frees) the KV blocks."""
    body = dict(data)
    sp = dict(data["sampling_params"])
    sp["max_tokens"] = 1
    sp["n"] = 1
    for key in _RELEASE_DROPS:
        sp.pop(key, None)
    body["sampling_params"] = sp
    body["request_id"] = base_id
    body["stream"] = False
    body.pop("stream_options", None)
    body["output_mode"] = "tokens"
    body["kv_transfer_params"] = kv_params
    return body


def check_prefill_params(params: object) -> str | None:
    """Why a prefill reply's ``kv_transfer_params`` cannot drive a decode hop, or None."""
    if not isinstance(params, dict):
        return "kv_transfer_params is null" if params is None else "kv_transfer_params is not an object"
    for key, tp in PREFILL_REPLY_REQUIRED.items():
        if key not in params:
            return f"kv_transfer_params.{key} is missing"
        value = params[key]
        if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
            return f"kv_transfer_params.{key} has the wrong type"
    if params["do_remote_prefill"] is not True:
        return "kv_transfer_params.do_remote_prefill is not true"
    blocks = params["remote_block_ids"]
    flat = all(isinstance(g, list) and all(map(isinstance, g, repeat(int))) for g in blocks)
    return None if flat else "kv_transfer_params.remote_block_ids is not a list of lists of ints"


def remote_blocks(params: Mapping[str, Any]) -> int:
    """Blocks a checked reply holds on the prefill worker (every KV group's)."""
    return sum(len(g) for g in params.get("remote_block_ids", ()))


_LOOPBACK_NAMES: Final = frozenset({"localhost", "localhost.localdomain", "ip6-localhost"})


def is_loopback_or_unspecified(host: str) -> bool:
    if host.lower() in _LOOPBACK_NAMES:
        return True
    try:
        addr = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return addr.is_loopback or addr.is_unspecified


class RemoteHostRewrite:
    """D is sent to the host the proxy reached P at when P advertised a loopback or unspecified
    ``remote_host`` and P is not on this host; otherwise (or when off) nothing changes."""

    def __init__(self, *, enabled: bool = True, cache: int = 1024) -> None:
        self.enabled = enabled
        self._is_local = functools.lru_cache(maxsize=cache)(is_loopback_or_unspecified)
        self._routable = functools.lru_cache(maxsize=cache)(self._routable_host)

    def _routable_host(self, worker_url: str) -> str | None:
        reached = urlsplit(worker_url).hostname
        return reached if reached and not self._is_local(reached) else None

    def __call__(self, params: dict[str, Any], worker_url: str) -> dict[str, Any]:
        if not self.enabled:
            return params
        advertised = params.get("remote_host")
        if not isinstance(advertised, str) or not self._is_local(advertised):
            return params
        reached = self._routable(worker_url)
        if reached is not None:
            params = dict(params)
            params["remote_host"] = reached
        return params


__all__ = [
    "PREFILL_REPLY_REQUIRED",
    "PREFILL_REQUEST",
    "RemoteHostRewrite",
    "check_prefill_params",
    "decode_body",
    "is_loopback_or_unspecified",
    "prefill_body",
    "prefill_params",
    "release_body",
    "remote_blocks",
]
