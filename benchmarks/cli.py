"""``pd-bench [run] | sweep | compare``: ``vllm bench serve``'s flags with vLLM's meanings.

``pd-bench`` alone (or ``pd-bench serve``) is ``pd-bench run``. The options follow
``vllm bench serve`` (names, meanings, the result JSON's keys); pd-bench's older spellings stay as
aliases (``--num-requests`` for ``--num-prompts``, ``--dataset`` for ``--dataset-name``, ``--url``
for ``--base-url``, ``--warmup`` for ``--num-warmups``, ``--percentiles`` for
``--metric-percentiles``, ``--no-progress`` for ``--disable-tqdm``, ``--range-ratio`` for
``--random-range-ratio``). Nothing heavy is imported to parse the command line: numpy, matplotlib
and tokenizers are loaded when a run needs them.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Final

from benchmarks.cancel import CANCEL_AT, CancelConfig
from benchmarks.client import CANCEL_MODES, GENERATE_PATH
from benchmarks.datasets import (
    DATASETS,
    DEFAULT_CUSTOM_OUTPUT_LEN,
    DEFAULT_VOCAB_MAX,
    DEFAULT_VOCAB_MIN,
    TEXT_DATASETS,
    DatasetConfig,
    DatasetError,
)
from benchmarks.loadgen import RAMP_UP_STRATEGIES
from benchmarks.metrics import LATENCY_METRICS, PERCENTILE_METRICS, GoodputSpecError, parse_goodput
from benchmarks.multi_turn import (
    MULTI_TURN,
    add_multi_turn_options,
    multi_turn_config,
    run_multi_turn,
    summary,
)
from benchmarks.runner import (
    DEFAULT_ID_PREFIX,
    BenchConfig,
    ConfigError,
    RampUp,
    TargetNotReady,
    run_benchmark,
    run_compare,
    run_sweep,
    summary_text,
)

COMMANDS: Final = ("run", "serve", "sweep", "compare")
DEFAULT_INPUT_LEN: Final = 256
DEFAULT_OUTPUT_LEN: Final = 64
DEFAULT_PERCENTILES: Final = "50,90,95,99"
HELP_EPILOG: Final = (
    "pd-bench sweep ... --concurrencies 1,2,4 | --request-rates 1,2,4: one run per load.  "
    "pd-bench compare --url A --url B ...: the same requests to two targets, interleaved.  "
    "`pd-bench sweep -h` and `pd-bench compare -h` list their options."
)


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


def _names(text: str) -> list[str]:
    vals = [x.strip() for x in text.split(",") if x.strip()]
    bad = [v for v in vals if v not in PERCENTILE_METRICS]
    if bad or not vals:
        raise argparse.ArgumentTypeError(
            f"unknown metric(s) {', '.join(bad) or '(none)'}; choose from {', '.join(PERCENTILE_METRICS)}"
        )
    return vals


def _fraction(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number within 0..1: {text!r}") from None
    if not 0.0 <= v <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number within 0..1: {text!r}")
    return v


def _pairs(items: Sequence[str] | None, what: str) -> tuple[tuple[str, str], ...]:
    """vLLM's KEY=VALUE lists (``--header``, ``--metadata``)."""
    out: list[tuple[str, str]] = []
    for item in items or ():
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"Invalid {what} format. Please use KEY=VALUE format.")
        out.append((key.strip(), value.strip()))
    return tuple(out)


def _vllm_options(p: argparse.ArgumentParser, url_multi: bool) -> None:
    """The options ``vllm bench serve`` has, in its order (its top-level group)."""
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-prompts", "--num-requests", dest="num_prompts", type=int, default=100,
                   help="Number of prompts to process.")
    p.add_argument("--dataset-name", "--dataset", dest="dataset_name", choices=(*DATASETS, MULTI_TURN),
                   default="random",
                   help="Name of the dataset to benchmark on (sharegpt and custom are text files, "
                        "tokenized with --tokenizer; shared-prefix, lengths-file, trace and multi-turn "
                        "are pd-bench's; multi-turn with `pd-bench run` only).")
    p.add_argument("--dataset-path", default=None,
                   help="Path to the sharegpt (JSON) or custom (JSONL) dataset, or a lengths-file/trace.")
    p.add_argument("--no-oversample", action="store_true",
                   help="Do not oversample if the dataset has fewer samples than num-prompts.")
    p.add_argument("--skip-chat-template", action="store_true",
                   help="Skip applying chat template to prompt for datasets that support it.")
    p.add_argument("--disable-shuffle", action="store_true",
                   help="Disable shuffling of dataset samples for deterministic ordering.")
    p.add_argument("--label", default=None, help="The label (prefix) of the benchmark results.")
    if url_multi:
        p.add_argument("--url", "--base-url", dest="url", action="append", required=True,
                       help="a target (give exactly two)")
    else:
        p.add_argument("--base-url", "--url", dest="url", default=None,
                       help="Server or API base url if not using http host and port "
                            "(the full generate URL works too).")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--endpoint", default=GENERATE_PATH,
                   help="API endpoint: the generate path, or /v1/chat/completions or /v1/completions "
                        "(vLLM's openai-chat and openai bench backends).")
    p.add_argument("--header", metavar="KEY=VALUE", nargs="*",
                   help="Key-value pairs (e.g, --header x-additional-info=0.3.3) for headers to be "
                        "passed with each request; pd-bench's own headers (request id, key) override them.")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="Maximum number of concurrent requests. With --request-rate requests arrive "
                        "at that rate and wait for a free slot (the realised rate may then be lower).")
    p.add_argument("--model", default=None,
                   help="Name of the model (recorded as model_id; a local model folder also serves "
                        "as the tokenizer).")
    p.add_argument("--input-len", type=int, default=None,
                   help=f"General input length for datasets. Maps to --random-input-len "
                        f"(default {DEFAULT_INPUT_LEN}).")
    p.add_argument("--output-len", type=int, default=None,
                   help="General output length for datasets. Maps to --random-output-len, "
                        "--sharegpt-output-len and --custom-output-len.")
    p.add_argument("--tokenizer", default=None,
                   help="A local folder with tokenizer.json (nothing is downloaded).")
    p.add_argument("--request-rate", type=float, default=None,
                   help="Number of requests per second. If this is inf (the default), then all the "
                        "requests are sent at time 0. Otherwise, we use Poisson process or gamma "
                        "distribution to synthesize the request arrival times.")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="Burstiness factor of the request generation (1: Poisson; below 1 burstier, "
                        "above 1 more regular).")
    p.add_argument("--disable-tqdm", "--no-progress", dest="disable_tqdm", action="store_true",
                   help="Specify to disable the progress bar.")
    p.add_argument("--num-warmups", "--warmup", dest="num_warmups", type=int, default=0,
                   help="Number of warmup requests (uncounted, at most --max-concurrency at a time).")
    p.add_argument("--save-result", action="store_true",
                   help="Specify to save benchmark results to a json file.")
    p.add_argument("--save-detailed", action="store_true",
                   help="When saving the results, whether to include per request information.")
    p.add_argument("--metadata", metavar="KEY=VALUE", nargs="*",
                   help="Key-value pairs (e.g, --metadata version=0.3.3 tp=1) for metadata of this run "
                        "to be saved in the result JSON file for record keeping purposes.")
    p.add_argument("--result-dir", default=None,
                   help="Directory for the result JSON (--save-result; default the current directory). "
                        "Given alone, pd-bench also writes the per-request JSONL and plots there.")
    p.add_argument("--result-filename", default=None,
                   help="The result JSON's file name (default "
                        "{label}-{request_rate}qps[-concurrency{N}]-{model}-{date}.json).")
    p.add_argument("--ignore-eos", action="store_true",
                   help="Set ignore_eos on every request (always on for pd-bench's synthetic datasets).")
    p.add_argument("--percentile-metrics", type=_names, default=list(LATENCY_METRICS),
                   help="Comma-separated list of selected metrics to report percentiles, out of "
                        f"{', '.join(PERCENTILE_METRICS)} (default {','.join(LATENCY_METRICS)}).")
    p.add_argument("--metric-percentiles", "--percentiles", dest="metric_percentiles", type=_floats,
                   default=_floats(DEFAULT_PERCENTILES),
                   help="Comma-separated list of percentiles for selected metrics "
                        f"(default {DEFAULT_PERCENTILES}).")
    p.add_argument("--goodput", nargs="+", default=None,
                   help='Specify service level objectives for goodput as "KEY:VALUE" pairs, where the '
                        "key is a metric name (ttft, tpot, e2el) and the value is in milliseconds, "
                        "separated by spaces (or commas).")
    p.add_argument("--request-id-prefix", default=DEFAULT_ID_PREFIX,
                   help="Specify the prefix of request id.")
    p.add_argument("--ramp-up-strategy", choices=RAMP_UP_STRATEGIES, default=None,
                   help="Ramp the request rate up from --ramp-up-start-rps to --ramp-up-end-rps over "
                        "the duration of the benchmark.")
    p.add_argument("--ramp-up-start-rps", type=int, default=None,
                   help="The starting request rate for ramp-up (RPS).")
    p.add_argument("--ramp-up-end-rps", type=int, default=None,
                   help="The ending request rate for ramp-up (RPS).")
    p.add_argument("--ready-check-timeout-sec", type=int, default=0,
                   help="Maximum time to wait for the endpoint to become ready in seconds. Ready "
                        "check will be skipped by default.")


def _dataset_groups(p: argparse.ArgumentParser) -> None:
    c = p.add_argument_group("custom dataset options")
    c.add_argument("--custom-output-len", type=int, default=None,
                   help=f"Number of output tokens per request (default {DEFAULT_CUSTOM_OUTPUT_LEN}); "
                        "-1: each row's output_tokens.")
    s = p.add_argument_group("sharegpt dataset options")
    s.add_argument("--sharegpt-output-len", type=int, default=None,
                   help="Output length for each request. Overrides the output length from the "
                        "ShareGPT dataset.")
    r = p.add_argument_group("random dataset options")
    r.add_argument("--random-input-len", type=int, default=None,
                   help=f"Number of input tokens per request (default {DEFAULT_INPUT_LEN}).")
    r.add_argument("--random-output-len", type=int, default=None,
                   help=f"Number of output tokens per request (default {DEFAULT_OUTPUT_LEN}).")
    r.add_argument("--random-range-ratio", "--range-ratio", dest="random_range_ratio", type=float,
                   default=0.0,
                   help="Range ratio for sampling input/output length: uniform in "
                        "[length * (1 - range_ratio), length * (1 + range_ratio)].")
    r.add_argument("--random-prefix-len", type=int, default=0,
                   help="Number of fixed prefix tokens before the random context in a request.")
    x = p.add_argument_group("pd-bench datasets (shared-prefix, lengths-file, trace)")
    x.add_argument("--num-prefixes", type=int, default=4, help="shared-prefix: distinct prefixes")
    x.add_argument("--prefix-len", type=int, default=128, help="shared-prefix: prefix tokens")
    x.add_argument("--vocab-min", type=int, default=DEFAULT_VOCAB_MIN, help="synthetic prompts' lowest id")
    x.add_argument("--vocab-max", type=int, default=DEFAULT_VOCAB_MAX, help="synthetic prompts' highest id")
    x.add_argument("--trace-time-unit", choices=("s", "ms"), default="s")
    x.add_argument("--trace-speedup", type=float, default=1.0)
    x.add_argument("--trace-block-size", type=int, default=512, help="trace hash_ids: tokens per block")
    add_multi_turn_options(p)


def _pd_bench_groups(p: argparse.ArgumentParser, single_target: bool) -> None:
    r = p.add_argument_group("pd-bench request options")
    r.add_argument("--api-key", default=None, help="sent as Authorization: Bearer KEY")
    r.add_argument("--output-mode", choices=("tokens", "text"), default="tokens")
    r.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True)
    r.add_argument("--server-timing", action=argparse.BooleanOptionalAction, default=True,
                   help="send X-PD-Timing: 1 and join pd-proxy's per-hop timings")
    r.add_argument("--request-timeout", type=float, default=300.0, help="seconds per request")
    r.add_argument("--time-limit", type=float, default=None, help="stop sending after this many seconds")
    r.add_argument("--no-plots", action="store_true", help="no PNG plots in --result-dir")
    if not single_target:
        return
    r.add_argument("--two-hop", nargs=2, metavar=("PREFILL_URL", "DECODE_URL"), default=None,
                   help="the two-hop floor: pd-bench sends the prefill hop and the decode hop itself "
                        "(no proxy), instead of --base-url")
    c = p.add_argument_group(
        "cancellation",
        "Cancel a share of the requests and measure what it costs: the other requests' TTFT against "
        "the same run without cancellations, and (with --kv-probe) how long workers keep the KV.",
    )
    c.add_argument("--cancel-rate", type=_fraction, default=0.0, metavar="FRACTION",
                   help="share of the requests to cancel (picked with --seed)")
    w = c.add_mutually_exclusive_group()
    w.add_argument("--cancel-at", choices=CANCEL_AT, default=None,
                   help="before-first-token: at a random moment before the request's expected first "
                        "token; mid-stream: after a random number of its output tokens; first-token: "
                        "as soon as its first token came")
    w.add_argument("--cancel-after", type=float, default=None, metavar="SECONDS",
                   help="cancel this long after the request was sent")
    c.add_argument("--cancel-mode", choices=CANCEL_MODES, default="disconnect",
                   help="disconnect: close the connection; abort: POST /inference/v1/abort_requests "
                        "with generate-tokens-<id>, then read the answer to its end")
    c.add_argument("--cancel-baseline", action=argparse.BooleanOptionalAction, default=True,
                   help="first run the same requests without cancellations (the TTFT penalty's reference)")
    c.add_argument("--abort-grace", type=float, default=5.0, metavar="SECONDS",
                   help="abort mode: hang up when the answer has not ended this long after the abort")
    k = p.add_argument_group("KV probes")
    k.add_argument("--kv-probe", nargs="+", action="extend", default=[], metavar="URL",
                   help="a worker to watch (its KV held after each cancel): pd-sim through /sim/state "
                        "(per request), vLLM through vllm:kv_cache_usage_perc in /metrics (the total)")
    k.add_argument("--kv-probe-interval", type=float, default=0.02, metavar="SECONDS")
    k.add_argument("--kv-free-timeout", type=float, default=60.0, metavar="SECONDS",
                   help="how long to watch the workers after the run for the KV to be freed")
    k.add_argument("--kv-settle", action="store_true",
                   help="before each request wait until the probed workers hold no more than when "
                        "idle (with --max-concurrency 1 every cancel is attributed from a total)")


def _parsers() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    parser = argparse.ArgumentParser(
        prog="pd-bench", description="TTFT/ITL benchmark for /inference/v1/generate", epilog=HELP_EPILOG
    )
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser(
        "run",
        aliases=["serve"],
        help="one benchmark (the default command: `pd-bench OPTIONS` is `pd-bench run OPTIONS`)",
        description="Benchmark online serving of POST /inference/v1/generate (vLLM, pd-sim or "
        "pd-proxy) with vllm bench serve's options. `pd-bench OPTIONS` is `pd-bench run OPTIONS`.",
        epilog=HELP_EPILOG,
    )
    _vllm_options(run, url_multi=False)
    _dataset_groups(run)
    _pd_bench_groups(run, single_target=True)
    sweep = sub.add_parser("sweep", help="one run per request rate or per concurrency")
    _vllm_options(sweep, url_multi=False)
    _dataset_groups(sweep)
    _pd_bench_groups(sweep, single_target=False)
    g2 = sweep.add_mutually_exclusive_group(required=True)
    g2.add_argument("--request-rates", type=_floats, default=None, help="e.g. 1,2,4,8")
    g2.add_argument("--concurrencies", type=_ints, default=None, help="e.g. 1,2,4,8")
    cmp_ = sub.add_parser("compare", help="two targets, requests interleaved, with ratios")
    _vllm_options(cmp_, url_multi=True)
    _dataset_groups(cmp_)
    _pd_bench_groups(cmp_, single_target=False)
    cmp_.add_argument("--salt-per-target", action="store_true",
                      help="each target sends its own vLLM cache_salt, so that targets sharing workers "
                           "(two proxies in front of one pool) get no prefix-cache hit from each other")
    return parser, {"run": run, "serve": run, "sweep": sweep, "compare": cmp_}


def build_parser() -> argparse.ArgumentParser:
    return _parsers()[0]


def _tokenizer_dir(args: argparse.Namespace) -> str | None:
    """--tokenizer, else --model when it is a local folder holding tokenizer.json (vLLM: the
    tokenizer defaults to the model)."""
    if args.tokenizer:
        return str(args.tokenizer)
    if args.model and (Path(args.model) / "tokenizer.json").is_file():
        return str(args.model)
    return None


def _dataset_from_args(args: argparse.Namespace, tokenizer: str | None) -> DatasetConfig:
    name = args.dataset_name
    input_len = args.input_len or args.random_input_len or DEFAULT_INPUT_LEN
    output_len = args.output_len or args.random_output_len or DEFAULT_OUTPUT_LEN
    custom_out = args.output_len or args.custom_output_len
    return DatasetConfig(
        name=name,
        num_requests=args.num_prompts,
        input_len=input_len,
        output_len=output_len,
        range_ratio=args.random_range_ratio,
        seed=args.seed,
        vocab_min=args.vocab_min,
        vocab_max=args.vocab_max,
        num_prefixes=args.num_prefixes,
        prefix_len=args.prefix_len,
        path=args.dataset_path,
        trace_time_unit=args.trace_time_unit,
        trace_speedup=args.trace_speedup,
        trace_block_size=args.trace_block_size,
        random_prefix_len=args.random_prefix_len,
        tokenizer_path=tokenizer,
        sharegpt_output_len=args.output_len or args.sharegpt_output_len,
        custom_output_len=DEFAULT_CUSTOM_OUTPUT_LEN if custom_out is None else custom_out,
        skip_chat_template=args.skip_chat_template,
        disable_shuffle=args.disable_shuffle,
        no_oversample=args.no_oversample,
    )


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    tokenizer = _tokenizer_dir(args)
    ds = _dataset_from_args(args, tokenizer)
    two_hop = getattr(args, "two_hop", None)
    if isinstance(args.url, list):
        url = args.url[0]
    elif two_hop:
        if args.url:
            raise ConfigError("--two-hop replaces --base-url: give one or the other")
        url = two_hop[1]
    else:
        url = args.url or f"http://{args.host}:{args.port}"
    ramp: RampUp | None = None
    if args.ramp_up_strategy is not None:
        if args.ramp_up_start_rps is None or args.ramp_up_end_rps is None:
            raise ConfigError(
                "When using --ramp-up-strategy, both --ramp-up-start-rps and --ramp-up-end-rps "
                "must be specified"
            )
        ramp = RampUp(args.ramp_up_strategy, float(args.ramp_up_start_rps), float(args.ramp_up_end_rps))
    elif args.ramp_up_start_rps is not None or args.ramp_up_end_rps is not None:
        raise ConfigError("--ramp-up-start-rps and --ramp-up-end-rps need --ramp-up-strategy")
    cancel: CancelConfig | None = None
    if getattr(args, "cancel_rate", 0.0) > 0 or getattr(args, "cancel_at", None) or (
        getattr(args, "cancel_after", None) is not None
    ):
        cancel = CancelConfig(
            rate=args.cancel_rate,
            at=args.cancel_at,
            after_s=args.cancel_after,
            mode=args.cancel_mode,
            baseline=args.cancel_baseline,
            abort_grace_s=args.abort_grace,
        )
    rate = args.request_rate
    return BenchConfig(
        url=url,
        dataset=ds,
        api_key=args.api_key,
        request_rate=math.inf if rate is None else rate,
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        stream=args.stream,
        output_mode=args.output_mode,
        goodput_ms=parse_goodput(args.goodput),
        percentiles=tuple(args.metric_percentiles),
        percentile_metrics=tuple(args.percentile_metrics),
        warmup=args.num_warmups,
        time_limit_s=args.time_limit,
        request_timeout_s=args.request_timeout,
        server_timing=args.server_timing,
        result_dir=args.result_dir,
        label=args.label,
        save_detailed=args.save_detailed,
        plots=not args.no_plots,
        progress=not args.disable_tqdm,
        endpoint_path=args.endpoint,
        headers=_pairs(args.header, "header"),
        ignore_eos=args.ignore_eos or ds.name not in TEXT_DATASETS,
        model_id=args.model,
        tokenizer_id=tokenizer or args.model,
        metadata=_pairs(args.metadata, "metadata"),
        ramp_up=ramp,
        ready_check_timeout_s=float(args.ready_check_timeout_sec),
        save_result=args.save_result,
        result_filename=args.result_filename,
        request_id_prefix=args.request_id_prefix,
        two_hop=(two_hop[0], two_hop[1]) if two_hop else None,
        cancel=cancel,
        kv_probes=tuple(getattr(args, "kv_probe", ()) or ()),
        kv_probe_interval_s=getattr(args, "kv_probe_interval", 0.02),
        kv_free_timeout_s=getattr(args, "kv_free_timeout", 60.0),
        kv_settle=getattr(args, "kv_settle", False),
        salt_per_target=getattr(args, "salt_per_target", False),
    )


def _has_matplotlib() -> bool:
    """Whether the plots can be drawn (matplotlib is imported only then: the bench extra has it)."""
    try:
        import matplotlib  # noqa: F401, PLC0415
    except ImportError:
        return False
    return True


def _argv(argv: Sequence[str] | None) -> list[str]:
    """``run`` is the default command: ``pd-bench --num-prompts 8 ...`` is ``pd-bench run ...``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in COMMANDS:
        return args
    return ["run", *args]


def main(argv: Sequence[str] | None = None) -> int:
    """``pd-bench``; ``pd-bench --help`` shows the run options, grouped as vLLM's."""
    parser, subs = _parsers()
    args = parser.parse_args(_argv(argv))
    command = "run" if args.command == "serve" else args.command
    sub = subs[args.command]
    try:
        if args.dataset_name == MULTI_TURN:
            if command != "run":
                raise ConfigError("--dataset-name multi-turn runs with `pd-bench run` only")
            print(summary(run_multi_turn(multi_turn_config(args))))
            return 0
        cfg = config_from_args(args)
        if cfg.plots and cfg.result_dir and not _has_matplotlib():
            raise ConfigError("the PNG plots need matplotlib: pip install 'pd-proxy[bench]', or --no-plots")
        if command == "run":
            print(summary_text(run_benchmark(cfg)))
        elif command == "sweep":
            print(
                summary_text(
                    run_sweep(cfg, rates=args.request_rates or (), concurrencies=args.concurrencies or ())
                )
            )
        else:
            print(summary_text(run_compare(cfg, args.url)))
    except (ConfigError, DatasetError, GoodputSpecError) as exc:
        sub.error(str(exc))
    except TargetNotReady as exc:
        print(f"pd-bench: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("pd-bench: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
