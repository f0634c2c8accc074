"""``python -m workers.demo --model DIR``: one real P/D hand-off on CPU, shown step by step.

Starts one prefill and one decode vLLM worker (:mod:`workers.launcher`), sends one prompt through a
manual hand-off (docs/vllm.md, section 3: the prefill hop with ``max_tokens: 1`` and
``kv_transfer_params: {"do_remote_decode": true}``, then the original request to the decode worker with
the ``kv_transfer_params`` the prefill worker returned), prints the generated token ids and shows that
the KV crossed (the decode worker's ``vllm:nixl_xfer_time_seconds_count`` before and after), then
stops the workers.

The pieces are separate so a later step can put the proxy in the path: :func:`manual_handoff` is one
implementation of a ``Generate`` callable (``(session, body, request_id) -> reply``); a proxy-backed
one (POST to the proxy) plugs into :func:`run_demo` unchanged, and a benchmark can follow it.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import sys
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import aiohttp
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families
from tokenizers import Tokenizer

from kv_transfer.handoff import prefill_params
from proxy.config.settings import ProxySettings
from proxy.http.app import build_app
from workers import model as tiny_model
from workers.launcher import Cluster, ClusterSettings, LaunchError, start_cluster

GENERATE_PATH: Final = "/inference/v1/generate"
XFER_COUNT: Final = "vllm:nixl_xfer_time_seconds_count"
DEMO_TEXT: Final = (
    "The quick brown fox jumps over the lazy dog while the pony ponders an apple by the river. "
    "When the morning came, the teacher and her friend walked to the garden to read a little book. "
    "After a long week at the office, the father told his child a story about the old city and its people. "
)
HTTP_TIMEOUT: Final = aiohttp.ClientTimeout(total=120)


class HandoffError(RuntimeError):
    """A hop answered with an error, or the prefill reply carried no ``kv_transfer_params``."""


@dataclass(frozen=True)
class Handoff:
    """The two replies of one manual P/D hand-off."""

    prefill_reply: dict[str, Any]
    decode_reply: dict[str, Any]

    @property
    def kv_transfer_params(self) -> dict[str, Any]:
        params: dict[str, Any] = self.prefill_reply["kv_transfer_params"]
        return params

    @property
    def token_ids(self) -> list[int]:
        ids: list[int] = self.decode_reply["choices"][0]["token_ids"]
        return ids


# A way to run one generate call end to end: manual hand-off now, the proxy later.
Generate = Callable[[aiohttp.ClientSession, Mapping[str, Any], str], Awaitable[dict[str, Any]]]


def prefill_body(body: Mapping[str, Any], request_id: str) -> dict[str, Any]:
    """The prefill hop of docs/vllm.md, section 3, derived from the client's request ``body``."""
    hop = copy.deepcopy(dict(body))
    sampling = dict(hop.get("sampling_params") or {})
    sampling["max_tokens"] = 1
    sampling.pop("min_tokens", None)
    hop["sampling_params"] = sampling
    hop.pop("stream_options", None)
    hop["stream"] = False
    hop["output_mode"] = "tokens"
    hop["request_id"] = request_id
    hop["kv_transfer_params"] = prefill_params()
    return hop


def decode_body(
    body: Mapping[str, Any], request_id: str, kv_transfer_params: Mapping[str, Any]
) -> dict[str, Any]:
    """The decode hop: the original request with the prefill worker's ``kv_transfer_params`` unchanged."""
    hop = copy.deepcopy(dict(body))
    hop["request_id"] = request_id
    hop["kv_transfer_params"] = dict(kv_transfer_params)
    return hop


async def post_generate(session: aiohttp.ClientSession, url: str, body: Mapping[str, Any]) -> dict[str, Any]:
    """A non-streaming ``POST {url}/inference/v1/generate``; errors raise :class:`HandoffError`."""
    async with session.post(f"{url}{GENERATE_PATH}", json=body, timeout=HTTP_TIMEOUT) as resp:
        text = await resp.text()
        if resp.status != 200:
            raise HandoffError(f"{url} answered {resp.status}: {text[:500]}")
    reply: dict[str, Any] = json.loads(text)
    return reply


async def manual_handoff(
    session: aiohttp.ClientSession,
    prefill_url: str,
    decode_url: str,
    body: Mapping[str, Any],
    request_id: str,
) -> Handoff:
    """Prefill hop, then decode hop with the returned ``kv_transfer_params`` (same request id on both).

    ``body`` must be non-streaming (this helper reads JSON replies).
    """
    if body.get("stream"):
        raise ValueError("manual_handoff reads JSON replies: send stream false")
    prefill_reply = await post_generate(session, prefill_url, prefill_body(body, request_id))
    params = prefill_reply.get("kv_transfer_params")
    if not isinstance(params, dict):
        raise HandoffError(f"prefill reply carried no kv_transfer_params (got {params!r})")
    decode_reply = await post_generate(session, decode_url, decode_body(body, request_id, params))
    return Handoff(prefill_reply=prefill_reply, decode_reply=decode_reply)


async def scrape_metric(session: aiohttp.ClientSession, url: str, sample: str) -> float:
    """Sum of a worker's samples named ``sample`` (0 when the series does not exist yet)."""
    async with session.get(f"{url}/metrics", timeout=HTTP_TIMEOUT) as resp:
        resp.raise_for_status()
        text = await resp.text()
    return float(
        sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples if s.name == sample)
    )


@dataclass(frozen=True)
class DemoResult:
    prompt_tokens: int
    handoff: Handoff
    xfer_before: float
    xfer_after: float

    @property
    def kv_crossed(self) -> bool:
        return self.xfer_after - self.xfer_before == 1


async def run_demo(cluster: Cluster, token_ids: Sequence[int], max_tokens: int = 16) -> DemoResult:
    """One greedy request through a manual hand-off on the cluster's first prefill and decode workers."""
    prefill_url, decode_url = cluster.prefill_urls[0], cluster.decode_urls[0]
    body = {"token_ids": list(token_ids), "sampling_params": {"temperature": 0, "max_tokens": max_tokens}}
    async with aiohttp.ClientSession() as session:
        before = await scrape_metric(session, decode_url, XFER_COUNT)
        handoff = await manual_handoff(session, prefill_url, decode_url, body, "pd-demo-0")
        after = await scrape_metric(session, decode_url, XFER_COUNT)
    return DemoResult(len(token_ids), handoff, before, after)


async def chat_through_proxy(cluster: Cluster, max_tokens: int = 16) -> tuple[dict[str, Any], float, float]:
    """One greedy chat request through pd-proxy (in this process, on a free loopback port) in front
    of the cluster: rendered on the decode worker, the P/D walk, answered in OpenAI's shape.
    Returns the answer and the decode worker's transfer count before and after."""
    app = build_app(
        ProxySettings(prefill_urls=tuple(cluster.prefill_urls), decode_urls=tuple(cluster.decode_urls))
    )
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = next(int(a[1]) for a in runner.addresses if isinstance(a, tuple))
    body = {
        "messages": [{"role": "user", "content": DEMO_TEXT[:200]}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    try:
        async with aiohttp.ClientSession() as session:
            decode_url = cluster.decode_urls[0]
            before = await scrape_metric(session, decode_url, XFER_COUNT)
            async with session.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body) as r:
                answer: dict[str, Any] = await r.json()
            after = await scrape_metric(session, decode_url, XFER_COUNT)
    finally:
        await runner.cleanup()
    return answer, before, after


def demo_prompt(model_dir: Path, target_tokens: int = 200) -> list[int]:
    """About ``target_tokens`` ids of English text, tokenized with the model's own tokenizer."""
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    ids: list[int] = []
    while len(ids) < target_tokens:
        ids += tokenizer.encode(DEMO_TEXT).ids
    return ids[:target_tokens]


def _report(result: DemoResult, model_dir: Path) -> None:
    params = result.handoff.kv_transfer_params
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    print(f"prompt: {result.prompt_tokens} tokens")
    print(
        f"prefill hop: KV held on {params['remote_host']}:{params['remote_port']}, "
        f"blocks {params['remote_block_ids']}, {params['remote_num_tokens']} tokens"
    )
    print(f"decode hop: token ids {result.handoff.token_ids}")
    print(f"decode hop: text {tokenizer.decode(result.handoff.token_ids)!r} (random weights: gibberish)")
    print(
        f"KV crossed: decode's {XFER_COUNT} went {result.xfer_before:g} -> {result.xfer_after:g}"
        f" ({'yes' if result.kv_crossed else 'NO'})"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workers.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="tiny model folder (built when missing)")
    parser.add_argument(
        "--vllm-bin", type=Path, help="vLLM executable (default: $PD_VLLM_VENV/bin/vllm, ...)"
    )
    parser.add_argument("--log-dir", type=Path, default=Path("run/demo-logs"))
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args(argv)

    if tiny_model.build_model(args.model).built:
        print(f"built the tiny model into {args.model}")
    settings = ClusterSettings(
        model=args.model, prefill=1, decode=1, vllm_bin=args.vllm_bin, log_dir=args.log_dir
    )
    print(f"starting 1 prefill + 1 decode vLLM worker on CPU (about a minute; logs in {args.log_dir}) ...")
    try:
        with start_cluster(settings) as cluster:
            print(
                f"ready in {cluster.startup_seconds:.0f} s: prefill {cluster.prefill_urls[0]}, "
                f"decode {cluster.decode_urls[0]}"
            )
            result = asyncio.run(run_demo(cluster, demo_prompt(args.model), args.max_tokens))
            _report(result, args.model)
            answer, before, after = asyncio.run(chat_through_proxy(cluster, args.max_tokens))
            print(f"chat through pd-proxy: {json.dumps(answer.get('choices', answer))[:300]}")
            print(
                f"chat through pd-proxy: KV crossed {before:g} -> {after:g}",
                "(yes)" if after > before else "(NO)",
            )
            rss = cluster.rss_bytes()
            print(
                "memory (RSS summed over each worker's process tree): "
                + ", ".join(f"{w.role} {rss[w.url] / 2**30:.2f} GiB" for w in cluster.workers)
            )
            print("stopping the workers")
    except (LaunchError, HandoffError, aiohttp.ClientError) as exc:
        print(f"demo failed: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted; workers stopped", file=sys.stderr)
        return 130
    return 0 if result.kv_crossed else 1


if __name__ == "__main__":
    sys.exit(main())
