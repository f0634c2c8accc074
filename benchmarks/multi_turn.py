"""``pd-bench --dataset-name multi-turn``: conversations whose turn k+1 carries turn k's answer.

Each conversation starts with one system prompt shared by all of them, then sends ``turns`` turns
of ``user_len`` new tokens; turn k+1 is sent only once turn k has answered, with that answer's token
ids (``benchmarks.conversations``). Every turn is streamed. The report gives, per turn index, TTFT
and E2E (p50, p99) and, when prefill workers are named, their prefix-cache hit rate over the run:
the growth of vLLM's ``vllm:prefix_cache_hits`` over ``vllm:prefix_cache_queries`` (tokens) between
a scrape of each worker's ``/metrics`` before and after the run (pd-sim exposes the same counters).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Final

import aiohttp

from benchmarks.client import GENERATE_PATH, endpoint, new_session
from benchmarks.conversations import TurnRecord, run_conversations
from benchmarks.datasets import DEFAULT_VOCAB_MAX, DEFAULT_VOCAB_MIN, multi_turn_dataset
from benchmarks.metrics import stats
from benchmarks.report import json_safe, safe_stem
from benchmarks.runner import ConfigError

MULTI_TURN: Final = "multi-turn"
PREFIX_QUERIES: Final = "vllm:prefix_cache_queries"
PREFIX_HITS: Final = "vllm:prefix_cache_hits"
SCRAPE_TIMEOUT_S: Final = 10.0
DEFAULT_TURN_INPUT_LEN: Final = 64
DEFAULT_OUTPUT_LEN: Final = 64


@dataclass(frozen=True, slots=True)
class MultiTurnConfig:
    url: str
    conversations: int = 8
    turns: int = 4
    system_len: int = 256
    user_len: int = 64
    output_len: int = 64
    seed: int = 0
    max_concurrency: int | None = None
    """Turns in flight at once (None: one per conversation)."""
    request_timeout_s: float = 300.0
    api_key: str | None = None
    prefill_workers: tuple[str, ...] = ()
    vocab_min: int = DEFAULT_VOCAB_MIN
    vocab_max: int = DEFAULT_VOCAB_MAX
    result_dir: str | None = None
    result_filename: str | None = None
    label: str | None = None


def prefix_counters(text: str) -> dict[str, float]:
    """The prefix-cache query and hit counters (tokens) of one ``/metrics`` page, summed over labels."""
    from prometheus_client.parser import text_string_to_metric_families  # noqa: PLC0415

    out = {PREFIX_QUERIES: 0.0, PREFIX_HITS: 0.0}
    for family in text_string_to_metric_families(text):
        if family.name in out:
            out[family.name] += sum(s.value for s in family.samples if s.name == f"{family.name}_total")
    return out


async def scrape_prefix(session: aiohttp.ClientSession, url: str) -> dict[str, float] | None:
    """One worker's counters; None when it does not answer 200 (no hit rate is made up for it)."""
    try:
        timeout = aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT_S)
        async with session.get(f"{url.rstrip('/')}/metrics", timeout=timeout) as r:
            if r.status != 200:
                return None
            return prefix_counters(await r.text())
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return None


def hit_rate(before: Mapping[str, float] | None, after: Mapping[str, float] | None) -> dict[str, Any]:
    """Prompt tokens looked up and found in the prefix cache between two scrapes, and their ratio."""
    if before is None or after is None:
        return {"queries": None, "hits": None, "hit_rate": None}
    queries = after[PREFIX_QUERIES] - before[PREFIX_QUERIES]
    hits = after[PREFIX_HITS] - before[PREFIX_HITS]
    return {"queries": queries, "hits": hits, "hit_rate": hits / queries if queries > 0 else None}


def _ms(v: float | None) -> float | None:
    return None if v is None else v * 1000.0


def per_turn(records: Sequence[TurnRecord], turns: int) -> list[dict[str, Any]]:
    """Per turn index: how many were sent, answered and failed, and TTFT / E2E p50 and p99 (ms) of
    the answered ones."""
    out = []
    for t in range(turns):
        of_turn = [r for r in records if r.turn == t]
        ok = [r for r in of_turn if r.success]
        row: dict[str, Any] = {
            "turn": t,
            "sent": sum(r.sent for r in of_turn),
            "completed": len(ok),
            "failed": sum(r.sent and not r.success for r in of_turn),
            "mean_prompt_tokens": sum(len(r.prompt) for r in ok) / len(ok) if ok else None,
        }
        for name, values in (("ttft", [r.ttft_s for r in ok]), ("e2el", [r.e2e_s for r in ok])):
            st = stats([v * 1000.0 for v in values if v is not None], (50.0, 99.0))
            row[f"p50_{name}_ms"] = None if st is None else st.percentiles[50.0]
            row[f"p99_{name}_ms"] = None if st is None else st.percentiles[99.0]
        out.append(row)
    return out


async def arun_multi_turn(cfg: MultiTurnConfig) -> dict[str, Any]:
    """Run the conversations against ``cfg.url``; the result document (also written to
    ``cfg.result_dir`` when given)."""
    convs = multi_turn_dataset(cfg.conversations, cfg.turns, cfg.user_len, cfg.output_len,
                               system_len=cfg.system_len, seed=cfg.seed, vocab_min=cfg.vocab_min,
                               vocab_max=cfg.vocab_max)
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    started = dt.datetime.now(dt.UTC)
    async with new_session() as session:
        before = await asyncio.gather(*(scrape_prefix(session, u) for u in cfg.prefill_workers))
        t0 = time.perf_counter()
        records = await run_conversations(session, endpoint(cfg.url), convs,
                                          max_concurrency=cfg.max_concurrency or cfg.conversations,
                                          request_timeout_s=cfg.request_timeout_s, headers=headers)
        duration = time.perf_counter() - t0
        after = await asyncio.gather(*(scrape_prefix(session, u) for u in cfg.prefill_workers))
    workers = {u: hit_rate(b, a) for u, b, a in zip(cfg.prefill_workers, before, after, strict=True)}
    answered = [w for w in workers.values() if w["queries"] is not None]
    queries = sum(w["queries"] for w in answered)
    hits = sum(w["hits"] for w in answered)
    result: dict[str, Any] = {
        "dataset": MULTI_TURN,
        "date": started.strftime("%Y%m%d-%H%M%S"),
        "config": {k: v for k, v in asdict(cfg).items() if k != "api_key"},
        "duration_s": duration,
        "completed": sum(r.success for r in records),
        "failed": sum(r.sent and not r.success for r in records),
        "not_sent": sum(not r.sent for r in records),
        "errors": sorted({r.error for r in records if r.error})[:5],
        "per_turn": per_turn(records, cfg.turns),
        "prefix_cache": {
            "workers": workers,
            "queries": queries if answered else None,
            "hits": hits if answered else None,
            "hit_rate": hits / queries if answered and queries > 0 else None,
        },
        "turns": [
            {"conversation": r.conversation, "turn": r.turn, "prompt_tokens": len(r.prompt),
             "answer_tokens": len(r.answer), "sent": r.sent, "success": r.success, "error": r.error,
             "start_ms": r.start_s * 1000.0, "ttft_ms": _ms(r.ttft_s), "e2el_ms": _ms(r.e2e_s)}
            for r in records
        ],
    }
    result = json_safe(result)
    if cfg.result_dir:
        name = cfg.result_filename or f"{safe_stem(cfg.label or MULTI_TURN)}-{result['date']}.json"
        path = Path(cfg.result_dir) / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")
        result["result_file"] = str(path)
    return result


def run_multi_turn(cfg: MultiTurnConfig) -> dict[str, Any]:
    return asyncio.run(arun_multi_turn(cfg))


def _f(v: Any, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def summary(result: Mapping[str, Any]) -> str:
    """The per-turn table and the prefix-cache line, as pd-bench prints them."""
    c = result["config"]
    lines = [
        f"pd-bench multi-turn: {c['conversations']} conversations x {c['turns']} turns, shared system "
        f"prompt {c['system_len']} tokens, {c['user_len']} new user tokens and {c['output_len']} output "
        f"tokens a turn",
        f"completed {result['completed']}, failed {result['failed']}, not sent {result['not_sent']} "
        f"in {result['duration_s']:.2f} s",
        "",
        "| turn | completed | prompt tokens | TTFT p50 | TTFT p99 | E2E p50 | E2E p99 |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in result["per_turn"]:
        lines.append(
            f"| {row['turn']} | {row['completed']}/{row['sent']} | {_f(row['mean_prompt_tokens'], '.0f')} | "
            f"{_f(row['p50_ttft_ms'])} | {_f(row['p99_ttft_ms'])} | {_f(row['p50_e2el_ms'])} | "
            f"{_f(row['p99_e2el_ms'])} |"
        )
    lines.append("(ms)")
    cache = result["prefix_cache"]
    if cache["workers"]:
        rate = cache["hit_rate"]
        lines.append(f"prefill workers' prefix-cache hit rate over the run: "
                     f"{'-' if rate is None else f'{rate:.1%}'} ({_f(cache['hits'], '.0f')} of "
                     f"{_f(cache['queries'], '.0f')} prompt tokens)")
        lines += [f"  {u}: no /metrics answer" for u, w in cache["workers"].items() if w["queries"] is None]
    for err in result["errors"]:
        lines.append(f"error: {err}")
    if result.get("result_file"):
        lines.append(f"wrote {result['result_file']}")
    return "\n".join(lines)


def add_multi_turn_options(p: argparse.ArgumentParser) -> None:
    """pd-bench's ``multi-turn dataset options`` group."""
    m = p.add_argument_group(
        "multi-turn dataset options",
        "Conversations after one shared system prompt; turn k+1 is sent once turn k answered, with "
        "that answer's tokens (streamed; output length from --output-len).",
    )
    m.add_argument("--num-conversations", type=int, default=8, help="multi-turn: conversations")
    m.add_argument("--num-turns", type=int, default=4, help="multi-turn: turns per conversation")
    m.add_argument("--system-prompt-len", type=int, default=256,
                   help="multi-turn: tokens of the system prompt every conversation starts with")
    m.add_argument("--turn-input-len", type=int, default=None,
                   help="multi-turn: new user tokens per turn (default --input-len, else 64)")
    m.add_argument("--prefill-workers", nargs="+", action="extend", default=[], metavar="URL",
                   help="multi-turn: prefill workers (pd-sim or vLLM) whose /metrics prefix-cache "
                        "counters give the run's hit rate")


# Options the multi-turn driver does not take: given with it, they would be silently ignored.
MULTI_TURN_REFUSED: Final = (
    ("request_rate", None, "--request-rate"), ("dataset_path", None, "--dataset-path"),
    ("two_hop", None, "--two-hop"), ("cancel_rate", 0.0, "--cancel-rate"),
    ("cancel_at", None, "--cancel-at"), ("cancel_after", None, "--cancel-after"),
    ("stream", True, "--no-stream"), ("num_warmups", 0, "--num-warmups"),
    ("endpoint", GENERATE_PATH, "--endpoint"), ("output_mode", "tokens", "--output-mode"),
)


def multi_turn_config(args: argparse.Namespace) -> MultiTurnConfig:
    given = [flag for dest, default, flag in MULTI_TURN_REFUSED if getattr(args, dest, default) != default]
    if given:
        raise ConfigError(f"--dataset-name multi-turn does not take {', '.join(given)}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ConfigError("--max-concurrency must be at least 1")
    if args.request_timeout <= 0:
        raise ConfigError("--request-timeout must be positive")
    return MultiTurnConfig(
        url=args.url or f"http://{args.host}:{args.port}",
        conversations=args.num_conversations,
        turns=args.num_turns,
        system_len=args.system_prompt_len,
        user_len=args.turn_input_len or args.input_len or DEFAULT_TURN_INPUT_LEN,
        output_len=args.output_len or args.random_output_len or DEFAULT_OUTPUT_LEN,
        seed=args.seed,
        max_concurrency=args.max_concurrency,
        request_timeout_s=args.request_timeout,
        api_key=args.api_key,
        prefill_workers=tuple(args.prefill_workers),
        vocab_min=args.vocab_min,
        vocab_max=args.vocab_max,
        result_dir=args.result_dir,
        result_filename=args.result_filename,
        label=args.label,
    )
