"""``make demo``: the short, self-ending version of ``make up``.

    python -m deploy.demo --model .cache/tiny-llama [--workers vllm|sim] [--requests 16]

Starts one real vLLM prefill worker and one decode worker on CPU (NixlConnector), pd-proxy in front of
them, sends one greedy request through the proxy and shows that its KV crossed from prefill to decode
(the decode worker's ``vllm:nixl_xfer_time_seconds_count`` goes up), runs a short pd-bench benchmark
through the proxy, prints its summary, the per-hop TTFT breakdown and where the plots, the Grafana
dashboards and the Prometheus scrape config are, and stops everything. Exit status 0 only when the
request went through the proxy, the KV crossed and the benchmark had no failure.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any, Final

from prometheus_client.parser import text_string_to_metric_families

from benchmarks import demo_config, run_benchmark, summary_text
from deploy import local
from deploy.targets import DASHBOARDS_DIR, SCRAPE_CONFIG

XFER_COUNT: Final = "vllm:nixl_xfer_time_seconds_count"
PROMPT_TOKENS: Final = 200
MAX_TOKENS: Final = 16


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


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m deploy.demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=Path(".cache/tiny-llama"), help="the tiny model folder")
    p.add_argument("--workers", choices=("vllm", "sim"), default="vllm", help="real vLLM (default) or pd-sim")
    p.add_argument("--requests", type=int, default=16, help="benchmark requests")
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
            stack.info["proxy"] = local.start_proxy(stack, local.free_port(), run_dir, [])
            print(f"demo: prefill {stack.info['prefill'][0]}  decode {stack.info['decode'][0]}  "
                  f"pd-proxy {stack.info['proxy']}", file=out, flush=True)  # fmt: skip
            crossed = show_request(stack, out)
            print(f"\na short pd-bench run through pd-proxy ({args.requests} requests):",
                  file=out, flush=True)  # fmt: skip
            result = run_benchmark(
                demo_config(stack.info["proxy"], result_dir=str(args.result_dir.absolute()),
                            num_requests=args.requests),
                err=sys.stderr,
            )
            print(summary_text(result), file=out)
            print(f"\nGrafana dashboards:        {DASHBOARDS_DIR}", file=out)
            print(f"Prometheus scrape config:  {SCRAPE_CONFIG}", file=out)
            print("The whole stack with Prometheus, until Ctrl-C: make up", file=out, flush=True)
            failed = int(result.data.get("failed", 0))
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
