"""Result files (a JSON like vllm bench serve's, a JSONL of per-request records) and text tables."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

from benchmarks.metrics import LATENCY_METRICS, chunk_itls, percentile_word
from benchmarks.records import RequestRecord

METRIC_TITLES: Final = {
    "ttft": "TTFT",
    "tpot": "TPOT",
    "itl": "ITL (per chunk)",
    "itl_token": "ITL (per token)",
    "e2el": "E2E latency",
    "client_queue_time": "Client queue",
    "e2el_including_client_queue": "E2E + queue",
}
SECOND_TOKEN_GAP_TITLE: Final = "  2nd-token gap"  # noqa: S105 (a row title)
# Keys whose ratio target/baseline the compare mode reports.
COMPARE_KEYS: Final = (
    "median_ttft_ms",
    "p99_ttft_ms",
    "median_tpot_ms",
    "p99_tpot_ms",
    "median_itl_ms",
    "p99_itl_ms",
    "median_e2el_ms",
    "p99_e2el_ms",
    "request_throughput",
    "output_throughput",
    "failed",
)


def detailed_fields(records: Sequence[RequestRecord]) -> dict[str, Any]:
    """vllm's --save-detailed lists (seconds, one entry per request, failures included)."""
    return {
        "input_lens": [r.prompt_len for r in records],
        "output_lens": [r.output_tokens if r.success else 0 for r in records],
        "ttfts": [r.ttft_s if r.ttft_s is not None else 0.0 for r in records],
        "itls": [chunk_itls(r.chunk_times_s) for r in records],
        "latencies": [r.e2e_s if r.e2e_s is not None else 0.0 for r in records],
        "start_times": [r.start_s for r in records],
        "errors": [r.error or "" for r in records],
    }


def json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else "inf"
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


def safe_stem(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_") or "run"


def write_result(
    result_dir: str | Path,
    stem: str,
    data: dict[str, Any],
    records: Sequence[RequestRecord],
    *,
    json_too: bool = True,
) -> tuple[Path, Path]:
    """Write ``<stem>.json`` (unless not ``json_too``) and ``<stem>.jsonl``; returns both paths."""
    d = Path(result_dir)
    d.mkdir(parents=True, exist_ok=True)
    jpath = d / f"{stem}.json"
    lpath = d / f"{stem}.jsonl"
    if json_too:
        jpath.write_text(json.dumps(json_safe(data), indent=2) + "\n", encoding="utf-8")
    with lpath.open("w", encoding="utf-8") as fh:
        for r in records:
            fh.write(json.dumps(json_safe(r.to_json())) + "\n")
    return jpath, lpath


def _fmt(v: Any, digits: int = 2) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if math.isinf(v):
            return "inf"
        if math.isnan(v):
            return "nan"
        return f"{v:.{digits}f}"
    return str(v)


def summary_table(data: dict[str, Any], title: str = "pd-bench result") -> str:
    """The terminal summary of one result JSON."""
    lines: list[str] = [f"{' ' + title + ' ':=^72}"]

    def row(name: str, value: Any, digits: int = 2) -> None:
        lines.append(f"{name:<42}{_fmt(value, digits)}")

    row("Target:", data.get("base_url"))
    row("Successful requests:", data.get("completed"))
    row("Failed requests:", data.get("failed"))
    if "cancelled" in data:
        row("Cancelled requests:", data.get("cancelled"))
    fails = {k: v for k, v in (data.get("failures") or {}).items() if v}
    if fails:
        row("  by kind:", ", ".join(f"{k} {v}" for k, v in fails.items()))
    if data.get("max_concurrency") is not None:
        row("Maximum request concurrency:", data.get("max_concurrency"))
    row("Request rate configured (RPS):", data.get("request_rate"))
    row("Benchmark duration (s):", data.get("duration"))
    row("Total input tokens:", data.get("total_input_tokens"))
    row("Total generated tokens:", data.get("total_output_tokens"))
    row("Request throughput (req/s):", data.get("request_throughput"))
    if data.get("request_goodput") is not None:
        row("Request goodput (req/s):", data.get("request_goodput"))
    row("Output token throughput (tok/s):", data.get("output_throughput"))
    row("Peak output token throughput (tok/s):", data.get("max_output_tokens_per_s"))
    row("Peak concurrent requests:", data.get("max_concurrent_requests"))
    row("Total token throughput (tok/s):", data.get("total_token_throughput"))
    util = data.get("client_cpu_utilization")
    if isinstance(util, float) and util > 0.8:
        row("WARNING: pd-bench CPU busy (fraction):", util)
        lines.append("  the client may be the bottleneck: its timings run late; use fewer requests in flight")
    if data.get("num_output_len_mismatch"):
        row("Outputs not of the asked length:", data.get("num_output_len_mismatch"))
    pct = [percentile_word(p) for p in data.get("percentiles", [])]
    names = [(METRIC_TITLES[m], m) for m in data.get("percentile_metrics") or LATENCY_METRICS]
    if data.get("median_second_token_gap_ms") is not None:
        # Beside TTFT: with the first token from P the second waits for the KV pull, and the
        # TTFT win is paid here.
        at = next((i + 1 for i, (_, m) in enumerate(names) if m == "ttft"), 0)
        names.insert(at, (SECOND_TOKEN_GAP_TITLE, "second_token_gap"))
    for hop in data.get("hops") or []:
        names.append((f"  hop {hop}", f"hop_{hop}"))
    if data.get("hops"):
        names.append(("  TTFT unattrib.", "ttft_unattributed"))
    width = max(17, *(len(t) + 1 for t, _ in names))  # "  hop first_to_second" is longer than 17
    head = f"{'(ms)':<{width}}{'mean':>9}{'median':>9}{'std':>9}" + "".join(f"{'p' + p:>9}" for p in pct)
    lines.append("-" * 72)
    lines.append(head)
    for title_, key in names:
        vals = [data.get(f"{s}_{key}_ms") for s in ("mean", "median", "std")]
        vals += [data.get(f"p{p}_{key}_ms") for p in pct]
        lines.append(f"{title_:<{width}}" + "".join(f"{_fmt(v):>9}" for v in vals))
    if "cancelled" in data:
        lines.extend(_cancel_lines(data))
    lines.append("=" * 72)
    return "\n".join(lines)


def _cancel_lines(data: dict[str, Any]) -> list[str]:
    """Cancellation, the survivors' TTFT penalty, the workers' KV after the cancels."""
    lines: list[str] = [f"{' cancellation ':-^72}"]
    at = data.get("cancel_at") or f"after {data.get('cancel_after_s')} s"
    lines.append(f"{'Cancelled:':<42}{data.get('cancelled')} ({at}, {data.get('cancel_mode')})")
    phases = data.get("cancel_phases") or {}
    lines.append(
        f"{'  landed before first token / mid-stream:':<42}"
        f"{phases.get('before_first_token', 0)} / {phases.get('mid_stream', 0)}"
    )
    if data.get("abort_calls"):
        lines.append(
            f"{'  abort calls answered 200:':<42}{data.get('abort_calls_ok')} of {data.get('abort_calls')}"
        )
        lines.append(f"{'  abort to end of answer, median (ms):':<42}{_fmt(data.get('median_abort_ack_ms'))}")
        lines.append(f"{'  answers run to their end all the same:':<42}{data.get('aborts_run_out')}")
    if "ttft_penalty_median_ms" in data:
        lines.append(
            f"{'Survivors compared with the baseline:':<42}{data.get('survivors_compared')}"
        )
        for p in [*(percentile_word(x) for x in data.get("percentiles", []))]:
            key = f"ttft_penalty_p{p}_ms"
            if key in data:
                lines.append(
                    f"{'  TTFT p' + p + ' baseline -> penalty (ms):':<42}"
                    f"{_fmt(data.get(f'baseline_p{p}_ttft_ms'))} -> {_fmt(data.get(key))}"
                )
        paired = _fmt(data.get("ttft_penalty_mean_paired_ms"))
        lines.append(f"{'  TTFT penalty, mean of pairs (ms):':<42}{paired}")
    for probe in data.get("kv_probes") or []:
        lines.append(f"KV on {probe['url']} ({probe['source']}, {probe['unit']}):")
        lines.append(
            f"{'  cancels holding KV / attributed:':<42}"
            f"{probe['cancels_holding']} / {probe['cancels_attributed']} of {probe['cancels']}"
        )
        lines.append(
            f"{'  cancel-to-free median / max (ms):':<42}"
            f"{_fmt(probe.get('median_cancel_to_free_ms'))} / {_fmt(probe.get('cancel_to_free_max_ms'))}"
        )
        lines.append(f"{'  not freed when watching stopped:':<42}{probe['not_freed']}")
        lines.append(f"{'  stranded block-seconds (all cancels):':<42}{_fmt(probe['stranded_block_s'], 3)}")
        lines.append(
            f"{'  drain after the last request (s):':<42}{_fmt(probe['drain_s'], 3)}"
            f" ({_fmt(probe['drain_block_s'], 3)} block-s)"
        )
    return lines


def ratio(a: Any, b: Any) -> float | None:
    if not isinstance(a, int | float) or not isinstance(b, int | float) or a == 0:
        return None
    return float(b) / float(a)


def compare_ratios(baseline: dict[str, Any], other: dict[str, Any]) -> dict[str, float | None]:
    """other / baseline for each of COMPARE_KEYS."""
    return {k: ratio(baseline.get(k), other.get(k)) for k in COMPARE_KEYS}


def compare_table(urls: Sequence[str], results: Sequence[dict[str, Any]]) -> str:
    base = results[0]
    lines = [f"{' pd-bench compare ':=^72}"]
    lines.append(
        f"{'metric':<20}" + "".join(f"{'target ' + str(i):>14}" for i in range(len(urls))) + f"{'ratio':>10}"
    )
    for i, u in enumerate(urls):
        lines.append(f"  target {i}: {u}")
    for k in COMPARE_KEYS:
        vals = [r.get(k) for r in results]
        rt = [ratio(base.get(k), r.get(k)) for r in results[1:]]
        lines.append(
            f"{k:<20}" + "".join(f"{_fmt(v):>14}" for v in vals) + "".join(f"{_fmt(x, 3):>10}" for x in rt)
        )
    lines.append("ratio = target 1 / target 0")
    lines.append("=" * 72)
    return "\n".join(lines)
