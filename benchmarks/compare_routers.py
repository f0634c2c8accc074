"""Side-by-side comparison of P/D routers on the same machine, in one run.

    python -m benchmarks.compare_routers [--quick]

Starts a pd-sim prefill worker and a pd-sim decode worker at zero latency on loopback, then drives
the same closed-loop load through three targets:

* ``floor``: the client doing the two hops itself (prefill hop non-stream with ``max_tokens: 1``
  and ``kv_transfer_params: {do_remote_decode: true, do_remote_prefill: false}``, then the decode
  hop with the returned params; docs/vllm.md, section 3). No proxy: the best any proxy can do.
* ``pd-proxy``: this project's proxy (``pd-proxy --prefill URL --decode URL --port P``), once per
  ``--pd-proxy-workers`` count (default 1 and 2): ``pd-proxy`` is one process, ``pd-proxy-w2`` is
  ``--workers 2`` (two processes on one port, ``proxy/http/multiproc.py``).
* ``vllm-router``: the vLLM project's Rust router in P/D mode, installed into its own virtual
  environment by ``benchmarks/router_env.sh``.

Every point (stream or not x output tokens x concurrency) is repeated; within a point the targets
take turns, their order rotated on every repetition so that machine drift hits all alike. The
medians over the repetitions are reported. ``--pinning`` picks how the processes share the cores:
``pinned`` (the default), ``unpinned`` (no taskset anywhere: every proxy, the workers and this client
share all the cores, as on a real host) or ``both`` (the whole comparison pinned, then unpinned, in
one invocation, reported side by side). Pinned, every proxy is pinned (taskset) to the same CPU cores:
the last core when pd-proxy runs one process only; the last N cores when a pd-proxy target runs
N processes (vllm-router's tokio runtime sizes its worker threads by the cores it may use, so it gets
N threads). The workers and this client run on the other cores, or, on a machine with no core left
(2 cores, N = 2), on every core, shared with the proxies. The run ends with the memory per open stream: the
proxies' RSS growth over N idle streams held open by a decode worker with a long inter-token gap.

Metrics per target and point (medians over the repetitions):

* TTFT: from sending the request (pd-bench's clock: when its bytes are written; for the floor,
  when its prefill hop is sent) to the first token-bearing SSE event; for non-stream requests, to
  the whole answer. Added TTFT is the target's percentile minus the floor's in the same
  repetition (p50 and p99).
* tokens/s and requests/s of completed requests over the run's wall time.
* proxy CPU per request: the proxy process tree's CPU time during the run over its completed
  requests (microseconds), for every proxy target; with its ratio to vllm-router's.
* tokens per proxy CPU-second (utime + stime of the proxy's process tree during the run): the
  relay cost per core. Unlike tokens/s it holds when the proxy is not the bottleneck or other load
  shares the machine. The CPU used by the workers and by this client is recorded too: when either
  is near the cores it has, it, not the proxy, bounds the run's throughput.

The load is pd-bench's own: ``benchmarks.client`` sends every request (the floor's two hops
too) and judges its answer by pd-bench's rules (SSE, ``[DONE]``, in-band errors, the
``output_mode`` echo), ``benchmarks.loadgen`` keeps the loop closed; ``benchmarks.sim_stack``
starts and stops the processes and ``benchmarks.procstat`` reads their CPU time and memory.

vllm-router runs with ``--policy round_robin`` (one prefill and one decode worker: routing has
nothing to decide; its default cache_aware policy only adds work) and ``--log-level warning``.

Outputs go to ``results/compare_routers-<UTC time>/``: ``result.json``, ``result.png`` and each
process's log (with ``--pinning both``: one such folder per mode, ``pinned/`` and ``unpinned/``,
and a ``result.json`` at the top holding both runs and the side-by-side rows). A table of ratios
pd-proxy / vllm-router is printed (per mode, then side by side). Every process started here is
killed at the end, also on Ctrl-C, SIGTERM or an error. A target that cannot start is left out
(said on stderr and in ``meta.failed_targets``); the others still run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import math
import os
import platform
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from types import FrameType
from typing import Any, Final

import aiohttp
import uvloop

from benchmarks.client import CancelPlan, ClientOptions, new_session, send_request
from benchmarks.datasets import RequestSpec
from benchmarks.loadgen import Job, drive
from benchmarks.metrics import stats
from benchmarks.procstat import per_stream_kib, tree_cpu_seconds, tree_rss_kib
from benchmarks.records import FAIL_HTTP_STATUS, RequestRecord
from benchmarks.report import json_safe
from benchmarks.sim_stack import REPO_ROOT, free_port, processes, start_logged, stop_all, wait_ready

FLOOR: Final = "floor"
PD_PROXY: Final = "pd-proxy"
VLLM_ROUTER: Final = "vllm-router"
TARGETS: Final = (FLOOR, PD_PROXY, VLLM_ROUTER)
PINNED: Final = "pinned"
UNPINNED: Final = "unpinned"
BOTH: Final = "both"
PINNINGS: Final = (PINNED, UNPINNED)
_WORKERS_SUFFIX: Final = "-w"


def pd_proxy_name(workers: int) -> str:
    """The target name of pd-proxy run with ``--workers N``: ``pd-proxy`` for 1, else ``pd-proxy-wN``."""
    return PD_PROXY if workers == 1 else f"{PD_PROXY}{_WORKERS_SUFFIX}{workers}"


def pd_proxy_workers(name: str) -> int | None:
    """N of a pd-proxy target name (None: not pd-proxy)."""
    if name == PD_PROXY:
        return 1
    prefix = PD_PROXY + _WORKERS_SUFFIX
    if name.startswith(prefix) and name[len(prefix) :].isdigit() and int(name[len(prefix) :]) > 1:
        return int(name[len(prefix) :])
    return None


def is_proxy(name: str) -> bool:
    return name == VLLM_ROUTER or pd_proxy_workers(name) is not None


def target_rank(name: str) -> tuple[int, int]:
    """Display order: floor, pd-proxy by workers, vllm-router."""
    workers = pd_proxy_workers(name)
    return (1, workers) if workers is not None else ((0, 0) if name == FLOOR else (2, 0))

RESULT_KEYS: Final = ("meta", "points", "ratios", "memory", "checks", "checks_by_proxy")
BOTH_KEYS: Final = ("meta", "runs", "side_by_side")
"""``--pinning both``: the two runs' documents (RESULT_KEYS each) by mode, and the rows side by side."""
SIDE_KEYS: Final = ("label", "target", *PINNINGS)
SIDE_METRICS: Final = (
    "proxy_cpu_us_per_request",
    "requests_per_s",
    "tokens_per_proxy_cpu_s",
    "added_ttft_p50_ms",
    "cpu_per_request_vs_router",
    "requests_per_s_vs_router",
)
CHECK_KEYS: Final = ("relay_throughput", "added_ttft", "memory_per_stream", "floor_headroom")
MEMORY_TARGET_KIB: Final = 64.0
FLOOR_HEADROOM: Final = 1.2  # "well above": the floor relays at least 1.2x either proxy's tokens/s
POINT_KEYS: Final = ("label", "stream", "max_tokens", "concurrency", "targets")
TARGET_KEYS: Final = ("median", "reps")
METRIC_KEYS: Final = (
    "ttft_p50_ms",
    "ttft_p99_ms",
    "added_ttft_p50_ms",
    "added_ttft_p99_ms",
    "tokens_per_s",
    "requests_per_s",
    "tokens_per_proxy_cpu_s",
    "proxy_cpu_us_per_request",
    "proxy_cpu_util",
    "workers_cpu_util",
    "client_cpu_util",
    "ok",
    "errors",
    "timed_out",
)
RATIO_KEYS: Final = (
    "label",
    "proxy",
    "tokens_per_s",
    "requests_per_s",
    "tokens_per_proxy_cpu_s",
    "proxy_cpu_us_per_request",
    "added_ttft_p50_ms",
    "added_ttft_p99_ms",
    "added_ttft_p50_diff_ms",
    "added_ttft_p99_diff_ms",
)
_RATIOS: Final = RATIO_KEYS[2:8]

# Command templates; {bin} is this interpreter's bin directory, {router_bin} the router venv's.
# The workers never queue nor run out of KV blocks at these concurrencies, and their context
# ({max_model_len}) fits the prompt and the longest output.
_SIM_ROOM: Final = ("--max-running 100000 --max-num-seqs 100000 --num-kv-blocks 400000"
                    " --max-model-len {max_model_len}")
DEFAULT_SIM_CMD: Final = (
    "{bin}/pd-sim --host 127.0.0.1 --port {port} --role {role} --zero-latency " + _SIM_ROOM
)
# A decode worker that sends its first token at once and the next after ten minutes.
DEFAULT_SLOW_DECODE_CMD: Final = (
    "{bin}/pd-sim --host 127.0.0.1 --port {port} --role decode --prefill-base-ms 0"
    " --prefill-per-token-ms 0 --itl-ms 600000 " + _SIM_ROOM
)
_MEMORY_TOKENS: Final = 64
"""max_tokens of the idle streams held open for the memory measurement."""
DEFAULT_PD_PROXY_CMD: Final = (
    "{bin}/pd-proxy --host 127.0.0.1 --port {port} --prefill {prefill} --decode {decode} --log-level warning"
)
DEFAULT_ROUTER_CMD: Final = (
    "{router_bin}/vllm-router --host 127.0.0.1 --port {port} --vllm-pd-disaggregation"
    " --prefill {prefill} --decode {decode} --policy round_robin --log-level warning"
    " --prometheus-port {aux_port}"
)


# --------------------------------------------------------------------------------------------
# Plan: points, repetitions and the order the targets take turns in.


@dataclass(frozen=True)
class Point:
    stream: bool
    max_tokens: int
    concurrency: int

    @property
    def label(self) -> str:
        kind = "stream" if self.stream else "nonstream"
        return f"{kind}-out{self.max_tokens}-c{self.concurrency}"


def build_points(
    concurrencies: Sequence[int], max_tokens: Sequence[int], streams: Sequence[bool]
) -> list[Point]:
    """Every combination, stream points first, then by output length and concurrency."""
    return [
        Point(stream=s, max_tokens=m, concurrency=c)
        for s in streams
        for m in max_tokens
        for c in concurrencies
    ]


def target_order(targets: Sequence[str], rep: int) -> list[str]:
    """The targets rotated by the repetition number: every target runs first, second, ... in turn."""
    if not targets:
        return []
    k = rep % len(targets)
    return [*targets[k:], *targets[:k]]


def schedule(points: Sequence[Point], targets: Sequence[str], reps: int) -> Iterator[tuple[Point, int, str]]:
    """(point, repetition, target) in run order: point by point, targets alternating within each."""
    for point in points:
        for rep in range(reps):
            for target in target_order(targets, rep):
                yield point, rep, target


def requests_per_run(concurrency: int, rounds: int, min_requests: int) -> int:
    return max(concurrency * rounds, min_requests)


# --------------------------------------------------------------------------------------------
# Arithmetic: percentiles, medians, added TTFT, ratios.


def median(values: Sequence[float]) -> float:
    """Median of the finite values; NaN when there are none."""
    finite = [v for v in values if not math.isnan(v)]
    return statistics.median(finite) if finite else math.nan


def ratio(numerator: float, denominator: float) -> float:
    """numerator / denominator, NaN when either is NaN or the denominator is not positive."""
    if math.isnan(numerator) or math.isnan(denominator) or denominator <= 0:
        return math.nan
    return numerator / denominator


@dataclass(frozen=True)
class RunStats:
    """One target at one point in one repetition."""

    ttft_p50_ms: float
    ttft_p99_ms: float
    tokens_per_s: float
    requests_per_s: float
    ok: int
    errors: int
    timed_out: bool
    wall_s: float
    # The proxy process tree's CPU time during the run (NaN for the floor): tokens per proxy
    # CPU-second is the relay cost per core, and holds up when other load shares the machine.
    proxy_cpu_s: float = math.nan
    tokens_per_proxy_cpu_s: float = math.nan
    # The proxy process tree's CPU time over the requests it completed (microseconds; NaN for the floor).
    proxy_cpu_us_per_request: float = math.nan
    proxy_cpu_util: float = math.nan
    # Where else the CPU went (in cores busy): the pd-sim workers and this load client. When either
    # is near the cores it has, it (not the proxy) bounds the throughput of the run.
    workers_cpu_util: float = math.nan
    client_cpu_util: float = math.nan
    error_kinds: dict[str, int] = field(default_factory=dict)


def first_token_s(rec: RequestRecord) -> float | None:
    """TTFT of a streamed answer; for a non-stream one, the time to the whole answer."""
    return rec.ttft_s if rec.ttft_s is not None else rec.e2e_s


def error_kind(rec: RequestRecord) -> str | None:
    """Why a request counts as an error (None: it does not): the client's failure kind (with the
    status of an HTTP error), or ``no tokens`` for an answer that carried none."""
    if rec.failure == FAIL_HTTP_STATUS:
        return f"{rec.failure} {rec.http_status}"
    if rec.failure is not None or not rec.success:
        return rec.failure or "failed"
    return None if rec.output_tokens > 0 else "no tokens"


def run_stats(
    records: Sequence[RequestRecord],
    wall_s: float,
    *,
    timed_out: bool = False,
    proxy_cpu_s: float = math.nan,
    workers_cpu_s: float = math.nan,
    client_cpu_s: float = math.nan,
) -> RunStats:
    kinds = [error_kind(r) for r in records]
    good = [r for r, kind in zip(records, kinds, strict=True) if kind is None]
    ttft = stats([t * 1000.0 for r in good if (t := first_token_s(r)) is not None], (50, 99))
    tokens = sum(r.output_tokens for r in good)
    return RunStats(
        proxy_cpu_s=proxy_cpu_s,
        tokens_per_proxy_cpu_s=ratio(float(tokens), proxy_cpu_s),
        proxy_cpu_us_per_request=ratio(proxy_cpu_s * 1e6, float(len(good))),
        proxy_cpu_util=ratio(proxy_cpu_s, wall_s),
        workers_cpu_util=ratio(workers_cpu_s, wall_s),
        client_cpu_util=ratio(client_cpu_s, wall_s),
        ttft_p50_ms=ttft.percentiles[50] if ttft else math.nan,
        ttft_p99_ms=ttft.percentiles[99] if ttft else math.nan,
        tokens_per_s=tokens / wall_s if wall_s > 0 else math.nan,
        requests_per_s=len(good) / wall_s if wall_s > 0 else math.nan,
        ok=len(good),
        errors=len(records) - len(good),
        error_kinds=dict(Counter(k for k in kinds if k is not None)),
        timed_out=timed_out,
        wall_s=wall_s,
    )


def summarise_point(runs: Mapping[str, Sequence[RunStats]]) -> dict[str, dict[str, float | int | bool]]:
    """Medians over repetitions per target. Added TTFT is paired: the target's percentile minus the
    floor's in the same repetition, then the median over repetitions (NaN without a floor)."""
    floor_runs = runs.get(FLOOR, ())
    out: dict[str, dict[str, float | int | bool]] = {}
    for target, reps in runs.items():
        added50 = [r.ttft_p50_ms - f.ttft_p50_ms for r, f in zip(reps, floor_runs, strict=False)]
        added99 = [r.ttft_p99_ms - f.ttft_p99_ms for r, f in zip(reps, floor_runs, strict=False)]
        out[target] = {
            "ttft_p50_ms": median([r.ttft_p50_ms for r in reps]),
            "ttft_p99_ms": median([r.ttft_p99_ms for r in reps]),
            "added_ttft_p50_ms": median(added50),
            "added_ttft_p99_ms": median(added99),
            "tokens_per_s": median([r.tokens_per_s for r in reps]),
            "requests_per_s": median([r.requests_per_s for r in reps]),
            "tokens_per_proxy_cpu_s": median([r.tokens_per_proxy_cpu_s for r in reps]),
            "proxy_cpu_us_per_request": median([r.proxy_cpu_us_per_request for r in reps]),
            "proxy_cpu_util": median([r.proxy_cpu_util for r in reps]),
            "workers_cpu_util": median([r.workers_cpu_util for r in reps]),
            "client_cpu_util": median([r.client_cpu_util for r in reps]),
            "ok": sum(r.ok for r in reps),
            "errors": sum(r.errors for r in reps),
            "timed_out": any(r.timed_out for r in reps),
        }
    return out


def point_ratios(
    label: str, medians: Mapping[str, Mapping[str, float | int | bool]], proxy: str = PD_PROXY
) -> dict[str, Any]:
    """pd-proxy / vllm-router for one point: above 1 is better for throughput, below 1 for CPU per
    request and added TTFT.
    Added TTFT near zero makes its ratio meaningless, so the difference (pd-proxy minus vllm-router,
    ms; below 0 is better) is given too."""
    a = medians.get(proxy, {})
    b = medians.get(VLLM_ROUTER, {})
    row: dict[str, Any] = {"label": label, "proxy": proxy}
    for key in _RATIOS:
        row[key] = ratio(float(a.get(key, math.nan)), float(b.get(key, math.nan)))
    for q in ("p50", "p99"):
        key = f"added_ttft_{q}_ms"
        row[f"added_ttft_{q}_diff_ms"] = float(a.get(key, math.nan)) - float(b.get(key, math.nan))
    return row


def _check(failing: list[str], judged: int) -> dict[str, Any]:
    return {"met": (not failing) if judged else None, "judged": judged, "failing": failing}


def issue_checks(
    point_docs: Sequence[Mapping[str, Any]],
    ratio_rows: Sequence[Mapping[str, Any]],
    memory: Mapping[str, Any],
    proxy: str = PD_PROXY,
) -> dict[str, dict[str, Any]]:
    """The issue's targets for one pd-proxy target (``proxy``), judged on this run. ``met`` is
    None when the run has nothing to judge (e.g. a target missing); ``failing`` lists the points
    (or targets) that miss."""
    by_label = {p["label"]: p for p in point_docs}
    tput_fail: list[str] = []
    tput_judged = 0
    ttft_fail: list[str] = []
    ttft_judged = 0
    for row in ratio_rows:
        if row.get("proxy", PD_PROXY) != proxy:
            continue
        point = by_label[row["label"]]
        if point["concurrency"] >= 64:
            values = [row["tokens_per_s"], row["requests_per_s"]]
            if not any(math.isnan(v) for v in values):
                tput_judged += 1
                if any(v < 1.0 for v in values):
                    tput_fail.append(row["label"])
        diffs = [row["added_ttft_p50_diff_ms"], row["added_ttft_p99_diff_ms"]]
        if not any(math.isnan(v) for v in diffs):
            ttft_judged += 1
            if any(v > 0.0 for v in diffs):
                ttft_fail.append(row["label"])
    mem_fail: list[str] = []
    mem_judged = 0
    for res in memory.get("results", ()):
        if res.get("target") == proxy and not math.isnan(float(res.get("per_stream_kib", math.nan))):
            mem_judged += 1
            if res["per_stream_kib"] > MEMORY_TARGET_KIB:
                mem_fail.append(proxy)
    floor_fail: list[str] = []
    floor_judged = 0
    for point in point_docs:
        medians = {t: d["median"] for t, d in point["targets"].items()}
        proxies = [float(m["tokens_per_s"]) for t, m in medians.items() if is_proxy(t)]
        if FLOOR not in medians or not proxies:
            continue
        floor_judged += 1
        if not float(medians[FLOOR]["tokens_per_s"]) >= FLOOR_HEADROOM * max(proxies):
            floor_fail.append(point["label"])
    return {
        "relay_throughput": _check(tput_fail, tput_judged),
        "added_ttft": _check(ttft_fail, ttft_judged),
        "memory_per_stream": _check(mem_fail, mem_judged),
        "floor_headroom": _check(floor_fail, floor_judged),
    }


def build_result(
    meta: Mapping[str, Any],
    points: Sequence[Point],
    runs: Mapping[Point, Mapping[str, Sequence[RunStats]]],
    memory: Mapping[str, Any],
) -> dict[str, Any]:
    """The result document (keys RESULT_KEYS), JSON-safe."""
    point_docs: list[dict[str, Any]] = []
    ratio_rows: list[dict[str, Any]] = []
    for point in points:
        per_target = runs.get(point)
        if not per_target:
            continue
        medians = summarise_point(per_target)
        point_docs.append(
            {
                "label": point.label,
                "stream": point.stream,
                "max_tokens": point.max_tokens,
                "concurrency": point.concurrency,
                "targets": {
                    t: {"median": medians[t], "reps": [asdict(r) for r in reps]}
                    for t, reps in per_target.items()
                },
            }
        )
        for name in sorted((t for t in per_target if pd_proxy_workers(t) is not None), key=target_rank):
            ratio_rows.append(point_ratios(point.label, medians, name))
    variants = sorted({row["proxy"] for row in ratio_rows}, key=target_rank) or [PD_PROXY]
    by_proxy = {name: issue_checks(point_docs, ratio_rows, memory, name) for name in variants}
    doc = {
        "meta": dict(meta),
        "points": point_docs,
        "ratios": ratio_rows,
        "memory": dict(memory),
        "checks": by_proxy[variants[0]],
        "checks_by_proxy": by_proxy,
    }
    result: dict[str, Any] = json_safe(doc)
    return result


# --------------------------------------------------------------------------------------------
# The load: benchmarks.client sends every request (the floor: its two hops), loadgen keeps the
# loop closed.


def client_options(url: str, request_timeout_s: float, prefill_url: str | None = None) -> ClientOptions:
    """How a target is sent to (``prefill_url``: the floor, the client doing both hops). No
    Server-Timing report is asked for: it would cost pd-proxy CPU that vllm-router does not spend."""
    return ClientOptions(
        url=url, prefill_url=prefill_url, request_timeout_s=request_timeout_s, ask_server_timing=False
    )


def new_record(index: int, spec: RequestSpec, target: str) -> RequestRecord:
    return RequestRecord(index, uuid.uuid4().hex, target, len(spec.prompt), spec.output_len)


async def run_load(
    opts: ClientOptions,
    point: Point,
    *,
    prompt: Sequence[int],
    n_requests: int,
    time_limit_s: float,
    proxy_pid: int | None = None,
    worker_pids: Sequence[int] = (),
) -> RunStats:
    """Closed loop: ``concurrency`` requests in flight, sent back to back until ``n_requests`` were
    sent or ``time_limit_s`` passed (each request is bounded by its own timeout)."""
    opts = replace(opts, stream=point.stream)
    spec = RequestSpec(prompt=list(prompt), output_len=point.max_tokens)
    async with new_session() as session:

        async def send(job: Job, t0: float) -> RequestRecord:
            return await send_request(session, opts, job.spec, new_record(job.index, spec, opts.url), t0)

        # Warm-up (not recorded): one request per concurrent stream, all at once, so that every
        # connection the run uses (client to target, target to workers) is open before the
        # clock starts. With only a few, each run paid for opening most of them, and unevenly:
        # a target whose idle upstream connections outlive the other targets' runs paid less
        # (pd-proxy drops them after 4 s, under vLLM's 5 s keep-alive).
        warm = [Job(i, 0, spec, 0.0) for i in range(point.concurrency)]
        await asyncio.gather(*(send(job, time.perf_counter()) for job in warm))
        jobs = [Job(i, 0, spec, 0.0) for i in range(n_requests)]
        cpu0 = tree_cpu_seconds(proxy_pid) if proxy_pid else math.nan
        workers0 = sum(tree_cpu_seconds(p) for p in worker_pids) if worker_pids else math.nan
        client0 = time.process_time()
        records, wall = await drive(jobs, send, point.concurrency, time_limit_s)
        cpu = tree_cpu_seconds(proxy_pid) - cpu0 if proxy_pid else math.nan
        workers = sum(tree_cpu_seconds(p) for p in worker_pids) - workers0 if worker_pids else math.nan
        client_cpu = time.process_time() - client0
    return run_stats(
        records,
        wall,
        timed_out=len(records) < n_requests,
        proxy_cpu_s=cpu,
        workers_cpu_s=workers,
        client_cpu_s=client_cpu,
    )


# --------------------------------------------------------------------------------------------
# Memory per open stream.


async def hold_streams(
    session: aiohttp.ClientSession, opts: ClientOptions, n: int, prompt: Sequence[int], limit_s: float
) -> tuple[list[RequestRecord], list[asyncio.Task[RequestRecord]]]:
    """Opens n streams and waits (bounded) until each has delivered its first token or ended.
    Returns their records and the tasks holding them (the caller cancels those)."""
    spec = RequestSpec(prompt=list(prompt), output_len=_MEMORY_TOKENS)
    records = [new_record(i, spec, opts.url) for i in range(n)]
    t0 = time.perf_counter()
    tasks = [asyncio.create_task(send_request(session, opts, spec, r, t0)) for r in records]
    deadline = time.monotonic() + limit_s
    while (left := deadline - time.monotonic()) > 0:
        waiting = [t for r, t in zip(records, tasks, strict=True) if r.ttft_s is None and not t.done()]
        if not waiting:
            break
        await asyncio.wait(waiting, timeout=min(left, 0.05))  # the first tokens are polled
    return records, tasks


async def release(tasks: Sequence[asyncio.Task[RequestRecord]]) -> None:
    """Close held streams (cancelling a request closes its connection)."""
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def streams_open(records: Sequence[RequestRecord]) -> int:
    return sum(1 for r in records if r.ttft_s is not None)


async def measure_stream_memory(
    name: str, url: str, *, pid: int, n: int, prompt: Sequence[int], limit_s: float
) -> dict[str, Any]:
    opts = client_options(url, limit_s + 600)
    async with new_session() as session:
        # Warm-up: a handful of held streams, released, so lazily built state is off the books.
        warm, tasks = await hold_streams(session, opts, 16, prompt, min(limit_s, 30))
        await asyncio.sleep(0.5)
        await release(tasks)
        await asyncio.sleep(1.0)
        before = tree_rss_kib(pid)
        t0 = time.perf_counter()
        held, tasks = await hold_streams(session, opts, n, prompt, limit_s)
        await asyncio.sleep(1.0)
        after = tree_rss_kib(pid)
        elapsed = time.perf_counter() - t0
        await release(tasks)
    return {
        "target": name,
        "streams_requested": n,
        "streams_open": streams_open(held),
        "warmup_streams_open": streams_open(warm),
        "rss_before_kib": before,
        "rss_after_kib": after,
        "per_stream_kib": per_stream_kib(before, after, streams_open(held)),
        "open_seconds": elapsed,
    }


# --------------------------------------------------------------------------------------------
# Processes: each in its own process group with its log in the output folder (sim_stack's
# start_logged); every one is stopped, group and all, at the end whatever happens.


def start(procs: list[subprocess.Popen[bytes]], cfg: Config, name: str, argv: Sequence[str],
          cpus: str | None) -> subprocess.Popen[bytes]:
    proc = start_logged(argv, cfg.out_dir / f"{name}.log", cpus)
    procs.append(proc)
    return proc


def stop(procs: list[subprocess.Popen[bytes]], proc: subprocess.Popen[bytes]) -> None:
    stop_all([proc])
    procs.remove(proc)


async def wait_serving(
    name: str, proc: subprocess.Popen[bytes], opts: ClientOptions, prompt: Sequence[int], limit_s: float
) -> None:
    """Bounded: until a small stream through the target delivers a token (the stream is then closed,
    so this also works in front of a decode worker that takes minutes per token)."""
    opts = replace(opts, stream=True, request_timeout_s=5.0)
    spec = RequestSpec(prompt=list(prompt), output_len=2)
    first_token = CancelPlan(mode="disconnect", after_tokens=1)
    deadline = time.monotonic() + limit_s
    last = "no answer"
    async with new_session() as session:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"{name} exited with code {proc.returncode} before it was ready (see its log)"
                )
            rec = new_record(0, spec, opts.url)
            await send_request(session, opts, spec, rec, time.perf_counter(), cancel=first_token)
            if rec.ttft_s is not None:
                return
            last = rec.error or "request failed"
            await asyncio.sleep(0.2)
    raise RuntimeError(f"{name} not ready after {limit_s:.0f} s ({last}; see its log)")


# --------------------------------------------------------------------------------------------
# Configuration and the run.


@dataclass(frozen=True)
class Config:
    targets: tuple[str, ...]
    concurrencies: tuple[int, ...]
    max_tokens: tuple[int, ...]
    streams: tuple[bool, ...]
    reps: int
    rounds: int
    min_requests: int
    prompt_len: int
    run_time_limit_s: float
    request_timeout_s: float
    memory_streams: int
    proxy_cpus: str | None
    worker_cpus: str | None
    client_cpus: str | None
    sim_cmd: str
    slow_decode_cmd: str
    pd_proxy_cmd: str
    router_cmd: str
    router_venv: Path
    out_dir: Path
    quick: bool
    pinnings: tuple[str, ...] = (PINNED,)
    """The modes run, in order: ``pinned`` uses proxy_cpus, worker_cpus and client_cpus;
    ``unpinned`` runs everything with no taskset."""

    @property
    def pinning(self) -> str:
        """``pinned``, ``unpinned`` or ``both``."""
        return self.pinnings[0] if len(self.pinnings) == 1 else BOTH


def for_pinning(cfg: Config, mode: str) -> Config:
    """The configuration of one mode's run: unpinned, no CPU list at all; with both modes, each
    run writes into its own folder (``pinned/``, ``unpinned/``)."""
    out_dir = cfg.out_dir / mode if len(cfg.pinnings) > 1 else cfg.out_dir
    if mode == UNPINNED:
        return replace(cfg, pinnings=(mode,), proxy_cpus=None, worker_cpus=None, client_cpus=None,
                       out_dir=out_dir)
    return replace(cfg, pinnings=(mode,), out_dir=out_dir)


def describe_pinning(meta: Mapping[str, Any]) -> str:
    """One line for the table: the mode and the CPU lists the run used."""
    if meta.get("pinning") == UNPINNED:
        return "unpinned: no taskset, every proxy, the workers and the client share all the cores"
    cpus = [f"{who} {meta.get(key) or 'all cores'}" for who, key in
            (("proxies", "proxy_cpus"), ("workers", "worker_cpus"), ("client", "client_cpus"))]
    line = "pinned (taskset): " + ", ".join(cpus)
    proxies = cpu_set(meta.get("proxy_cpus"))
    if proxies & (cpu_set(meta.get("worker_cpus")) | cpu_set(meta.get("client_cpus"))):
        # e.g. cpu_split on a machine with no core left once the proxies have theirs (2 cores, a
        # pd-proxy target of 2 processes): nothing is kept apart from the proxies.
        line += (" (the proxies share their cores with the workers or the client: with "
                 "--pd-proxy-workers 1 one pd-proxy process and vllm-router get a core to themselves)")
    return line


def cpu_set(text: str | None) -> set[int]:
    """The cores of a taskset list as this tool writes them (``"0,1"``); none for no list."""
    return {int(c) for c in text.split(",") if c.strip()} if text else set()


def default_cpu_split() -> tuple[str | None, str | None]:
    """(proxy cpus, worker+client cpus): the proxies get the last allowed core, the rest the others."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None, None
    return str(cpus[-1]), ",".join(str(c) for c in cpus[:-1])


def cpu_split(max_workers: int) -> tuple[str | None, str | None]:
    """The default pinning. One pd-proxy process: ``default_cpu_split``. Several: every proxy gets
    the same ``max_workers`` last cores (vllm-router's tokio runtime then starts that many worker
    threads: it sizes itself by the cores it may use); workers and client get the rest, or, when
    nothing is left, share every core with the proxies."""
    if max_workers <= 1:
        return default_cpu_split()
    cpus = sorted(os.sched_getaffinity(0))
    proxies = cpus[-max_workers:]
    rest = cpus[: -max_workers] or cpus
    return ",".join(map(str, proxies)), ",".join(map(str, rest))


def parse_args(argv: Sequence[str] | None = None) -> Config:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.compare_routers",
        description="Floor vs pd-proxy vs vllm-router on pd-sim workers; writes results/compare_routers-*/",
    )
    p.add_argument("--quick", action="store_true", help="fewer repetitions and requests (a few minutes)")
    p.add_argument(
        "--targets", default=",".join(TARGETS), help="comma list out of floor,pd-proxy,vllm-router"
    )
    p.add_argument("--concurrency", default="1,64,256")
    p.add_argument("--max-tokens", default="32,256")
    p.add_argument("--modes", default="stream,nonstream")
    p.add_argument(
        "--reps",
        type=int,
        default=None,
        help="repetitions per point (default 5, quick 3; odd, so the median is a run)",
    )
    p.add_argument(
        "--rounds", type=int, default=None, help="requests per run = concurrency x rounds (4; quick 2)"
    )
    p.add_argument(
        "--min-requests",
        type=int,
        default=None,
        help="at least this many per run (128; quick 64: CPU time is counted in 10 ms ticks)",
    )
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--run-time-limit", type=float, default=None, help="seconds per run (120; quick 60)")
    p.add_argument("--request-timeout", type=float, default=60.0)
    p.add_argument("--memory-streams", type=int, default=1000, help="0 skips the memory measurement")
    p.add_argument(
        "--pd-proxy-workers",
        default="1,2",
        help="pd-proxy is run once per N here (--workers N; targets pd-proxy, pd-proxy-w2, ...)",
    )
    p.add_argument(
        "--proxy-cpus",
        default=None,
        help="taskset list for every proxy ('' = no pinning; default: the last core, or every core "
        "when a pd-proxy target runs several processes)",
    )
    p.add_argument(
        "--pinning",
        choices=(*PINNINGS, BOTH),
        default=PINNED,
        help="pinned: proxies, workers and client each on their cores (below); unpinned: no taskset "
        "at all, everything sharing every core as on a real host; both: pinned then unpinned, "
        "reported side by side",
    )
    p.add_argument("--worker-cpus", default=None, help="taskset list for the pd-sim workers")
    p.add_argument("--client-cpus", default=None, help="CPU list this client process pins itself to")
    p.add_argument("--sim-cmd", default=DEFAULT_SIM_CMD)
    p.add_argument("--slow-decode-cmd", default=DEFAULT_SLOW_DECODE_CMD)
    p.add_argument(
        "--pd-proxy-cmd", default=DEFAULT_PD_PROXY_CMD, help="template: {bin} {port} {prefill} {decode}"
    )
    p.add_argument("--router-cmd", default=DEFAULT_ROUTER_CMD)
    p.add_argument("--pd-proxy-args", default="", help="appended to the pd-proxy command, e.g. '--workers 2'")
    p.add_argument("--router-args", default="", help="appended to the vllm-router command")
    p.add_argument("--router-venv", type=Path, default=REPO_ROOT / ".venv-router")
    p.add_argument(
        "--out", type=Path, default=None, help="output folder (default results/compare_routers-<time>)"
    )
    a = p.parse_args(argv)

    def ints(text: str) -> tuple[int, ...]:
        return tuple(int(x) for x in text.split(",") if x.strip())

    targets = tuple(t.strip() for t in a.targets.split(",") if t.strip())
    try:
        pd_workers = sorted(set(ints(a.pd_proxy_workers)))
    except ValueError:
        p.error("--pd-proxy-workers takes a comma list of process counts")
    if not pd_workers or pd_workers[0] < 1:
        p.error("--pd-proxy-workers takes process counts of at least 1")
    expanded: list[str] = []
    for t in targets:
        for name in [pd_proxy_name(n) for n in pd_workers] if t == PD_PROXY else [t]:
            if name not in expanded:
                expanded.append(name)
    targets = tuple(expanded)
    unknown = [t for t in targets if t not in TARGETS and pd_proxy_workers(t) is None]
    if unknown:
        p.error(f"unknown targets {unknown}; choose from {list(TARGETS)} (or pd-proxy-wN)")
    proxy_cpus, worker_cpus = cpu_split(max((pd_proxy_workers(t) or 1) for t in targets))
    if a.proxy_cpus is not None:
        proxy_cpus = a.proxy_cpus
    client_cpus = worker_cpus if a.client_cpus is None else a.client_cpus
    if a.worker_cpus is not None:
        worker_cpus = a.worker_cpus
    modes = tuple(m.strip() for m in a.modes.split(",") if m.strip())
    if any(m not in ("stream", "nonstream") for m in modes):
        p.error("--modes takes stream and/or nonstream")
    if a.pinning == UNPINNED and any((a.proxy_cpus, a.worker_cpus, a.client_cpus)):
        p.error("--pinning unpinned runs nothing under taskset: drop --proxy-cpus, --worker-cpus and "
                "--client-cpus (or use --pinning both)")
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    return Config(
        targets=targets,
        concurrencies=ints(a.concurrency),
        max_tokens=ints(a.max_tokens),
        streams=tuple(m == "stream" for m in modes),
        reps=a.reps if a.reps is not None else (3 if a.quick else 5),
        rounds=a.rounds if a.rounds is not None else (2 if a.quick else 4),
        min_requests=a.min_requests if a.min_requests is not None else (64 if a.quick else 128),
        prompt_len=a.prompt_len,
        run_time_limit_s=a.run_time_limit if a.run_time_limit is not None else (60.0 if a.quick else 120.0),
        request_timeout_s=a.request_timeout,
        memory_streams=a.memory_streams,
        proxy_cpus=proxy_cpus or None,
        worker_cpus=worker_cpus or None,
        client_cpus=client_cpus or None,
        sim_cmd=a.sim_cmd,
        slow_decode_cmd=a.slow_decode_cmd,
        pd_proxy_cmd=f"{a.pd_proxy_cmd} {a.pd_proxy_args}".strip(),
        router_cmd=f"{a.router_cmd} {a.router_args}".strip(),
        router_venv=a.router_venv.resolve(),
        out_dir=a.out if a.out is not None else REPO_ROOT / "results" / f"compare_routers-{stamp}",
        quick=a.quick,
        pinnings=PINNINGS if a.pinning == BOTH else (a.pinning,),
    )


def render(template: str, cfg: Config, **values: object) -> list[str]:
    fields = {
        "bin": str(Path(sys.executable).parent),
        "router_bin": str(cfg.router_venv / "bin"),
        **{k: str(v) for k, v in values.items()},
    }
    return shlex.split(template.format(**fields))


def ensure_router(cfg: Config) -> None:
    subprocess.run(
        ["bash", str(REPO_ROOT / "benchmarks" / "router_env.sh"), str(cfg.router_venv)],
        check=True,
        cwd=REPO_ROOT,
        timeout=900,
    )


def make_prompt(length: int) -> list[int]:
    return [(i * 7919) % 250 + 3 for i in range(length)]


def proxy_argv(name: str, cfg: Config, port: int, prefill: str, decode: str) -> list[str]:
    workers = pd_proxy_workers(name)
    template = cfg.router_cmd if workers is None else cfg.pd_proxy_cmd
    argv = render(template, cfg, port=port, prefill=prefill, decode=decode, aux_port=free_port())
    return argv if workers is None or workers == 1 else [*argv, "--workers", str(workers)]


async def start_proxy(
    procs: list[subprocess.Popen[bytes]],
    name: str,
    cfg: Config,
    *,
    prefill: str,
    decode: str,
    prompt: Sequence[int],
    log_name: str,
) -> tuple[ClientOptions, subprocess.Popen[bytes]]:
    port = free_port()
    proc = start(procs, cfg, log_name, proxy_argv(name, cfg, port, prefill, decode), cfg.proxy_cpus)
    opts = client_options(f"http://127.0.0.1:{port}", cfg.request_timeout_s)
    await wait_serving(log_name, proc, opts, prompt, 60)
    return opts, proc


def sim_argv(template: str, cfg: Config, port: int, role: str) -> list[str]:
    """A pd-sim command whose context fits the prompt and the longest output."""
    room = max(512, cfg.prompt_len + max(max(cfg.max_tokens, default=0), _MEMORY_TOKENS))
    return render(template, cfg, port=port, role=role, max_model_len=room)


async def start_sim(
    procs: list[subprocess.Popen[bytes]], cfg: Config, role: str, template: str, log_name: str
) -> tuple[str, subprocess.Popen[bytes]]:
    port = free_port()
    proc = start(procs, cfg, log_name, sim_argv(template, cfg, port, role), cfg.worker_cpus)
    url = f"http://127.0.0.1:{port}"
    try:
        await wait_ready(url, proc, 60)
    except RuntimeError as e:
        raise RuntimeError(f"{log_name}: {e} (see its log)") from None
    return url, proc


def versions(cfg: Config) -> dict[str, str]:
    out = {"python": platform.python_version(), "aiohttp": aiohttp.__version__}
    with contextlib.suppress(Exception):
        out["vllm-router"] = subprocess.run(
            [
                str(cfg.router_venv / "bin" / "python"),
                "-c",
                "import importlib.metadata as m; print(m.version('vllm-router'))",
            ],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout.strip()
    with contextlib.suppress(Exception):
        out["git"] = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            cwd=REPO_ROOT,
            check=True,
        ).stdout.strip()
    return out


async def run_comparison(cfg: Config, procs: list[subprocess.Popen[bytes]]) -> dict[str, Any]:
    prompt = make_prompt(cfg.prompt_len)
    points = build_points(cfg.concurrencies, cfg.max_tokens, cfg.streams)
    meta: dict[str, Any] = {
        "started_utc": dt.datetime.now(dt.UTC).isoformat(),
        "quick": cfg.quick,
        "pinning": cfg.pinning,
        "targets": list(cfg.targets),
        "reps": cfg.reps,
        "rounds": cfg.rounds,
        "min_requests": cfg.min_requests,
        "prompt_len": cfg.prompt_len,
        "proxy_cpus": cfg.proxy_cpus,
        "worker_cpus": cfg.worker_cpus,
        "client_cpus": cfg.client_cpus,
        "cpu_count": os.cpu_count(),
        "loadavg_start": list(os.getloadavg()),
        "commands": {"sim": cfg.sim_cmd, "pd-proxy": cfg.pd_proxy_cmd, "vllm-router": cfg.router_cmd},
        "versions": versions(cfg),
    }
    prefill_url, prefill_proc = await start_sim(procs, cfg, "prefill", cfg.sim_cmd, "sim-prefill")
    decode_url, decode_proc = await start_sim(procs, cfg, "decode", cfg.sim_cmd, "sim-decode")
    floor = client_options(decode_url, cfg.request_timeout_s, prefill_url=prefill_url)
    await wait_serving("pd-sim workers", decode_proc, floor, prompt, 60)
    targets: dict[str, ClientOptions] = {}
    proxy_pids: dict[str, int] = {}
    failed: dict[str, str] = {}
    for name in cfg.targets:
        if name == FLOOR:
            targets[name] = floor
            continue
        try:
            targets[name], proc = await start_proxy(
                procs, name, cfg, prefill=prefill_url, decode=decode_url, prompt=prompt, log_name=name
            )
        except RuntimeError as e:
            # One target that cannot start must not cost the others their run: say so, go on.
            print(f"WARNING: {e}; {name} is left out of this run", file=sys.stderr, flush=True)
            failed[name] = str(e)
            continue
        proxy_pids[name] = proc.pid
    meta["failed_targets"] = failed
    meta["proxy_idle_rss_kib"] = {n: tree_rss_kib(pid) for n, pid in proxy_pids.items()}
    names = [t for t in cfg.targets if t in targets]

    runs: dict[Point, dict[str, list[RunStats]]] = {}
    plan = list(schedule(points, names, cfg.reps))
    for i, (point, rep, name) in enumerate(plan, 1):
        run = await run_load(
            targets[name],
            point,
            prompt=prompt,
            n_requests=requests_per_run(point.concurrency, cfg.rounds, cfg.min_requests),
            time_limit_s=cfg.run_time_limit_s,
            proxy_pid=proxy_pids.get(name),
            worker_pids=(prefill_proc.pid, decode_proc.pid),
        )
        runs.setdefault(point, {t: [] for t in names})[name].append(run)
        print(f"[{i:3d}/{len(plan)}] {point.label:<22} rep {rep} {name:<12} {run_line(run)}", flush=True)

    memory: dict[str, Any] = {"streams": cfg.memory_streams, "results": []}
    if cfg.memory_streams > 0 and any(is_proxy(t) for t in names):
        proxies = [t for t in names if is_proxy(t)]
        memory["results"] = await run_memory(procs, cfg, proxies, prefill_url, prompt)
    meta["loadavg_end"] = list(os.getloadavg())
    meta["finished_utc"] = dt.datetime.now(dt.UTC).isoformat()
    return build_result(meta, points, runs, memory)


def run_line(run: RunStats) -> str:
    return (
        f"ttft p50 {run.ttft_p50_ms:8.2f} ms  p99 {run.ttft_p99_ms:8.2f} ms  "
        f"{run.tokens_per_s:9.0f} tok/s  {run.requests_per_s:8.1f} req/s  "
        f"{run.proxy_cpu_us_per_request:7.0f} us/req  "
        f"cpu proxy {run.proxy_cpu_util:4.2f} workers {run.workers_cpu_util:4.2f} "
        f"client {run.client_cpu_util:4.2f}  ok {run.ok} err {run.errors}"
        f"{' ' + str(run.error_kinds) if run.error_kinds else ''}"
        f"{'  TIMED OUT' if run.timed_out else ''}"
    )


async def run_memory(
    procs: list[subprocess.Popen[bytes]], cfg: Config, names: Sequence[str], prefill_url: str,
    prompt: Sequence[int],
) -> list[dict[str, Any]]:
    """Memory per open stream of each proxy: a fresh one wired to a decode worker that sends its
    first token at once and the next after minutes, so the streams stay open, idle."""
    slow_url, slow_proc = await start_sim(procs, cfg, "decode", cfg.slow_decode_cmd, "sim-decode-slow")
    results = []
    for name in names:
        opts, proc = await start_proxy(
            procs, name, cfg, prefill=prefill_url, decode=slow_url, prompt=prompt, log_name=f"{name}-memory"
        )
        try:
            res = await measure_stream_memory(
                name, opts.url, pid=proc.pid, n=cfg.memory_streams, prompt=prompt,
                limit_s=cfg.run_time_limit_s,
            )
        finally:
            stop(procs, proc)
        results.append(res)
        print(
            f"memory {name:<12} {res['streams_open']}/{cfg.memory_streams} streams open: "
            f"RSS {res['rss_before_kib']} -> {res['rss_after_kib']} KiB, "
            f"{res['per_stream_kib']:.1f} KiB per open stream",
            flush=True,
        )
    stop(procs, slow_proc)
    return results


# --------------------------------------------------------------------------------------------
# Report: table and plot.


def _fmt(value: Any, spec: str, width: int = 0) -> str:
    text = "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)
    return text.rjust(width)


def format_table(result: Mapping[str, Any]) -> str:
    """Ratios pd-proxy / vllm-router per point, then the absolute numbers behind them."""
    ratio_cols = (
        ("tokens_per_s", "tok/s"),
        ("requests_per_s", "req/s"),
        ("tokens_per_proxy_cpu_s", "tok/cpu-s"),
        ("proxy_cpu_us_per_request", "cpu/req"),
        ("added_ttft_p50_ms", "+ttft50"),
        ("added_ttft_p99_ms", "+ttft99"),
        ("added_ttft_p50_diff_ms", "d50 ms"),
        ("added_ttft_p99_diff_ms", "d99 ms"),
    )
    meta = result.get("meta", {})
    load = " / ".join(" ".join(f"{x:.2f}" for x in meta[k]) for k in ("loadavg_start", "loadavg_end")
                      if meta.get(k))
    lines = [
        describe_pinning(meta) + (f"; load average at start / end: {load}" if load else ""),
        "pd-proxy / vllm-router (throughput ratios: >= 1 meets the target; CPU per request and"
        " added-TTFT ratios: <= 1 does; d50/d99: pd-proxy's added TTFT minus vllm-router's, <= 0 meets"
        " the target)",
        f"{'point':<22}{'proxy':<13}" + "".join(f"{title:>10}" for _, title in ratio_cols),
    ]
    for row in result["ratios"]:
        name = row.get("proxy", PD_PROXY)
        lines.append(
            f"{row['label']:<22}{name:<13}" + "".join(_fmt(row[key], ".2f", 10) for key, _ in ratio_cols)
        )
    lines.append("")
    lines.append(
        "medians per target: added TTFT p50/p99 over the floor (ms) | tokens/s | requests/s | proxy CPU "
        "per request (us) | tokens per proxy CPU-s | CPU use in cores busy (proxy; pd-sim workers and "
        "load client in brackets)"
    )
    for point in result["points"]:
        cells = []
        for name, doc in point["targets"].items():
            m = doc["median"]
            cell = f"{name}: "
            if name != FLOOR:
                added = f"{_fmt(m['added_ttft_p50_ms'], '.2f')}/{_fmt(m['added_ttft_p99_ms'], '.2f')}"
                cell += f"added {added} ms "
            cell += f"{_fmt(m['tokens_per_s'], '.0f')} tok/s {_fmt(m['requests_per_s'], '.1f')} req/s"
            if name != FLOOR:
                cell += f" {_fmt(m.get('proxy_cpu_us_per_request'), '.0f')} us/req"
                cell += f" {_fmt(m['tokens_per_proxy_cpu_s'], '.0f')} tok/cpu-s"
                cell += f" cpu {_fmt(m['proxy_cpu_util'], '.2f')}"
            cell += f" (cpu: workers {_fmt(m['workers_cpu_util'], '.2f')}"
            cell += f" client {_fmt(m['client_cpu_util'], '.2f')})"
            if m["errors"] or m["timed_out"]:
                cell += f" [errors {m['errors']}{', timed out' if m['timed_out'] else ''}]"
            cells.append(cell)
        lines.append(f"{point['label']:<22} " + " | ".join(cells))
    by_proxy = result.get("checks_by_proxy") or ({PD_PROXY: result["checks"]} if result.get("checks") else {})
    for name, checks in by_proxy.items():
        lines.append("")
        lines.append(f"issue targets on this run for {name} (met / failing points):")
        for key, check in checks.items():
            met = {True: "met", False: "MISSED", None: "not judged"}[check["met"]]
            lines.append(f"  {key:<18} {met:<10} {', '.join(check['failing'])}")
    for res in result["memory"].get("results", []):
        lines.append(
            f"memory per open stream {res['target']}: {_fmt(res['per_stream_kib'], '.1f')} KiB "
            f"(RSS {res['rss_before_kib']} -> {res['rss_after_kib']} KiB, "
            f"{res['streams_open']}/{res['streams_requested']} streams open)"
        )
    return "\n".join(lines)


def _num(value: Any) -> float:
    """A number of a JSON-safe document (null was NaN)."""
    return math.nan if value is None else float(value)


def _side(point: Mapping[str, Any] | None, target: str) -> dict[str, float] | None:
    """One target's figures at one point of one mode's run, with its ratios to vllm-router there."""
    if point is None or target not in point["targets"]:
        return None
    m = point["targets"][target]["median"]
    router = point["targets"].get(VLLM_ROUTER, {}).get("median", {})
    cpu, rps = _num(m.get("proxy_cpu_us_per_request")), _num(m.get("requests_per_s"))
    return {
        "proxy_cpu_us_per_request": cpu,
        "requests_per_s": rps,
        "tokens_per_proxy_cpu_s": _num(m.get("tokens_per_proxy_cpu_s")),
        "added_ttft_p50_ms": _num(m.get("added_ttft_p50_ms")),
        "cpu_per_request_vs_router": ratio(cpu, _num(router.get("proxy_cpu_us_per_request"))),
        "requests_per_s_vs_router": ratio(rps, _num(router.get("requests_per_s"))),
    }


def side_by_side(runs: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per point and target, each mode's figures (SIDE_METRICS; None where the mode did not run it)."""
    by_mode = {mode: {p["label"]: p for p in doc["points"]} for mode, doc in runs.items()}
    labels = list(dict.fromkeys(label for points in by_mode.values() for label in points))
    rows: list[dict[str, Any]] = []
    for label in labels:
        targets = {t for points in by_mode.values() if label in points for t in points[label]["targets"]}
        for target in sorted(targets, key=target_rank):
            row: dict[str, Any] = {"label": label, "target": target}
            for mode in PINNINGS:
                row[mode] = _side(by_mode.get(mode, {}).get(label), target)
            rows.append(row)
    return rows


def combine(runs: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """``--pinning both``: one document (BOTH_KEYS) with each mode's run and the rows side by side."""
    meta = {
        "pinning": BOTH,
        "modes": list(runs),
        "loadavg": {mode: [doc["meta"].get("loadavg_start"), doc["meta"].get("loadavg_end")]
                    for mode, doc in runs.items()},
    }
    doc: dict[str, Any] = json_safe({"meta": meta, "runs": dict(runs), "side_by_side": side_by_side(runs)})
    return doc


def format_side_by_side(combined: Mapping[str, Any]) -> str:
    """Pinned and unpinned next to each other: proxy CPU per request and requests/s, with their
    ratios to vllm-router in brackets."""
    lines = [
        "pinned vs unpinned, medians: proxy CPU per request (us) and requests/s; in brackets the ratio "
        "to vllm-router (CPU per request <= 1 and requests/s >= 1 meet the issue's targets)",
        f"{'point':<22}{'target':<13}" + "".join(f"{m + ' us/req':>22}{m + ' req/s':>24}" for m in PINNINGS),
    ]
    for row in combined["side_by_side"]:
        cells = ""
        for mode in PINNINGS:
            side = row[mode] or {}
            cpu = _fmt(side.get("proxy_cpu_us_per_request"), ".0f")
            cpu += f" ({_fmt(side.get('cpu_per_request_vs_router'), '.2f')})"
            rps = _fmt(side.get("requests_per_s"), ".1f")
            rps += f" ({_fmt(side.get('requests_per_s_vs_router'), '.2f')})"
            cells += f"{cpu:>22}{rps:>24}"
        lines.append(f"{row['label']:<22}{row['target']:<13}{cells}")
    for mode, (start, end) in combined["meta"]["loadavg"].items():
        shown = " / ".join(" ".join(f"{x:.2f}" for x in v) for v in (start, end) if v)
        lines.append(f"load average {mode}: {shown} (start / end)")
    return "\n".join(lines)


def make_plot(result: Mapping[str, Any], path: Path) -> None:
    # Imported here: plotting is the last step and matplotlib is slow to import.
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    combos = sorted(
        {(p["stream"], p["max_tokens"]) for p in result["points"]}, key=lambda c: (not c[0], c[1])
    )
    rows = (
        ("tokens_per_s", "tokens/s"),
        ("requests_per_s", "requests/s"),
        ("tokens_per_proxy_cpu_s", "tokens per proxy CPU-second"),
        ("added_ttft_p50_ms", "added TTFT p50 (ms)"),
        ("added_ttft_p99_ms", "added TTFT p99 (ms)"),
    )
    if not combos:
        return
    fig, axes = plt.subplots(
        len(rows), len(combos), figsize=(4.2 * len(combos), 3.0 * len(rows)), squeeze=False
    )
    for j, (stream, max_tokens) in enumerate(combos):
        pts = sorted(
            (p for p in result["points"] if p["stream"] == stream and p["max_tokens"] == max_tokens),
            key=lambda p: p["concurrency"],
        )
        names = sorted({t for p in pts for t in p["targets"]}, key=target_rank)
        palette = sorted({t for p in result["points"] for t in p["targets"]}, key=target_rank)
        for i, (key, title) in enumerate(rows):
            ax = axes[i][j]
            for name in names:
                if name == FLOOR and key in {
                    "added_ttft_p50_ms",
                    "added_ttft_p99_ms",
                    "tokens_per_proxy_cpu_s",
                }:
                    continue
                xs = [p["concurrency"] for p in pts if name in p["targets"]]
                ys = [p["targets"][name]["median"][key] for p in pts if name in p["targets"]]
                color = f"C{palette.index(name)}"  # one colour per target in every panel
                ax.plot(xs, [math.nan if y is None else y for y in ys], marker="o", label=name, color=color)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrent streams")
            ax.set_ylabel(title)
            ax.grid(True, alpha=0.3)
            if i == 0:
                ax.set_title(f"{'stream' if stream else 'non-stream'}, {max_tokens} output tokens")
            if i == 0 and j == 0:
                ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------------------------
# Entry point.


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def resolve_targets(cfg: Config) -> tuple[Config, list[str]]:
    """Drops pd-proxy when its command is not installed (said loudly and recorded)."""
    skipped: list[str] = []
    targets = list(cfg.targets)
    ours = [t for t in targets if pd_proxy_workers(t) is not None]
    if ours:
        exe = render(cfg.pd_proxy_cmd, cfg, port=0, prefill="x", decode="x", aux_port=0)[0]
        if shutil.which(exe) is None:
            print(f"WARNING: {exe} not found: pd-proxy is left out of this run", file=sys.stderr)
            for t in ours:
                targets.remove(t)
                skipped.append(t)
    return replace(cfg, targets=tuple(targets)), skipped


def run_mode(cfg: Config, mode: str, skipped: Sequence[str], all_cpus: set[int]) -> dict[str, Any]:
    """One mode's whole comparison (its processes started and stopped here), written into its folder
    and printed."""
    run_cfg = for_pinning(cfg, mode)
    run_cfg.out_dir.mkdir(parents=True, exist_ok=True)
    # This client too: on its CPU list pinned, back on every core unpinned.
    client = cpu_set(run_cfg.client_cpus) or all_cpus
    os.sched_setaffinity(0, client)
    with processes() as procs:
        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
        result = asyncio.run(run_comparison(run_cfg, procs))
    result["meta"]["skipped_targets"] = list(skipped)
    json_path = run_cfg.out_dir / "result.json"
    json_path.write_text(json.dumps(result, indent=2) + "\n")
    png_path = run_cfg.out_dir / "result.png"
    make_plot(result, png_path)
    print(format_table(result))
    print(f"wrote {json_path} and {png_path}")
    return result


def main(argv: Sequence[str] | None = None) -> int:
    cfg = parse_args(argv)
    if VLLM_ROUTER in cfg.targets:
        ensure_router(cfg)
    cfg, skipped = resolve_targets(cfg)
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    all_cpus = os.sched_getaffinity(0)
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    runs: dict[str, dict[str, Any]] = {}
    try:
        for mode in cfg.pinnings:
            runs[mode] = run_mode(cfg, mode, skipped, all_cpus)
    except KeyboardInterrupt:
        print("interrupted: every process started here was stopped", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
        os.sched_setaffinity(0, all_cpus)
    if len(runs) > 1:
        combined = combine(runs)
        json_path = cfg.out_dir / "result.json"
        json_path.write_text(json.dumps(combined, indent=2) + "\n")
        print(format_side_by_side(combined))
        print(f"wrote {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
