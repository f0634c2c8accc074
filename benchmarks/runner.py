"""Runs: one benchmark, a sweep over loads, a two-target comparison. The Python API of pd-bench."""

from __future__ import annotations

import asyncio
import json
import math
import re
import secrets
import statistics
import sys
import time
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Final, TextIO, TypeVar

import aiohttp

from benchmarks.cancel import CancelConfig, cancel_plans, ttft_penalty
from benchmarks.client import (
    GENERATE_PATH,
    OPENAI_PATHS,
    CancelPlan,
    ClientOptions,
    endpoint,
    new_session,
    send_request,
)
from benchmarks.datasets import DatasetConfig, RequestSpec, build_dataset
from benchmarks.kvprobe import Interval, KvProbe, ProbeError, analyse
from benchmarks.loadgen import (
    RAMP_UP_STRATEGIES,
    Job,
    Progress,
    arrival_offsets,
    drive,
    ramp_up_offsets,
    ramp_up_rates,
)
from benchmarks.metrics import DEFAULT_PERCENTILES, LATENCY_METRICS, check_metric_names, compute_metrics
from benchmarks.records import RequestRecord
from benchmarks.report import (
    compare_ratios,
    compare_table,
    detailed_fields,
    json_safe,
    safe_stem,
    summary_table,
    write_result,
)

T = TypeVar("T")

BACKEND: Final = "pd-generate"
DEFAULT_ID_PREFIX: Final = "pdbench-"
READY_RETRY_S: Final = 5.0
CALIBRATION_REQUESTS: Final = 3
"""Warm-up requests a before-first-token run without a baseline sends at least (their TTFT is the
reference its cancel moments are drawn from)."""


class ConfigError(ValueError):
    """A benchmark configuration that cannot run."""


class TargetNotReady(RuntimeError):
    """``--ready-check-timeout-sec`` passed without one successful request."""


@dataclass(frozen=True, slots=True)
class RampUp:
    """vLLM's ``--ramp-up-strategy`` with ``--ramp-up-start-rps`` and ``--ramp-up-end-rps``."""

    strategy: str
    start_rps: float
    end_rps: float


@dataclass(frozen=True, slots=True)
class BenchConfig:
    """Everything one ``pd-bench run`` needs."""

    url: str
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    api_key: str | None = None
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    stream: bool = True
    output_mode: str = "tokens"
    goodput_ms: dict[str, float] = field(default_factory=dict)
    percentiles: tuple[float, ...] = DEFAULT_PERCENTILES
    percentile_metrics: tuple[str, ...] = LATENCY_METRICS
    warmup: int = 0
    time_limit_s: float | None = None
    request_timeout_s: float = 300.0
    server_timing: bool = True
    result_dir: str | None = None
    label: str | None = None
    save_detailed: bool = False
    plots: bool = True
    progress: bool = True
    # vLLM's options
    endpoint_path: str = GENERATE_PATH
    headers: tuple[tuple[str, str], ...] = ()
    ignore_eos: bool = True
    model_id: str | None = None
    tokenizer_id: str | None = None
    metadata: tuple[tuple[str, str], ...] = ()
    ramp_up: RampUp | None = None
    ready_check_timeout_s: float = 0.0
    save_result: bool = False
    result_filename: str | None = None
    request_id_prefix: str = DEFAULT_ID_PREFIX
    # the two-hop floor: (prefill URL, decode URL); ``url`` is then the decode worker
    two_hop: tuple[str, str] | None = None
    # cancellation and KV probes
    cancel: CancelConfig | None = None
    kv_probes: tuple[str, ...] = ()
    kv_probe_interval_s: float = 0.02
    kv_free_timeout_s: float = 60.0
    kv_settle: bool = False
    # compare: each target sends its own vLLM cache_salt (warm-ups included), so that targets sharing
    # workers (two proxies in front of one pool) do not serve each other's prompts from the prefix cache
    salt_per_target: bool = False

    def check(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ConfigError(f"url must start with http:// or https://: {self.url!r}")
        if not self.request_rate > 0:
            raise ConfigError("request rate must be positive (inf for all at once)")
        if not self.burstiness > 0:
            raise ConfigError("burstiness must be positive")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ConfigError("max concurrency must be at least 1")
        if self.output_mode not in ("tokens", "text"):
            raise ConfigError("output mode must be tokens or text")
        if self.warmup < 0:
            raise ConfigError("warmup must be >= 0")
        if self.time_limit_s is not None and not self.time_limit_s > 0:
            raise ConfigError("time limit must be positive")
        if not self.request_timeout_s > 0:
            raise ConfigError("request timeout must be positive")
        if any(not 0 <= p <= 100 for p in self.percentiles) or not self.percentiles:
            raise ConfigError("percentiles must be within 0..100")
        try:
            check_metric_names(self.percentile_metrics)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if self.ramp_up is not None:
            if not math.isinf(self.request_rate):
                raise ConfigError(
                    "When using ramp-up, do not specify --request-rate. The request rate will be "
                    "controlled by ramp-up parameters. Please remove the --request-rate argument."
                )
            r = self.ramp_up
            if r.strategy not in RAMP_UP_STRATEGIES:
                raise ConfigError(f"ramp-up strategy must be one of {', '.join(RAMP_UP_STRATEGIES)}")
            if not 0 < r.start_rps <= r.end_rps:
                raise ConfigError("ramp-up needs 0 < --ramp-up-start-rps <= --ramp-up-end-rps")
        if self.ready_check_timeout_s < 0:
            raise ConfigError("ready check timeout must be >= 0")
        if not self.endpoint_path.startswith("/"):
            raise ConfigError(f"endpoint must be a path starting with /: {self.endpoint_path!r}")
        if self.endpoint_path in OPENAI_PATHS and self.two_hop is not None:
            raise ConfigError("--two-hop sends generate requests; it does not go with an OpenAI --endpoint")
        if self.endpoint_path in OPENAI_PATHS and self.cancel is not None and self.cancel.mode == "abort":
            raise ConfigError(
                "cancel mode abort names generate request ids; use disconnect on an OpenAI --endpoint"
            )
        if not re.fullmatch(r"[A-Za-z0-9._:-]*", self.request_id_prefix):
            raise ConfigError("request id prefix may hold letters, digits and . _ : - only")
        if self.two_hop is not None and any(
            not u.startswith(("http://", "https://")) for u in self.two_hop
        ):
            raise ConfigError("--two-hop URLs must start with http:// or https://")
        if self.cancel is not None:
            problems = self.cancel.problems()
            if problems:
                raise ConfigError("; ".join(problems))
        if not self.kv_probe_interval_s > 0 or not self.kv_free_timeout_s >= 0:
            raise ConfigError("the KV probe interval must be positive and the free timeout >= 0")
        if self.kv_settle and not self.kv_probes:
            raise ConfigError("--kv-settle needs at least one --kv-probe")

    def client_options(self, url: str | None = None) -> ClientOptions:
        two_hop = self.two_hop
        return ClientOptions(
            url=url or self.url,
            api_key=self.api_key,
            stream=self.stream,
            output_mode=self.output_mode,
            request_timeout_s=self.request_timeout_s,
            ask_server_timing=self.server_timing and two_hop is None,
            endpoint_path=self.endpoint_path,
            headers=self.headers,
            ignore_eos=self.ignore_eos,
            prefill_url=two_hop[0] if two_hop is not None else None,
        )

    @property
    def cancelling(self) -> bool:
        return self.cancel is not None and self.cancel.rate > 0


@dataclass(slots=True)
class BenchResult:
    """One run: the result JSON (``data``), the per-request records, and the files written.
    A cancellation run keeps its baseline run (the same requests, none cancelled) in ``baseline``."""

    config: BenchConfig
    data: dict[str, Any]
    records: list[RequestRecord]
    files: dict[str, Path] = field(default_factory=dict)
    baseline: BenchResult | None = None


@dataclass(slots=True)
class SweepResult:
    load_name: str
    loads: list[float]
    points: list[BenchResult]
    files: dict[str, Path] = field(default_factory=dict)


@dataclass(slots=True)
class CompareResult:
    urls: list[str]
    results: list[BenchResult]
    ratios: dict[str, float | None]
    files: dict[str, Path] = field(default_factory=dict)


def summary_text(result: BenchResult | SweepResult | CompareResult) -> str:
    """The terminal summary (plus where the files went)."""
    if isinstance(result, SweepResult):
        parts = [summary_text(p) for p in result.points]
        head = (
            f"{'load':>10}{'ok':>6}{'fail':>6}{'TTFT p50':>10}{'TTFT p99':>10}"
            f"{'ITL p50':>9}{'TPOT p50':>10}{'tok/s':>10}"
        )
        rows = [head]
        for load, p in zip(result.loads, result.points, strict=True):
            d = p.data
            rows.append(
                f"{load:>10g}{d['completed']:>6}{d['failed']:>6}"
                + "".join(
                    f"{_num(d.get(k)):>{w}}"
                    for k, w in (
                        ("median_ttft_ms", 10),
                        ("p99_ttft_ms", 10),
                        ("median_itl_ms", 9),
                        ("median_tpot_ms", 10),
                        ("output_throughput", 10),
                    )
                )
            )
        rows.extend(f"{k}: {v}" for k, v in result.files.items())
        parts.append(f"{' sweep over ' + result.load_name + ' ':=^72}\n" + "\n".join(rows))
        return "\n\n".join(parts)
    if isinstance(result, CompareResult):
        text = compare_table(result.urls, [r.data for r in result.results])
        files = [f"{k}: {v}" for r in result.results for k, v in r.files.items()]
        files += [f"{k}: {v}" for k, v in result.files.items()]
        return text + ("\n" + "\n".join(files) if files else "")
    text = summary_table(result.data, title=f"pd-bench {result.data.get('label') or ''}".strip())
    if result.files:
        text += "\n" + "\n".join(f"{k}: {v}" for k, v in result.files.items())
    return text


def _num(v: Any) -> str:
    return "-" if not isinstance(v, int | float) else f"{v:.2f}"


def _schedule(
    specs: Sequence[RequestSpec], cfg: BenchConfig, n_targets: int
) -> tuple[list[Job], list[float]]:
    """Jobs in send order, and the arrival rate in force for each. With several targets every
    request goes to each, interleaved (the pair order alternates), on one schedule at ``n_targets``
    times the rate."""
    n = len(specs) * n_targets
    if specs and specs[0].arrival_s is not None:
        base = [s.arrival_s or 0.0 for s in specs]
        offsets = [t for t in base for _ in range(n_targets)]
        rates = [math.nan] * n
    elif cfg.ramp_up is not None:
        r = cfg.ramp_up
        rates = ramp_up_rates(n, r.strategy, r.start_rps * n_targets, r.end_rps * n_targets)
        offsets = ramp_up_offsets(rates, cfg.burstiness, cfg.dataset.seed)
    else:
        offsets = arrival_offsets(n, cfg.request_rate * n_targets, cfg.burstiness, cfg.dataset.seed)
        rates = [cfg.request_rate * n_targets] * n
    jobs: list[Job] = []
    for i, spec in enumerate(specs):
        order = list(range(n_targets)) if i % 2 == 0 else list(reversed(range(n_targets)))
        for k, target in enumerate(order):
            pos = i * n_targets + k
            jobs.append(Job(index=i, target=target, spec=spec, offset_s=offsets[pos]))
    return jobs, rates


def _rps_change_events(cfg: BenchConfig, jobs: Sequence[Job], rates: Sequence[float],
                       started: datetime) -> list[dict[str, Any]]:
    """vLLM's ``rps_change_events`` of a ramp: each whole rate reached, and when it was."""
    if cfg.ramp_up is None:
        return []
    last = int(cfg.ramp_up.start_rps)
    events = [{"rps": last, "timestamp": started.isoformat()}]
    for job, rate in zip(jobs, rates, strict=False):
        if int(rate) > last:
            stamp = (started + timedelta(seconds=job.offset_s)).isoformat()
            events.extend({"rps": v, "timestamp": stamp} for v in range(last + 1, int(rate) + 1))
            last = int(rate)
    return events


def _metadata(cfg: BenchConfig, url: str, label: str, started: datetime) -> dict[str, Any]:
    """vLLM's run keys in vLLM's order (``--metadata`` pairs after ``num_prompts``), then pd-bench's."""
    ds = cfg.dataset
    out: dict[str, Any] = {
        "date": started.strftime("%Y%m%d-%H%M%S"),
        "endpoint_type": BACKEND,
        "backend": BACKEND,
        "label": label,
        "model_id": cfg.model_id,
        "tokenizer_id": cfg.tokenizer_id,
        "num_prompts": ds.num_requests,
    }
    out.update(dict(cfg.metadata))
    out["request_rate"] = cfg.request_rate if math.isfinite(cfg.request_rate) else "inf"
    out["burstiness"] = cfg.burstiness
    out["max_concurrency"] = cfg.max_concurrency
    if cfg.ramp_up is not None:
        out["ramp_up_strategy"] = cfg.ramp_up.strategy
        out["ramp_up_start_rps"] = cfg.ramp_up.start_rps
        out["ramp_up_end_rps"] = cfg.ramp_up.end_rps
    out.update(
        {
            "base_url": url if cfg.two_hop is None else f"two-hop {cfg.two_hop[0]} -> {cfg.two_hop[1]}",
            "endpoint": endpoint(url, cfg.endpoint_path),
            "dataset_name": ds.name,
            "input_len": ds.input_len,
            "output_len": ds.output_len,
            "range_ratio": ds.range_ratio,
            "seed": ds.seed,
            "stream": cfg.stream,
            "output_mode": cfg.output_mode,
            "warmup": cfg.warmup,
            "time_limit": cfg.time_limit_s,
            "percentiles": list(cfg.percentiles),
            "percentile_metrics": list(cfg.percentile_metrics),
        }
    )
    if cfg.cancel is not None:
        c = cfg.cancel
        out.update(
            cancel_rate=c.rate, cancel_at=c.at, cancel_after_s=c.after_s, cancel_mode=c.mode,
            cancel_baseline=c.baseline and cfg.cancelling,
        )
    return out


def _shaped_like(specs: Sequence[RequestSpec], n: int, cfg: BenchConfig, salt: int) -> list[RequestSpec]:
    """``n`` requests of the shapes of the first ones of ``specs``, with fresh random token ids
    (nothing they compute can be a prefix-cache hit for the measured requests)."""
    if not specs or n <= 0:
        return []
    ds = replace(cfg.dataset, name="random", path=None, num_requests=1, range_ratio=0.0,
                 random_prefix_len=0, seed=cfg.dataset.seed + salt)
    out: list[RequestSpec] = []
    for i in range(n):
        shape = specs[i % len(specs)]
        (one,) = build_dataset(replace(ds, input_len=len(shape.prompt), output_len=shape.output_len,
                                       seed=ds.seed + i))
        out.append(one)
    return out


async def _ready_check(session: aiohttp.ClientSession, cfg: BenchConfig, url: str,
                       specs: Sequence[RequestSpec], tag: str) -> None:
    """vLLM's ``--ready-check-timeout-sec``: a test request until one succeeds (every 5 s)."""
    (spec,) = _shaped_like(specs, 1, cfg, 104729)
    deadline = time.perf_counter() + cfg.ready_check_timeout_s
    attempt = 0
    last = "no attempt"
    while True:
        rec = RequestRecord(0, f"{cfg.request_id_prefix}{tag}-ready-{attempt}", url, len(spec.prompt),
                            spec.output_len)
        await send_request(session, cfg.client_options(url), spec, rec, 0.0)
        if rec.success:
            return
        last = rec.error or "failed"
        attempt += 1
        left = deadline - time.perf_counter()
        if left <= 0:
            raise TargetNotReady(
                f"{url} not ready after {cfg.ready_check_timeout_s:g} s (last error: {last})"
            )
        await asyncio.sleep(min(READY_RETRY_S, left))


async def _warmup(
    session: aiohttp.ClientSession,
    cfg: BenchConfig,
    urls: Sequence[str],
    tag: str,
    *,
    specs: Sequence[RequestSpec],
    n: int,
    salts: Sequence[str | None],
) -> list[RequestRecord]:
    """``n`` uncounted requests per target (vLLM's ``--num-warmups``: at most ``--max-concurrency``
    at a time), shaped like the first requests of the run with fresh prompts; each target's with
    its ``salts`` entry."""
    if n <= 0:
        return []
    sem = asyncio.Semaphore(cfg.max_concurrency or n)

    async def one(i: int, spec: RequestSpec, url: str, salt: str | None) -> RequestRecord:
        rec = RequestRecord(i, f"{cfg.request_id_prefix}{tag}-warmup-{i}", url, len(spec.prompt),
                            spec.output_len)
        async with sem:
            return await send_request(session, replace(cfg.client_options(url), cache_salt=salt), spec,
                                      rec, 0.0)

    warm = _shaped_like(specs, n, cfg, 7919)
    return list(await asyncio.gather(
        *(one(i, s, u, salt) for i, s in enumerate(warm) for u, salt in zip(urls, salts, strict=True))
    ))


def _salts(cfg: BenchConfig, tag: str, n_targets: int) -> list[str | None]:
    """Each target's vLLM ``cache_salt``: with ``salt_per_target`` one per target; a cancellation
    run one of its own (its baseline run has another), so that neither finds the other's prompts in
    a worker's prefix cache; else none."""
    base = f"{cfg.request_id_prefix}{tag}"
    if cfg.salt_per_target:
        return [f"{base}-t{t}" for t in range(n_targets)]
    return [base if cfg.cancel is not None else None] * n_targets


def _id_pattern(cfg: BenchConfig, tag: str) -> re.Pattern[str]:
    return re.compile(re.escape(f"{cfg.request_id_prefix}{tag}-") + r"\d+-\d+(?!\d)")


async def _start_probes(cfg: BenchConfig, session: aiohttp.ClientSession, tag: str) -> list[KvProbe]:
    probes: list[KvProbe] = []
    for url in cfg.kv_probes:
        probe = KvProbe(url, session, interval_s=cfg.kv_probe_interval_s, id_pattern=_id_pattern(cfg, tag))
        try:
            await probe.detect()
        except ProbeError as exc:
            raise ConfigError(str(exc)) from None
        probes.append(probe)
    return probes


def _idle_level(probe: KvProbe) -> float:
    pre = [s.held for s in probe.samples if s.t < 0]
    return min(pre) if pre else 0.0


async def _run_targets(
    cfg: BenchConfig,
    urls: Sequence[str],
    err: TextIO | None,
    *,
    specs: Sequence[RequestSpec] | None = None,
    baseline: BenchResult | None = None,
) -> list[BenchResult]:
    cfg.check()
    if (cfg.kv_probes or cfg.cancelling) and len(urls) != 1:
        raise ConfigError("cancellation and KV probes run against one target (pd-bench run)")
    specs = list(specs) if specs is not None else build_dataset(cfg.dataset)
    started = datetime.now(UTC)
    run_tag = f"{started:%H%M%S}{secrets.token_hex(3)}"  # unique ids across runs
    jobs, rates = _schedule(specs, cfg, len(urls))
    salts = _salts(cfg, run_tag, len(urls))
    opts = [replace(cfg.client_options(u), cache_salt=salt) for u, salt in zip(urls, salts, strict=True)]
    plans: dict[int, CancelPlan] = {}
    probe_session = aiohttp.ClientSession() if cfg.kv_probes else None
    try:
        async with new_session() as session:
            if cfg.ready_check_timeout_s > 0:
                for url in urls:
                    await _ready_check(session, cfg, url, specs, run_tag)
            calibrate = cfg.cancelling and cfg.cancel is not None and cfg.cancel.needs_ttft_reference
            n_warm = max(cfg.warmup, CALIBRATION_REQUESTS if calibrate and baseline is None else 0)
            warm = await _warmup(session, cfg, urls, run_tag, specs=specs, n=n_warm, salts=salts)
            if cfg.cancelling and cfg.cancel is not None:
                ref = (
                    {r.index: r.ttft_s for r in baseline.records if r.success and r.ttft_s is not None}
                    if baseline is not None
                    else {}
                )
                warm_ttfts = [r.ttft_s for r in warm if r.success and r.ttft_s is not None]
                default = statistics.median(warm_ttfts) if warm_ttfts else (
                    statistics.median(ref.values()) if ref else None
                )
                try:
                    plans = cancel_plans(cfg.cancel, specs, cfg.dataset.seed, ref, default)
                except ValueError as exc:
                    raise ConfigError(f"{exc} (the warm-up requests failed)") from None
            probes = await _start_probes(cfg, probe_session, run_tag) if probe_session is not None else []
            t0 = time.perf_counter() + 3 * cfg.kv_probe_interval_s if probes else time.perf_counter()
            for probe in probes:
                probe.start(t0)
            if probes:  # a few polls before the start give the workers' idle level
                await asyncio.sleep(max(0.0, t0 - time.perf_counter()))

            async def send(job: Job, t0: float) -> RequestRecord:
                if cfg.kv_settle:
                    for probe in probes:
                        await probe.wait_until_idle(_idle_level(probe), cfg.kv_free_timeout_s)
                rec = RequestRecord(
                    index=job.index,
                    request_id=f"{cfg.request_id_prefix}{run_tag}-{job.target}-{job.index}",
                    target=urls[job.target],
                    prompt_len=len(job.spec.prompt),
                    requested_output_len=job.spec.output_len,
                    scheduled_s=job.offset_s,
                )
                return await send_request(session, opts[job.target], job.spec, rec, t0,
                                          cancel=plans.get(job.index))

            progress = Progress(len(jobs), stream=err) if cfg.progress else None
            cpu0 = time.process_time()
            try:
                records, duration = await drive(
                    jobs, send, cfg.max_concurrency, cfg.time_limit_s, progress, t0=t0
                )
                client_cpu = time.process_time() - cpu0
                tracked = [r.request_id for r in records if r.cancelled]
                for probe in probes:  # watch the workers until they are idle (or the timeout)
                    await probe.wait_until_idle(_idle_level(probe), cfg.kv_free_timeout_s, tracked)
            finally:
                for probe in probes:
                    await probe.stop()
    finally:
        if probe_session is not None:
            await probe_session.close()
    results: list[BenchResult] = []
    base_label = cfg.label or f"{cfg.dataset.name}-{cfg.dataset.input_len}x{cfg.dataset.output_len}"
    for t, url in enumerate(urls):
        label = base_label if len(urls) == 1 else f"{base_label}-t{t}"
        recs = [r for j, r in zip(jobs, records, strict=False) if j.target == t]
        _check_ids(recs)
        data = _metadata(cfg, url, label, started)
        data.update(
            compute_metrics(
                recs,
                duration if len(urls) == 1 else _span(recs),
                cfg.percentiles,
                cfg.goodput_ms,
                metrics=cfg.percentile_metrics,
                cancellation=cfg.cancel is not None,
            )
        )
        events = _rps_change_events(cfg, jobs, rates, started)
        if events:
            data["rps_change_events"] = events
        # Is the harness itself the bottleneck? CPU of this whole process during the run, over its
        # duration (1.0 = one core busy all along: measured times are then late).
        data["client_cpu_seconds"] = client_cpu
        data["client_cpu_utilization"] = client_cpu / duration if duration > 0 else None
        if probes:
            intervals = [
                Interval(r.request_id, r.start_s, r.start_s + _elapsed(r),
                         None if r.cancel_s is None else r.start_s + r.cancel_s)
                for r in recs
            ]
            data["kv_probes"] = [
                analyse(p.samples, intervals, url=p.url, source=p.source or "", unit=p.unit,
                        total_blocks=p.total_blocks, errors=p.errors, tolerance=p.tolerance
                        ).to_json(cfg.percentiles)
                for p in probes
            ]
        if cfg.save_detailed:
            data.update(detailed_fields(recs))
        results.append(BenchResult(config=replace(cfg, url=url), data=data, records=recs))
    return results


def _elapsed(r: RequestRecord) -> float:
    """How long the request was in flight (its cancel or its end; the timeout when unknown)."""
    if r.e2e_s is not None:
        return r.e2e_s
    if r.cancel_s is not None:
        return r.cancel_s
    return 0.0


def _span(recs: Sequence[RequestRecord]) -> float:
    """One target's share of a compare run: its first send to its last answer."""
    if not recs:
        return 0.0
    return max(r.start_s + (r.e2e_s or 0.0) for r in recs) - min(r.start_s for r in recs)


def _check_ids(recs: Sequence[RequestRecord]) -> None:
    """Join pd-proxy's timings by request id: keep them only when the answer names our request."""
    for r in recs:
        if (
            r.server_timing is not None
            and r.server_request_id is not None
            and r.server_request_id.removeprefix("generate-tokens-") != r.request_id
        ):
            r.server_timing = None


def vllm_result_filename(cfg: BenchConfig, date: str) -> str:
    """vLLM's default result file name: ``{label}-{rate}qps[-concurrency{N}]-{model}-{date}.json``."""
    label = cfg.label or BACKEND
    model = (cfg.model_id or BACKEND).rstrip("/").split("/")[-1]
    conc = f"-concurrency{cfg.max_concurrency}" if cfg.max_concurrency is not None else ""
    if cfg.ramp_up is not None:
        r = cfg.ramp_up
        return (f"{label}-ramp-up-{r.strategy}-{r.start_rps:g}qps-{r.end_rps:g}qps{conc}-{model}-"
                f"{date}.json")
    return f"{label}-{float(cfg.request_rate)}qps{conc}-{model}-{date}.json"


def _write(result: BenchResult, result_dir: Path | None, stem: str, plots: bool) -> None:
    """The result JSON (``--save-result``: where vLLM puts it; else ``result_dir/stem.json``), and
    with a ``result_dir`` the per-request JSONL and the plots beside it."""
    cfg = result.config
    if cfg.save_result:
        name = cfg.result_filename or vllm_result_filename(cfg, result.data["date"])
        jpath = Path(cfg.result_dir or ".") / name
    elif result_dir is not None:
        jpath = result_dir / f"{stem}.json"
    else:
        return
    jpath.parent.mkdir(parents=True, exist_ok=True)
    jpath.write_text(json.dumps(json_safe(result.data), indent=2) + "\n", encoding="utf-8")
    result.files["result_json"] = jpath
    if result_dir is None:
        return
    out_stem = jpath.name.removesuffix(".json")
    _, lpath = write_result(jpath.parent, out_stem, result.data, result.records, json_too=False)
    result.files["records_jsonl"] = lpath
    if plots:
        from benchmarks.plots import plot_cdfs, plot_hops  # noqa: PLC0415  (matplotlib only for plots)

        result.files["cdf_png"] = plot_cdfs(
            {result.data["label"]: result.records}, jpath.parent / f"{out_stem}-cdf.png"
        )
        hop = plot_hops([result.data["label"]], [result.data], jpath.parent / f"{out_stem}-hops.png")
        if hop is not None:
            result.files["hops_png"] = hop


async def arun_benchmark(config: BenchConfig, err: TextIO | None = None) -> BenchResult:
    """Run one benchmark against ``config.url``; write files when ``config.result_dir`` is set
    (or ``config.save_result``). With cancellation (and its baseline, on by default) the same
    requests first run without cancellations, then with them; the result compares the two."""
    config.check()
    specs = build_dataset(config.dataset)
    baseline: BenchResult | None = None
    if config.cancelling and config.cancel is not None and config.cancel.baseline:
        base_cfg = replace(
            config, cancel=replace(config.cancel, rate=0.0), label=f"{config.label or 'run'}-baseline",
            save_result=False,
        )
        (baseline,) = await _run_targets(base_cfg, [config.url], err, specs=specs)
    (result,) = await _run_targets(config, [config.url], err, specs=specs, baseline=baseline)
    if baseline is not None:
        result.baseline = baseline
        result.data.update(ttft_penalty(result.records, baseline.records, config.percentiles))
        result.data["baseline"] = {
            k: v for k, v in baseline.data.items() if not isinstance(v, list) or k == "kv_probes"
        }
    if config.result_dir or config.save_result:
        stem = safe_stem(f"{result.data['label']}-{result.data['date']}")
        _write(result, Path(config.result_dir) if config.result_dir else None, stem, config.plots)
    return result


async def arun_sweep(
    config: BenchConfig,
    rates: Sequence[float] = (),
    concurrencies: Sequence[int] = (),
    err: TextIO | None = None,
) -> SweepResult:
    """One run per request rate or per concurrency (not both), then the load plots."""
    if bool(rates) == bool(concurrencies):
        raise ConfigError("a sweep needs either request rates or concurrencies")
    if rates and any(not r > 0 for r in rates):
        raise ConfigError("request rates must be positive")
    load_name = "request rate (req/s)" if rates else "max concurrency"
    loads = [float(x) for x in (rates or concurrencies)]
    points: list[BenchResult] = []
    for load in loads:
        if rates:
            cfg = replace(config, request_rate=load, label=f"{config.label or 'sweep'}-rate{load:g}")
        else:
            cfg = replace(
                config, max_concurrency=int(load), label=f"{config.label or 'sweep'}-conc{int(load)}"
            )
        points.append(await arun_benchmark(cfg, err))
    sweep = SweepResult(load_name=load_name, loads=loads, points=points)
    if config.result_dir:
        d = Path(config.result_dir)
        stem = safe_stem(f"{config.label or 'sweep'}-{points[0].data['date']}")
        summary = [
            {"load": load, **{k: v for k, v in p.data.items() if not isinstance(v, list)}}
            for load, p in zip(loads, points, strict=True)
        ]
        spath = d / f"{stem}-sweep.json"
        spath.write_text(json.dumps(json_safe(summary), indent=2) + "\n", encoding="utf-8")
        sweep.files["sweep_json"] = spath
        if config.plots:
            from benchmarks.plots import plot_cdfs, plot_hops, plot_sweep  # noqa: PLC0415

            sweep.files["sweep_png"] = plot_sweep(
                loads, [p.data for p in points], load_name, d / f"{stem}-sweep.png"
            )
            sweep.files["sweep_cdf_png"] = plot_cdfs(
                {f"{load:g}": p.records for load, p in zip(loads, points, strict=True)},
                d / f"{stem}-sweep-cdf.png",
            )
            hop = plot_hops([f"{x:g}" for x in loads], [p.data for p in points], d / f"{stem}-sweep-hops.png")
            if hop is not None:
                sweep.files["sweep_hops_png"] = hop
    return sweep


async def arun_compare(config: BenchConfig, urls: Sequence[str], err: TextIO | None = None) -> CompareResult:
    """The same requests to every target, interleaved; ratios are target 1 over target 0."""
    if len(urls) != 2:
        raise ConfigError("compare needs exactly two --url")
    results = await _run_targets(replace(config, url=urls[0]), list(urls), err)
    comp = CompareResult(
        urls=list(urls), results=results, ratios=compare_ratios(results[0].data, results[1].data)
    )
    if config.result_dir:
        d = Path(config.result_dir)
        for r in results:
            _write(r, d, safe_stem(f"{r.data['label']}-{r.data['date']}"), plots=False)
        if config.plots:
            from benchmarks.plots import plot_cdfs, plot_hops  # noqa: PLC0415

            stem = safe_stem(
                f"{results[0].data['label'].removesuffix('-t0')}-compare-{results[0].data['date']}"
            )
            comp.files["compare_cdf_png"] = plot_cdfs(
                {u: r.records for u, r in zip(urls, results, strict=True)}, d / f"{stem}-cdf.png"
            )
            hop = plot_hops(
                [f"t{i}" for i in range(len(urls))], [r.data for r in results], d / f"{stem}-hops.png"
            )
            if hop is not None:
                comp.files["compare_hops_png"] = hop
    return comp


def demo_config(
    url: str, result_dir: str | None = "results/demo", api_key: str | None = None, num_requests: int = 16
) -> BenchConfig:
    """A short run sized for the CPU stack (tiny model, max_model_len 512): ``num_requests`` of
    200 prompt tokens and 16 output tokens, two in flight, one warm-up, plots in ``result_dir``.
    Inside a running event loop: ``summary_text(await arun_benchmark(demo_config(url)))``."""
    return BenchConfig(
        url=url,
        api_key=api_key,
        dataset=DatasetConfig(num_requests=num_requests, input_len=200, output_len=16, seed=0),
        max_concurrency=2,
        warmup=1,
        result_dir=result_dir,
        label="demo",
    )


def _no_loop() -> None:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return
    raise RuntimeError("an event loop is running: await arun_benchmark/arun_sweep/arun_compare instead")


def _run(coro: Coroutine[Any, Any, T]) -> T:
    """Run on uvloop when installed (its I/O path costs the client less: measured 0.41 against
    0.68 ms from write to first chunk on a zero-latency pd-sim), else on asyncio's loop."""
    _no_loop()
    try:
        import uvloop  # noqa: PLC0415
    except ImportError:  # pragma: no cover
        return asyncio.run(coro)
    result: T = uvloop.run(coro)
    return result


def run_benchmark(config: BenchConfig, err: TextIO | None = None) -> BenchResult:
    """Synchronous entry for scripts (``make demo``, the CLI): ``arun_benchmark`` on uvloop."""
    return _run(arun_benchmark(config, err if err is not None else sys.stderr))


def run_sweep(
    config: BenchConfig,
    rates: Sequence[float] = (),
    concurrencies: Sequence[int] = (),
    err: TextIO | None = None,
) -> SweepResult:
    return _run(arun_sweep(config, rates, concurrencies, err))


def run_compare(config: BenchConfig, urls: Sequence[str], err: TextIO | None = None) -> CompareResult:
    return _run(arun_compare(config, urls, err))
