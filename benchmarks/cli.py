"""``pd-bench run | sweep | compare``."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence

from benchmarks.datasets import DATASETS, DatasetConfig, DatasetError
from benchmarks.metrics import GoodputSpecError, parse_goodput
from benchmarks.runner import BenchConfig, ConfigError, run_benchmark, run_compare, run_sweep, summary_text


def _floats(text: str) -> list[float]:
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers: {text!r}") from None
    if not vals:
        raise argparse.ArgumentTypeError("expected at least one number")
    return vals


def _ints(text: str) -> list[int]:
    vals = _floats(text)
    if any(v != int(v) or v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers: {text!r}")
    return [int(v) for v in vals]


def _common(p: argparse.ArgumentParser, url_multi: bool = False) -> None:
    if url_multi:
        p.add_argument("--url", action="append", required=True, help="a target (give exactly two)")
    else:
        p.add_argument("--url", required=True, help="base URL (http://host:port) or the full generate URL")
    p.add_argument("--api-key", default=None, help="sent as Authorization: Bearer KEY")
    d = p.add_argument_group("dataset")
    d.add_argument("--dataset", choices=DATASETS, default="random")
    d.add_argument(
        "--dataset-path", default=None, help="file for lengths-file (JSON/JSONL pairs) or trace (JSONL)"
    )
    d.add_argument("--input-len", type=int, default=256, help="prompt tokens (shared-prefix: suffix tokens)")
    d.add_argument("--output-len", type=int, default=64, help="output tokens (exact: ignore_eos)")
    d.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in len*(1±ratio)")
    d.add_argument("--num-requests", type=int, default=100)
    d.add_argument("--num-prefixes", type=int, default=4, help="shared-prefix: distinct prefixes")
    d.add_argument("--prefix-len", type=int, default=128, help="shared-prefix: prefix tokens")
    d.add_argument("--vocab-min", type=int, default=3)
    d.add_argument("--vocab-max", type=int, default=514)
    d.add_argument("--trace-time-unit", choices=("s", "ms"), default="s")
    d.add_argument("--trace-speedup", type=float, default=1.0)
    d.add_argument("--trace-block-size", type=int, default=512, help="trace hash_ids: tokens per block")
    d.add_argument("--seed", type=int, default=0)
    r = p.add_argument_group("request")
    r.add_argument("--output-mode", choices=("tokens", "text"), default="tokens")
    r.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True)
    r.add_argument(
        "--server-timing",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="send X-PD-Timing: 1 and join pd-proxy's per-hop timings",
    )
    r.add_argument("--request-timeout", type=float, default=300.0, help="seconds per request")
    lo = p.add_argument_group("load")
    lo.add_argument("--burstiness", type=float, default=1.0, help="1 Poisson, <1 burstier, >1 more regular")
    lo.add_argument("--warmup", type=int, default=0, help="uncounted requests sent one by one first")
    lo.add_argument("--time-limit", type=float, default=None, help="stop sending after this many seconds")
    o = p.add_argument_group("output")
    o.add_argument("--goodput", default=None, help="SLOs in ms, e.g. ttft:500,tpot:50,e2el:2000")
    o.add_argument("--percentiles", type=_floats, default=[50.0, 90.0, 95.0, 99.0])
    o.add_argument("--result-dir", default=None, help="write the result JSON, JSONL and PNG plots here")
    o.add_argument("--label", default=None)
    o.add_argument(
        "--save-detailed", action="store_true", help="per-request lists in the JSON too (like vllm)"
    )
    o.add_argument("--no-plots", action="store_true")
    o.add_argument("--no-progress", action="store_true")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pd-bench", description="TTFT/ITL benchmark for /inference/v1/generate"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="one benchmark")
    _common(run)
    g = run.add_mutually_exclusive_group()
    g.add_argument("--request-rate", type=float, default=None, help="requests/s (default: all at once)")
    g.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    sweep = sub.add_parser("sweep", help="one run per request rate or per concurrency")
    _common(sweep)
    g2 = sweep.add_mutually_exclusive_group(required=True)
    g2.add_argument("--request-rates", type=_floats, default=None, help="e.g. 1,2,4,8")
    g2.add_argument("--concurrencies", type=_ints, default=None, help="e.g. 1,2,4,8")
    sweep.add_argument("--max-concurrency", type=int, default=None, help="cap in flight during a rate sweep")
    sweep.add_argument(
        "--request-rate", type=float, default=None, help="arrival rate during a concurrency sweep"
    )
    cmp_ = sub.add_parser("compare", help="two targets, requests interleaved, with ratios")
    _common(cmp_, url_multi=True)
    g3 = cmp_.add_mutually_exclusive_group()
    g3.add_argument("--request-rate", type=float, default=None, help="requests/s per target")
    g3.add_argument("--max-concurrency", type=int, default=None, help="in flight per target")
    return parser


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    ds = DatasetConfig(
        name=args.dataset,
        num_requests=args.num_requests,
        input_len=args.input_len,
        output_len=args.output_len,
        range_ratio=args.range_ratio,
        seed=args.seed,
        vocab_min=args.vocab_min,
        vocab_max=args.vocab_max,
        num_prefixes=args.num_prefixes,
        prefix_len=args.prefix_len,
        path=args.dataset_path,
        trace_time_unit=args.trace_time_unit,
        trace_speedup=args.trace_speedup,
        trace_block_size=args.trace_block_size,
    )
    url = args.url[0] if isinstance(args.url, list) else args.url
    rate = getattr(args, "request_rate", None)
    return BenchConfig(
        url=url,
        dataset=ds,
        api_key=args.api_key,
        request_rate=math.inf if rate is None else rate,
        burstiness=args.burstiness,
        max_concurrency=getattr(args, "max_concurrency", None),
        stream=args.stream,
        output_mode=args.output_mode,
        goodput_ms=parse_goodput(args.goodput),
        percentiles=tuple(args.percentiles),
        warmup=args.warmup,
        time_limit_s=args.time_limit,
        request_timeout_s=args.request_timeout,
        server_timing=args.server_timing,
        result_dir=args.result_dir,
        label=args.label,
        save_detailed=args.save_detailed,
        plots=not args.no_plots,
        progress=not args.no_progress,
    )


def _has_matplotlib() -> bool:
    """Whether the plots can be drawn (matplotlib is imported only then: the bench extra has it)."""
    try:
        import matplotlib  # noqa: F401, PLC0415
    except ImportError:
        return False
    return True


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        cfg = config_from_args(args)
        if cfg.plots and cfg.result_dir and not _has_matplotlib():
            raise ConfigError("the PNG plots need matplotlib: pip install 'pd-proxy[bench]', or --no-plots")
        if args.command == "run":
            print(summary_text(run_benchmark(cfg)))
        elif args.command == "sweep":
            print(
                summary_text(
                    run_sweep(cfg, rates=args.request_rates or (), concurrencies=args.concurrencies or ())
                )
            )
        else:
            print(summary_text(run_compare(cfg, args.url)))
    except (ConfigError, DatasetError, GoodputSpecError) as exc:
        parser.error(str(exc))
    except KeyboardInterrupt:
        print("pd-bench: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
