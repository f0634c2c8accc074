"""CPU per request for the client body (parse and validate it, then write both hop bodies) and
for the workers' replies (parse them).

    python -m benchmarks.internals.body_cost [--prompt-lens 128,2048,4096] [--calls 2000] [--rounds 3]

The work pd-proxy does on every generate call before and between its hops that grows with the
prompt: ``Validation.validate`` (JSON parse, vLLM's validation) and
``encode_body`` of the prefill and the decode hop bodies. In this process, no network.
``client_text``: the body as compare_routers sends it (compact JSON); ``escaped``: the same body
with a ``\\u`` escape in a stop string. ``reply_N``: ``Upstream``'s parse of a non-stream reply with
N generated tokens and their text, as vLLM writes it (N = 1 is the prefill worker's answer, with its
``kv_transfer_params``). Prints one JSON line: microseconds of CPU (``time.process_time``) per call,
per prompt length, one figure per round. Bounded: ``--calls`` at most 100,000.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from kv_transfer.handoff import decode_body, prefill_body
from proxy.config.settings import ProxySettings
from proxy.upstream.client import encode_body
from proxy.walk.validation import Validation
from proxy.wire.protocol import parse_worker_json

_MAX_CALLS = 100_000


def client_body(prompt_len: int, *, escaped: bool) -> bytes:
    sp: dict[str, Any] = {"max_tokens": 32, "temperature": 0.0, "ignore_eos": True}
    if escaped:
        sp["stop"] = ["\u00e9"]  # written as \u00e9 (ensure_ascii)
    body = {"token_ids": [(i * 7919) % 250 + 3 for i in range(prompt_len)], "sampling_params": sp,
            "stream": False}
    return json.dumps(body, separators=(",", ":")).encode()


def worker_reply(tokens: int) -> bytes:
    """A non-stream reply as vLLM writes it (starlette: compact, UTF-8 unescaped)."""
    ids = [(i * 104729) % 30000 + 3 for i in range(tokens)]
    reply: dict[str, Any] = {
        "request_id": "gen-0123456789abcdef", "choices": [{
            "index": 0, "token_ids": ids, "text": " word" * tokens, "logprobs": None,
            "finish_reason": "length", "stop_reason": None}],
        "prompt_logprobs": None, "kv_transfer_params": None,
        "usage": {"prompt_tokens": 128, "completion_tokens": tokens, "total_tokens": 128 + tokens,
                  "prompt_tokens_details": None}}
    if tokens == 1:
        reply["kv_transfer_params"] = {
            "do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [1, 2],
            "remote_engine_id": "0d8c3b2e-5f7a-4c1e-9b6d-2a4f8e1c7d90", "remote_request_id": "gen-0123",
            "remote_host": "127.0.0.1", "remote_port": 5600, "tp_size": 1}
    return json.dumps(reply, separators=(",", ":"), ensure_ascii=False).encode()


def timed(call: Callable[[], object], calls: int, rounds: int) -> list[float]:
    for _ in range(min(calls, 50)):
        call()  # warm
    figures = []
    for _ in range(rounds):
        t0 = time.process_time()
        for _ in range(calls):
            call()
        figures.append(round((time.process_time() - t0) / calls * 1e6, 1))
    return figures


def one_call(validation: Validation, body: bytes) -> Callable[[], None]:
    def call() -> None:
        req, data = validation.validate(body, "application/json")
        encode_body(prefill_body(data, "bench", stream=req.is_stream))
        encode_body(decode_body(data, "bench", {"do_remote_prefill": True}))
    return call


def measure(prompt_lens: Sequence[int], calls: int, rounds: int) -> dict[str, Any]:
    calls = max(1, min(calls, _MAX_CALLS))
    validation = Validation(ProxySettings(prefill_urls=("http://127.0.0.1:1",),
                                          decode_urls=("http://127.0.0.1:2",)))
    report: dict[str, Any] = {"calls": calls, "rounds": rounds}
    for n in prompt_lens:
        for variant in ("client_text", "escaped"):
            call = one_call(validation, client_body(n, escaped=variant == "escaped"))
            report[f"{variant}_{n}_us_per_call"] = timed(call, calls, rounds)
    for tokens in (1, 32, 256):
        parse = functools.partial(parse_worker_json, worker_reply(tokens))
        report[f"reply_{tokens}_us_per_call"] = timed(parse, calls, rounds)
    return report


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.internals.body_cost",
                                description=__doc__.split("\n")[0])
    p.add_argument("--prompt-lens", default="128,2048,4096")
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args(argv)
    lens = [int(x) for x in a.prompt_lens.split(",") if x.strip()]
    if not lens or min(lens) < 1 or a.rounds < 1:
        p.error("--prompt-lens must be positive integers and --rounds at least 1")
    sys.stdout.write(json.dumps(measure(lens, a.calls, a.rounds)) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
