"""The metric arithmetic, pure: records in, numbers out. Definitions (also in benchmarks/README.md):

- TTFT: time from sending the request to the arrival of the first chunk that carries an output token.
- ITL (``itl``): the gap between the arrival of consecutive token-bearing chunks (vllm bench serve's ITL).
- Per-token ITL (``itl_token``): each chunk after the first contributes its gap divided by its token
  count, once per token (tokens of the first chunk contribute nothing).
- TPOT: (E2E - TTFT) / (output tokens - 1), for requests with at least two output tokens.
- Second-token gap (``second_token_gap``, the hand-off gap): from the first token-bearing chunk to
  the second. With pd-proxy's first token from P the second waits for D's KV pull: the TTFT win
  is paid here, so the summary prints it beside TTFT.
- E2E (``e2el``): time from sending the request to the end of the answer (``data: [DONE]`` or body end).
- request/output/total-token throughput: completed requests, their output tokens, their prompt plus
  output tokens, each divided by the run's duration (first send to last answer).
- goodput: completed requests that met every given SLO, divided by the duration.
- client queue time (``client_queue_time``): from the moment a request was due to the moment it
  was sent (waiting for a ``--max-concurrency`` slot); ``e2el_including_client_queue`` adds it to
  E2E (vLLM's two metrics, reported when selected with ``--percentile-metrics``).
- ``max_output_tokens_per_s``: the most output tokens that arrived within one second, in
  one-second buckets from the first completed request's send; ``max_concurrent_requests``: the
  most completed requests open at once (vLLM's peak keys; vLLM counts one token per chunk,
  pd-bench the tokens each chunk carries).
- A cancelled request (``--cancel-rate``) counts toward none of the above: ``completed`` and
  ``failed`` are among the requests that were not cancelled, and ``cancelled`` is the rest.

Statistics follow vllm bench serve: ``numpy.mean``, ``numpy.median``, population ``numpy.std`` and
``numpy.percentile`` (linear interpolation); a metric with no values reports ``null``.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any, Final

from benchmarks.records import FAILURE_KINDS, RequestRecord

DEFAULT_PERCENTILES: Final = (50.0, 90.0, 95.0, 99.0)
LATENCY_METRICS: Final = ("ttft", "tpot", "itl", "itl_token", "e2el")
"""The metrics reported by default, in this order."""
QUEUE_METRICS: Final = ("client_queue_time", "e2el_including_client_queue")
PERCENTILE_METRICS: Final = (*LATENCY_METRICS, *QUEUE_METRICS)
"""Every name ``--percentile-metrics`` accepts (vLLM's six plus ``itl_token``)."""
GOODPUT_KEYS: Final = ("ttft", "tpot", "e2el")
TTFT_HOPS: Final = ("queue", "prefill", "handoff", "decode_ttft")
"""pd-proxy's stages that make up the client's TTFT when the first token comes from the decode worker."""
PREFILL_FIRST_HOPS: Final = ("queue", "prefill")
"""The stages before the client's first token when it came from the prefill worker
(``--first-token-from-prefill on``: the response then carries ``first_to_second``)."""
HOP_ORDER: Final = (*TTFT_HOPS, "first_to_second")
"""Every stage pd-bench knows, in report order (``first_to_second``: P's token to the client's next
write, the hand-off the client still waits for; only on streams whose first token came from P)."""


class GoodputSpecError(ValueError):
    pass


def chunk_itls(chunk_times: Sequence[float]) -> list[float]:
    """Gaps between consecutive token-bearing chunks."""
    return [b - a for a, b in pairwise(chunk_times)]


def token_itls(chunk_times: Sequence[float], chunk_tokens: Sequence[int]) -> list[float]:
    """Each later chunk's gap spread evenly over the tokens it carries."""
    if len(chunk_times) != len(chunk_tokens):
        raise ValueError("chunk_times and chunk_tokens differ in length")
    out: list[float] = []
    for i in range(1, len(chunk_times)):
        k = chunk_tokens[i]
        if k > 0:
            out.extend([(chunk_times[i] - chunk_times[i - 1]) / k] * k)
    return out


def second_token_gaps(records: Iterable[RequestRecord]) -> list[float]:
    """The wait from the first token-bearing chunk to the second, per completed stream that has two."""
    return [r.chunk_times_s[1] - r.chunk_times_s[0]
            for r in records if r.success and len(r.chunk_times_s) >= 2]  # fmt: skip


def tpot(e2e: float | None, ttft: float | None, output_tokens: int) -> float | None:
    if e2e is None or ttft is None or output_tokens < 2:
        return None
    return (e2e - ttft) / (output_tokens - 1)


@dataclass(frozen=True, slots=True)
class Stats:
    mean: float
    median: float
    std: float
    percentiles: dict[float, float]


def stats(values: Sequence[float], percentiles: Sequence[float] = DEFAULT_PERCENTILES) -> Stats | None:
    if not values:
        return None
    import numpy as np  # noqa: PLC0415  (numpy only when a run has numbers to summarize)

    arr = np.asarray(values, dtype=np.float64)
    return Stats(
        mean=float(np.mean(arr)),
        median=float(np.median(arr)),
        std=float(np.std(arr)),
        percentiles={p: float(np.percentile(arr, p)) for p in percentiles},
    )


def percentile_word(p: float) -> str:
    """99.0 -> "99", 99.9 -> "99.9" (vllm's key spelling)."""
    return str(int(p)) if int(p) == p else str(p)


def stats_keys(
    name: str, st: Stats | None, percentiles: Sequence[float], scale: float = 1000.0
) -> dict[str, Any]:
    """``mean_<name>_ms``, ``median_``, ``std_``, ``p<P>_`` (values ``None`` when there are none)."""
    out: dict[str, Any] = {
        f"mean_{name}_ms": None if st is None else st.mean * scale,
        f"median_{name}_ms": None if st is None else st.median * scale,
        f"std_{name}_ms": None if st is None else st.std * scale,
    }
    for p in percentiles:
        out[f"p{percentile_word(p)}_{name}_ms"] = None if st is None else st.percentiles[p] * scale
    return out


def parse_goodput(spec: str | Sequence[str] | None) -> dict[str, float]:
    """SLOs in milliseconds -> {"ttft": 500.0, ...}: vLLM's space-separated pairs (``["ttft:500",
    "tpot:50"]``, as ``--goodput ttft:500 tpot:50`` gives them) or one string, pairs separated by
    commas or spaces (``"ttft:500,tpot:50"``)."""
    out: dict[str, float] = {}
    if not spec:
        return out
    text = spec if isinstance(spec, str) else " ".join(spec)
    for part in text.replace(" ", ",").split(","):
        if not part:
            continue
        key, sep, raw = part.partition(":")
        key = key.strip().lower()
        if not sep or key not in GOODPUT_KEYS:
            raise GoodputSpecError(
                f"goodput entries are KEY:MS with KEY one of {', '.join(GOODPUT_KEYS)}: {part!r}"
            )
        try:
            value = float(raw)
        except ValueError:
            raise GoodputSpecError(f"goodput value is not a number: {part!r}") from None
        if value <= 0:
            raise GoodputSpecError(f"goodput value must be positive: {part!r}")
        out[key] = value
    return out


def meets_slo(rec: RequestRecord, slo_ms: dict[str, float]) -> bool:
    """A completed request meets the SLOs. Like vllm, TPOT counts as 0 below two tokens. Without a
    stream there is no TTFT of its own: E2E stands in for it and TPOT is not checked."""
    e2e = rec.e2e_s or 0.0
    ttft = rec.ttft_s if rec.ttft_s is not None else e2e
    t = tpot(rec.e2e_s, rec.ttft_s, rec.output_tokens) or 0.0
    values = {"ttft": ttft, "tpot": t, "e2el": e2e}
    return all(values[k] * 1000.0 <= limit for k, limit in slo_ms.items())


def hop_names(records: Iterable[RequestRecord]) -> list[str]:
    seen: dict[str, None] = {}
    for r in records:
        for name in r.server_timing or {}:
            seen.setdefault(name, None)
    known = [h for h in HOP_ORDER if h in seen]
    return known + [h for h in seen if h not in known]


def ttft_unattributed(rec: RequestRecord) -> float | None:
    """Client TTFT minus the proxy's stages before the first token (network and relay), seconds:
    queue+prefill+handoff+decode_ttft, or queue+prefill when the first token came from the prefill
    worker (the response carries ``first_to_second``)."""
    st = rec.server_timing
    if rec.ttft_s is None or not st:
        return None
    hops = PREFILL_FIRST_HOPS if "first_to_second" in st else TTFT_HOPS
    if not all(h in st for h in hops):
        return None
    return rec.ttft_s - sum(st[h] for h in hops) / 1000.0


def queue_time(rec: RequestRecord) -> float:
    """Seconds the request waited in the client after it was due (a concurrency slot)."""
    return max(0.0, rec.start_s - rec.scheduled_s)


def peak_output_tokens_per_s(ok: Sequence[RequestRecord]) -> float:
    """The most output tokens arriving within one one-second bucket (vLLM's buckets: from the
    earliest send of a completed request)."""
    if not ok:
        return 0.0
    t_min = min(r.start_s for r in ok)
    t_max = max(r.start_s + (r.e2e_s or 0.0) for r in ok)
    buckets = [0.0] * (math.ceil(t_max - t_min) + 1)
    for r in ok:
        for t, n in zip(r.chunk_times_s, r.chunk_tokens, strict=False):
            b = int(r.start_s + t - t_min)
            if 0 <= b < len(buckets):
                buckets[b] += n
    return max(buckets)


def peak_concurrency(ok: Sequence[RequestRecord]) -> int:
    """The most completed requests open at once: a sweep over [send, end) intervals."""
    events = sorted(
        [(r.start_s, 1) for r in ok] + [(r.start_s + (r.e2e_s or 0.0), -1) for r in ok]
    )  # at a tie the end (-1) sorts first: half-open intervals
    cur = peak = 0
    for _, delta in events:
        cur += delta
        peak = max(peak, cur)
    return peak


def check_metric_names(names: Sequence[str]) -> None:
    bad = [n for n in names if n not in PERCENTILE_METRICS]
    if bad or not names:
        raise ValueError(
            f"unknown percentile metric(s) {', '.join(bad) or '(none)'}; choose from "
            f"{', '.join(PERCENTILE_METRICS)}"
        )


def compute_metrics(
    records: Sequence[RequestRecord],
    duration_s: float,
    percentiles: Sequence[float] = DEFAULT_PERCENTILES,
    goodput_ms: dict[str, float] | None = None,
    *,
    metrics: Sequence[str] = LATENCY_METRICS,
    cancellation: bool = False,
) -> dict[str, Any]:
    """The aggregate keys of the result JSON (vllm bench serve names plus pd-bench's own).

    ``metrics`` are the ones reported with mean/median/std/percentiles (``--percentile-metrics``).
    With ``cancellation`` the cancellation keys are added."""
    check_metric_names(metrics)
    live = [r for r in records if not r.cancelled]
    ok = [r for r in live if r.success]
    failed = [r for r in live if not r.success]
    per_metric: dict[str, list[float]] = {m: [] for m in PERCENTILE_METRICS}
    for r in ok:
        if r.ttft_s is not None:
            per_metric["ttft"].append(r.ttft_s)
        t = tpot(r.e2e_s, r.ttft_s, r.output_tokens)
        if t is not None:
            per_metric["tpot"].append(t)
        if r.ttft_s is not None:
            per_metric["itl"].extend(chunk_itls(r.chunk_times_s))
            per_metric["itl_token"].extend(token_itls(r.chunk_times_s, r.chunk_tokens))
        if r.e2e_s is not None:
            per_metric["e2el"].append(r.e2e_s)
            per_metric["e2el_including_client_queue"].append(r.e2e_s + queue_time(r))
        per_metric["client_queue_time"].append(queue_time(r))
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    dur = duration_s if duration_s > 0 else float("nan")
    counts = Counter(r.failure for r in failed)
    out: dict[str, Any] = {
        "duration": duration_s,
        "completed": len(ok),
        "failed": len(failed),
        "failures": {k: counts.get(k, 0) for k in FAILURE_KINDS},
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / dur,
        "request_goodput": None,
        "output_throughput": total_out / dur,
        "total_token_throughput": (total_in + total_out) / dur,
        "num_output_len_mismatch": sum(1 for r in ok if r.output_tokens != r.requested_output_len),
        # vLLM's per-request lists that it keeps even without --save-detailed (seconds; 0 for a
        # request that did not complete), its peak keys, and its ASR factor (always 0 here)
        "latencies": [r.e2e_s if r.success and r.e2e_s is not None else 0.0 for r in records],
        "queue_times": [queue_time(r) for r in records],
        "max_output_tokens_per_s": peak_output_tokens_per_s(ok),
        "max_concurrent_requests": peak_concurrency(ok),
        "rtfx": 0.0,
    }
    if goodput_ms:
        good = sum(1 for r in ok if meets_slo(r, goodput_ms))
        out["request_goodput"] = good / dur
        out["goodput_fraction"] = good / len(live) if live else None
        out["goodput_slos_ms"] = dict(goodput_ms)
    for m in metrics:
        out.update(stats_keys(m, stats(per_metric[m], percentiles), percentiles))
    out.update(stats_keys("second_token_gap", stats(second_token_gaps(ok), percentiles), percentiles))
    if cancellation:
        out.update(cancel_metrics(records, percentiles))
    # Per-hop breakdown reported by pd-proxy (already milliseconds).
    hops = hop_names(ok)
    out["server_timing_requests"] = sum(1 for r in ok if r.server_timing)
    out["hops"] = hops
    for h in hops:
        vals = [r.server_timing[h] for r in ok if r.server_timing and h in r.server_timing]
        out.update(stats_keys(f"hop_{h}", stats(vals, percentiles), percentiles, scale=1.0))
    if hops:
        un = [u for u in (ttft_unattributed(r) for r in ok) if u is not None]
        out.update(stats_keys("ttft_unattributed", stats(un, percentiles), percentiles))
    return out


def cancel_metrics(records: Sequence[RequestRecord], percentiles: Sequence[float]) -> dict[str, Any]:
    """What the cancellations were: how many, where they landed, how fast an abort was honoured."""
    cancelled = [r for r in records if r.cancelled]
    phases = Counter(r.cancel_phase for r in cancelled)
    aborts = [r for r in cancelled if r.cancel_mode == "abort"]
    acks = [
        r.abort_ended_s - r.cancel_s
        for r in aborts
        if r.abort_ended_s is not None and r.cancel_s is not None
    ]
    out: dict[str, Any] = {
        "cancelled": len(cancelled),
        "cancel_phases": {p: phases.get(p, 0) for p in ("before_first_token", "mid_stream")},
        "abort_calls": len(aborts),
        "abort_calls_ok": sum(1 for r in aborts if r.abort_status == 200),
        "aborts_not_ended": sum(1 for r in aborts if r.abort_ended_s is None),
        # the answer after the abort still ended as the worker's own end: the abort was not heeded
        "aborts_run_out": sum(1 for r in aborts if r.finish_reason in ("length", "stop")),
    }
    out.update(stats_keys("cancel", stats([r.cancel_s for r in cancelled if r.cancel_s is not None],
                                           percentiles), percentiles))
    out.update(stats_keys("abort_ack", stats(acks, percentiles), percentiles))
    return out
