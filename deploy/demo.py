"""``make demo``: the short, self-ending version of ``make up``.

    python -m deploy.demo --model .cache/tiny-llama [--workers vllm|sim] [--requests 16]

Starts one real vLLM prefill worker and one decode worker on CPU (NixlConnector), pd-proxy in front of
them, sends one greedy request through the proxy and shows that its KV crossed from prefill to decode
(the decode worker's ``vllm:nixl_xfer_time_seconds_count`` goes up), runs a short pd-bench benchmark
through the proxy, prints its summary, the per-hop TTFT breakdown and where the plots, the Grafana
dashboards and the Prometheus scrape config are. Then it measures the first token from the prefill
worker: a second pd-proxy with ``--first-token-from-prefill off`` in front of the same workers, and the
same streams sent to both proxies in pairs with ``pd-bench compare`` (each stream to both proxies at
once, one pair at a time, so load on the host hits both alike; each proxy's requests with a
``cache_salt`` of their own, so neither is served from the prefix cache the other filled); it prints
TTFT and the second token's gap with the feature on and off side by side. Then it stops everything.
Exit status 0 only when the request went through the proxy, the KV crossed and neither benchmark had
a failure.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, Any, Final

from prometheus_client.parser import text_string_to_metric_families

from benchmarks import (
    BenchResult,
    CompareResult,
    RequestRecord,
    demo_config,
    run_benchmark,
    run_compare,
    summary_text,
)
from benchmarks.metrics import second_token_gaps, stats
from deploy import local
from deploy.targets import DASHBOARDS_DIR, SCRAPE_CONFIG

XFER_COUNT: Final = "vllm:nixl_xfer_time_seconds_count"
MISMATCH_COUNT: Final = "pd_proxy_first_token_mismatch_total"
LOCAL_PREFILL: Final = "pd_proxy_decode_local_prefill_tokens_total"
FAILED_PULLS: Final = "pd_proxy_decode_failed_pulls_total"
PROMPT_TOKENS_SEEN: Final = "pd_proxy_decode_prompt_tokens_total"
ALARM_INTERVAL: Final = 2.0
"""The demo proxy's --local-prefill-interval: its alarm has scraped D after the benchmark."""
PROMPT_TOKENS: Final = 200
MAX_TOKENS: Final = 16
FIRST_TOKEN_REQUESTS: Final = 12
MAX_FIRST_TOKEN_REQUESTS: Final = 200


def metric_sum(base_url: str, sample: str) -> float:
    """The sum of every series of one sample name on a worker's ``/metrics`` (0 when absent)."""
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=10) as resp:  # noqa: S310 (our own URL)
        text = resp.read().decode()
    return sum(
        s.value for family in text_string_to_metric_families(text) for s in family.samples if s.name == sample
    )


def generate(proxy_url: str, token_ids: Sequence[int]) -> tuple[dict[str, Any], dict[str, str]]:
    body = {
        "request_id": "demo-1",
        "token_ids": list(token_ids),
        "sampling_params": {"temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True},
    }
    req = urllib.request.Request(  # noqa: S310 (our own URL)
        f"{proxy_url}/inference/v1/generate",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(req, timeout=120) as resp:  # noqa: S310
        return json.loads(resp.read()), dict(resp.headers.items())


def demo_prompt(n: int = PROMPT_TOKENS) -> list[int]:
    """A fixed prompt of ``n`` ordinary token ids (3..514 are bytes and merges of the tiny model)."""
    return [3 + (i * 37) % 512 for i in range(n)]


CHAT_TEXT: Final = " ".join(
    ["The river ran past the old mill, and the miller counted his sacks of grain."] * 5)
"""About 140 tokens on the tiny model (470 on pd-sim's bytes): a prompt under one KV block would skip
the prefill hop."""


def chat(proxy_url: str) -> dict[str, Any]:
    body = {"messages": [{"role": "user", "content": CHAT_TEXT + " Tell me about the river."}],
            "max_tokens": MAX_TOKENS, "temperature": 0}
    req = urllib.request.Request(  # noqa: S310 (our own URL)
        f"{proxy_url}/v1/chat/completions", data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"}, method="POST",
    )
    with urllib.request.urlopen(req, timeout=120) as resp:  # noqa: S310
        answer: dict[str, Any] = json.loads(resp.read())
        return answer


def show_chat(stack: local.Stack, out: IO[str]) -> bool:
    """One greedy chat request through the split: rendered on D, prefilled on P, answered as OpenAI's."""
    decode = stack.info["decode"][0]
    before = metric_sum(decode, XFER_COUNT)
    answer = chat(stack.info["proxy"])
    after = metric_sum(decode, XFER_COUNT)
    choice, usage = answer["choices"][0], answer.get("usage") or {}
    print(f"\none chat request through pd-proxy (/v1/chat/completions, greedy, {MAX_TOKENS} out):", file=out)
    print(f"  id             {answer['id']}", file=out)
    print(f"  content        {choice['message']['content']!r}", file=out)
    print(f"  finish_reason  {choice['finish_reason']}  usage {usage.get('prompt_tokens')} prompt, "
          f"{usage.get('completion_tokens')} completion tokens", file=out)
    print(f"  KV crossed P->D over NIXL: {'yes' if after > before else 'NO'} "
          f"(decode {XFER_COUNT} {before:g} -> {after:g})", file=out, flush=True)
    return after > before


def show_request(stack: local.Stack, out: IO[str]) -> bool:
    proxy = stack.info["proxy"]
    decode = stack.info["decode"][0]
    before = metric_sum(decode, XFER_COUNT)
    reply, headers = generate(proxy, demo_prompt())
    after = metric_sum(decode, XFER_COUNT)
    choice = reply["choices"][0]
    crossed = after > before
    print(f"\none request through pd-proxy ({PROMPT_TOKENS} prompt tokens, greedy, {MAX_TOKENS} out):",
          file=out)  # fmt: skip
    print(f"  request_id     {reply['request_id']}", file=out)
    print(f"  token_ids      {choice['token_ids']}", file=out)
    print(f"  finish_reason  {choice['finish_reason']}", file=out)
    print(f"  Server-Timing  {headers.get('Server-Timing', '-')}", file=out)
    print(
        f"  KV crossed P->D over NIXL: {'yes' if crossed else 'NO'} "
        f"(decode {XFER_COUNT} {before:g} -> {after:g})",
        file=out,
        flush=True,
    )
    return crossed


@dataclass(frozen=True, slots=True)
class FirstTokenSide:
    """One setting of ``--first-token-from-prefill`` in the on/off comparison (times in ms)."""

    setting: str
    completed: int
    failed: int
    from_prefill: int
    """Streams whose first token came from the prefill worker (pd-proxy timed ``first_to_second``)."""
    ttft_p50: float | None
    ttft_p99: float | None
    second_p50: float | None
    second_p99: float | None
    first_to_second_p50: float | None
    first_to_second_p99: float | None
    prefill_p50: float | None
    e2e_p50: float | None


def second_token_gaps_ms(records: Sequence[RequestRecord]) -> list[float]:
    """The client's wait from its first token-bearing chunk to its second, per completed stream."""
    return [gap * 1000.0 for gap in second_token_gaps(records)]


def first_token_side(setting: str, result: BenchResult) -> FirstTokenSide:
    d = result.data
    gaps = stats(second_token_gaps_ms(result.records), (50.0, 99.0))
    ok = [r for r in result.records if r.success]
    return FirstTokenSide(
        setting=setting,
        completed=int(d.get("completed", 0)),
        failed=int(d.get("failed", 0)),
        from_prefill=sum(1 for r in ok if "first_to_second" in (r.server_timing or ())),
        ttft_p50=d.get("median_ttft_ms"),
        ttft_p99=d.get("p99_ttft_ms"),
        second_p50=None if gaps is None else gaps.percentiles[50.0],
        second_p99=None if gaps is None else gaps.percentiles[99.0],
        first_to_second_p50=d.get("median_hop_first_to_second_ms"),
        first_to_second_p99=d.get("p99_hop_first_to_second_ms"),
        prefill_p50=d.get("median_hop_prefill_ms"),
        e2e_p50=d.get("median_e2el_ms"),
    )  # fmt: skip


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def first_token_text(on: FirstTokenSide, off: FirstTokenSide, mismatches: float | None) -> str:
    """The side-by-side the demo prints: TTFT, the second token's gap and pd-proxy's stages, on and off."""
    rows: list[tuple[str, str, str]] = [
        ("TTFT p50", _ms(on.ttft_p50), _ms(off.ttft_p50)),
        ("TTFT p99", _ms(on.ttft_p99), _ms(off.ttft_p99)),
        ("2nd-token gap p50", _ms(on.second_p50), _ms(off.second_p50)),
        ("2nd-token gap p99", _ms(on.second_p99), _ms(off.second_p99)),
        ("first_to_second p50", _ms(on.first_to_second_p50), _ms(off.first_to_second_p50)),
        ("first_to_second p99", _ms(on.first_to_second_p99), _ms(off.first_to_second_p99)),
        ("prefill hop p50", _ms(on.prefill_p50), _ms(off.prefill_p50)),
        ("E2E p50", _ms(on.e2e_p50), _ms(off.e2e_p50)),
        ("first token from P", f"{on.from_prefill}/{on.completed}", f"{off.from_prefill}/{off.completed}"),
        ("failed", str(on.failed), str(off.failed)),
    ]
    n = max(on.completed, off.completed)
    lines = [f"  {'(ms)':<22}{on.setting:>10}{off.setting:>10}   (a p99 of {n} streams is about the slowest)"]
    lines += [f"  {name:<22}{a:>10}{b:>10}" for name, a, b in rows]
    if on.ttft_p50 is not None and off.ttft_p50 is not None and off.ttft_p50 > 0:
        lines.append(f"  TTFT p50 on - off: {on.ttft_p50 - off.ttft_p50:+.1f} ms "
                     f"(on is {on.ttft_p50 / off.ttft_p50:.2f}x off)")  # fmt: skip
    lines.append(f"  {MISMATCH_COUNT} (on): {'-' if mismatches is None else f'{mismatches:g}'}")
    return "\n".join(lines)


def alarm_text(proxy_url: str) -> str:
    """The local-prefill alarm's two counters once the proxy has scraped the decode worker after the
    benchmark (two of its intervals): both 0, with D's prompt tokens seen, when every hand-off's KV
    arrived."""
    time.sleep(2 * ALARM_INTERVAL + 0.5)
    seen, local_prefill, failed_pulls = (metric_sum(proxy_url, name)
                                         for name in (PROMPT_TOKENS_SEEN, LOCAL_PREFILL, FAILED_PULLS))
    verdict = ("ok, D pulled every prompt's KV" if seen > 0 and local_prefill == 0 == failed_pulls
               else "ALARM" if seen > 0 else "not scraped yet")
    return (f"decode worker prefilled itself? {LOCAL_PREFILL} {local_prefill:g}, "
            f"{FAILED_PULLS} {failed_pulls:g}, of {seen:g} prompt tokens seen on D ({verdict})")


def compare_first_token(stack: local.Stack, args: argparse.Namespace, out: IO[str]) -> int:
    """A second pd-proxy with the feature off in front of the same workers; the same streams through
    both in pairs (each stream to both at once, one pair at a time), each proxy with its own
    cache_salt. Returns the failures."""
    on_url = stack.info["proxy"]
    off_url = local.start_proxy(stack, local.free_port(), args.run_dir.absolute(),
                                ["--first-token-from-prefill", "off"], name="pd-proxy-first-token-off")
    n = args.first_token_requests
    print(f"\nfirst token from the prefill worker, on vs off (pd-proxy {on_url} and {off_url}):\n"
          f"  same workers; {n} streams each, in pairs (both proxies at once, one pair at a time), "
          "each proxy its own cache_salt",
          file=out, flush=True)  # fmt: skip
    load_before = os.getloadavg()[0]
    base = demo_config(on_url, result_dir=str(args.result_dir.absolute()), num_requests=n)
    cfg = replace(base, dataset=replace(base.dataset, seed=1), max_concurrency=1, salt_per_target=True,
                  label="demo-first-token")
    comparison: CompareResult = run_compare(cfg, [on_url, off_url], err=sys.stderr)
    on, off = (first_token_side(s, r) for s, r in zip(("on", "off"), comparison.results, strict=True))
    print(first_token_text(on, off, metric_sum(on_url, MISMATCH_COUNT)), file=out)
    print(f"  load average (1 min) before / after: {load_before:.1f} / {os.getloadavg()[0]:.1f} "
          f"on {os.cpu_count()} CPUs", file=out)  # fmt: skip
    for side, r in zip((on, off), comparison.results, strict=True):
        for key, path in r.files.items():
            print(f"{side.setting} {key}: {path}", file=out)
    for key, path in comparison.files.items():
        print(f"{key}: {path}", file=out)
    out.flush()
    return on.failed + off.failed


def _first_token_requests(text: str) -> int:
    value = int(text)
    if not 0 <= value <= MAX_FIRST_TOKEN_REQUESTS:
        raise argparse.ArgumentTypeError(f"0 (skip the comparison) to {MAX_FIRST_TOKEN_REQUESTS}")
    return value


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m deploy.demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=Path(".cache/tiny-llama"), help="the tiny model folder")
    p.add_argument("--workers", choices=("vllm", "sim"), default="vllm", help="real vLLM (default) or pd-sim")
    p.add_argument("--requests", type=int, default=16, help="benchmark requests")
    p.add_argument("--first-token-requests", type=_first_token_requests, default=FIRST_TOKEN_REQUESTS,
                   help="streams per setting in the first-token-from-prefill on/off comparison (0 skips it)")
    p.add_argument("--run-dir", type=Path, default=Path("run/demo"), help="logs of the workers and the proxy")
    p.add_argument("--result-dir", type=Path, default=Path("results/demo"), help="benchmark results, plots")
    ns = p.parse_args(argv)
    stack_args = local.parse_args(
        ["--workers", ns.workers, "--model", str(ns.model), "--run-dir", str(ns.run_dir), "--no-prometheus"]
    )
    for key, value in vars(stack_args).items():
        if not hasattr(ns, key):
            setattr(ns, key, value)
    return ns


def run(args: argparse.Namespace, out: IO[str] = sys.stdout) -> int:
    run_dir = args.run_dir.absolute()
    stack = local.Stack(info={"workers": args.workers, "run_dir": str(run_dir)})
    try:
        with local.interrupts_as_keyboard():
            print(f"demo: starting 1 prefill + 1 decode {args.workers} worker(s), logs in {run_dir / 'logs'}",
                  file=out, flush=True)  # fmt: skip
            if args.workers == "sim":
                local.start_sim_workers(stack, 1, 1, run_dir, tokens_only=False)
            else:
                local.start_vllm_workers(stack, args, run_dir)
            stack.info["proxy"] = local.start_proxy(
                stack, local.free_port(), run_dir,
                ["--first-token-from-prefill", "on",  # the default
                 "--local-prefill-interval", str(ALARM_INTERVAL)])
            print(f"demo: prefill {stack.info['prefill'][0]}  decode {stack.info['decode'][0]}  "
                  f"pd-proxy {stack.info['proxy']}", file=out, flush=True)  # fmt: skip
            crossed = show_request(stack, out) and show_chat(stack, out)
            print(f"\na short pd-bench run through pd-proxy ({args.requests} requests):",
                  file=out, flush=True)  # fmt: skip
            result = run_benchmark(
                demo_config(stack.info["proxy"], result_dir=str(args.result_dir.absolute()),
                            num_requests=args.requests),
                err=sys.stderr,
            )
            print(summary_text(result), file=out, flush=True)
            print(alarm_text(stack.info["proxy"]), file=out, flush=True)
            failed = int(result.data.get("failed", 0))
            if args.first_token_requests > 0:
                failed += compare_first_token(stack, args, out)
            print(f"\nGrafana dashboards:        {DASHBOARDS_DIR}", file=out)
            print(f"Prometheus scrape config:  {SCRAPE_CONFIG}", file=out)
            print("The whole stack with Prometheus, until Ctrl-C: make up", file=out, flush=True)
            return 0 if crossed and failed == 0 else 1
    except KeyboardInterrupt:
        print("demo: interrupted", file=out, flush=True)
        return 130
    except local.StackError as exc:
        print(f"demo: {exc}", file=out, flush=True)
        return 1
    finally:
        with local.ignoring_stop_signals():
            stack.stop()
        print("demo: stopped; nothing left running", file=out, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
