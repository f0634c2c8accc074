"""The preflight check of a prefill x decode pair: one tiny real P->D hand-off (one block of the
pair plus one token, prefilled on P, decoded from its KV on D with ``max_tokens=1``). If D's answer
never comes, P's blocks are freed by its lease."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any, Protocol

from kv_transfer.handoff import check_prefill_params, prefill_params
from proxy.fleet.health import PreflightFn
from proxy.pools.worker import Worker

FIRST_TOKEN = 3  # clear of the usual special ids (0 <s>, 1 </s>, 2 <pad>)


class PreflightError(Exception):
    pass


class GeneratePoster(Protocol):
    async def post_generate(self, hop: str, worker: str, body: dict[str, Any], *, request_id: str,
                            total: float) -> dict[str, Any]: ...


def handoff_check(upstream: GeneratePoster, *, block_size: int | Callable[[Worker, Worker], int],
                  timeout: float, rewrite: Callable[[dict[str, Any], str], dict[str, Any]] | None = None,
                  model: str | None = None) -> PreflightFn:
    """``block_size``: one for every pair, or the pair's (``proxy.pools.blocks.BlockSizes.pair``)."""

    async def check(p: Worker, d: Worker) -> None:
        size = block_size if isinstance(block_size, int) else block_size(p, d)
        prompt = [FIRST_TOKEN + (i % 64) for i in range(size + 1)]
        rid = f"pd-preflight-{uuid.uuid4().hex}"
        base: dict[str, Any] = {"request_id": rid, "token_ids": prompt, "stream": False,
                                "output_mode": "tokens",
                                "sampling_params": {"max_tokens": 1, "temperature": 0.0}}
        if model is not None:
            base["model"] = model
        reply = await upstream.post_generate(
            "prefill", p.url, {**base, "kv_transfer_params": prefill_params()},
            request_id=rid, total=timeout)
        params = reply.get("kv_transfer_params")
        reason = check_prefill_params(params)
        if reason is not None or not isinstance(params, dict):
            raise PreflightError(f"prefill {p.url}: {reason}")
        if rewrite is not None:
            params = rewrite(params, p.url)
        answer = await upstream.post_generate("decode", d.url, {**base, "kv_transfer_params": params},
                                              request_id=rid, total=timeout)
        choices = answer.get("choices")
        first = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
        if not first.get("token_ids") or first.get("finish_reason") == "abort":
            raise PreflightError(f"decode {d.url} produced no token from {p.url}'s KV")

    return check
