"""Head to head on one P/D pair: pd-proxy (first token from P on and off) against vllm-router.

    python -m benchmarks.real_routers --start-workers real --model .cache/tiny-llama
    python -m benchmarks.real_routers --prefill P_URL --decode D_URL      # a pair already running
    python -m benchmarks.real_routers --workers-state run/pd-workers.json  # ... as pd-workers wrote it

Three targets in front of the same prefill and decode worker: ``pd-proxy`` (``--first-token-from-prefill
on``, the default), ``pd-proxy-off`` (``--first-token-from-prefill off``) and ``vllm-router`` 0.1.17 in
P/D mode (``--policy round_robin``, as ``benchmarks.compare_routers`` starts it; left out with a
message when it is not installed, see ``--install-router``). The workers are either running already
(``--prefill``/``--decode``, ``--workers-state``) or started here (``--start-workers real``: real vLLM
through ``workers.launcher``; ``sim``: pd-sim with GPU-like timings, for tests).

The requests are paired. At each concurrency (``--concurrency``, default 1 and 4) that many lanes run
``--rounds`` rounds each; a round is a triple: one fresh prompt to each target, back to back (each
waits for the one before to end), the order rotated every round (and shifted per lane) so that every
target goes first, second and last equally often. Every prompt is ``--input-len`` random token ids
drawn from a per-run seed, so no request finds another's prompt in a worker's prefix cache, across
targets, rounds or runs; ``--output-len`` tokens with ``ignore_eos``, streamed. A warm-up round per
lane (not counted) opens every connection first.

Per request (pd-bench's client and metric definitions): TTFT, the second token's gap (the hand-off gap:
with the first token from P the second waits for D's KV pull), ITL (mean per request, and every
per-token gap), the mean ITL after the second token, TPOT and E2E. Per target: p50 and p99 of each,
and requests/s as concurrency / mean E2E (what a closed loop of that many clients gets from it; the
targets share the run's wall time). Per pair (the same lane and round): target / vllm-router for TTFT,
TPOT, ITL, ITL after the second token and E2E. At concurrency 1 reported is the median of these
per-pair ratios with its 95% distribution-free interval (order statistics of the binomial, no
resampling: at least 95% coverage for the median whatever the distribution; none below 6 pairs).
Above it the lanes of one round run at the same time, so their pairs are not independent: each round
gives the median of its lanes' pair ratios, and the median and interval are taken over the rounds
(none below 6 rounds). Beside them the workers' own
view: each worker's ``/metrics`` scraped before and after the counted rounds of each concurrency, and
the means of vLLM's queue, prefill, decode, TTFT and inter-token histograms over those requests (every
target's requests together: they are interleaved), with D's prompt tokens by source.

Outputs go to ``--out`` (default ``results/real_routers-<UTC>/``): ``result.json``, ``table.md`` (also
printed), ``requests.jsonl`` (every request's record), ``cdf-c<N>.png`` (TTFT, E2E, ITL, second-token
gap per target) and every process's log. Every process started here is stopped at the end, also on
Ctrl-C, SIGTERM or an error.
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
import random
import secrets
import signal
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from types import FrameType
from typing import Any, Final

import aiohttp

from benchmarks.cancel_bench import find_router, render_argv
from benchmarks.client import ClientOptions, new_session, send_request
from benchmarks.compare_routers import error_kind
from benchmarks.datasets import RequestSpec
from benchmarks.metrics import second_token_gaps, stats, token_itls, tpot
from benchmarks.records import RequestRecord
from benchmarks.report import json_safe
from benchmarks.sim_stack import REPO_ROOT, free_port, processes, start_logged, stop_all, wait_ready

PD_PROXY: Final = "pd-proxy"
PD_PROXY_OFF: Final = "pd-proxy-off"
VLLM_ROUTER: Final = "vllm-router"
TARGETS: Final = (PD_PROXY, PD_PROXY_OFF, VLLM_ROUTER)
BASELINE: Final = VLLM_ROUTER
METRICS: Final = ("ttft", "second_token_gap", "itl", "itl_after_second", "tpot", "e2e")
"""Per-request figures (ms): ``itl`` is the request's mean per-token gap, ``itl_after_second`` the
mean of its gaps after the second token."""
RATIO_METRICS: Final = ("ttft", "tpot", "itl", "itl_after_second", "e2e")
CONFIDENCE: Final = 0.95
TOKEN_LOW: Final = 3
TOKEN_HIGH: Final = 500
"""Prompt token ids are drawn from [TOKEN_LOW, TOKEN_HIGH): ordinary ids of the tiny model (vocab 515)
and valid for pd-sim."""
WORKER_HISTOGRAMS: Final = (
    "vllm:request_queue_time_seconds",
    "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds",
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:e2e_request_latency_seconds",
)
WORKER_COLUMNS: Final = (
    "request_queue_time",
    "request_prefill_time",
    "request_decode_time",
    "time_to_first_token",
    "inter_token_latency",
    "e2e_request_latency",
)
"""The histograms' short names, in the report's column order."""
PROMPT_SOURCES: Final = "vllm:prompt_tokens_by_source_total"
START_REAL: Final = "real"
START_SIM: Final = "sim"

PD_PROXY_CMD: Final = (
    "{python} -m proxy.cli --host 127.0.0.1 --port {port} --prefill {prefill} --decode {decode}"
    " --log-level WARNING --first-token-from-prefill {first_token}"
)
ROUTER_CMD: Final = (
    "{router_bin} --host 127.0.0.1 --port {port} --vllm-pd-disaggregation"
    " --prefill {prefill} --decode {decode} --policy round_robin --log-level warning"
    " --prometheus-port {aux_port}"
)
# pd-sim with GPU-like proportions: a prefill of tens of ms, a hand-off + D's first step of ~10 ms,
# 5 ms a token; nothing queues at these concurrencies.
SIM_CMD: Final = (
    "{python} -m workers.sim.cli --host 127.0.0.1 --port {port} --role {role} --enable-scale-out"
    " --prefill-base-ms 20 --prefill-per-token-ms 0.02 --itl-ms 5 --remote-prefill-step-ms 10"
    " --max-model-len {max_model_len}"
)
READY_TIMEOUT_S: Final = 120.0


# --------------------------------------------------------------------------------------------
# The plan: lanes of rounds, each round a triple in rotating order.


def round_order(targets: Sequence[str], lane: int, rnd: int) -> list[str]:
    """The targets of one round, rotated by round and lane: over ``len(targets)`` consecutive rounds
    of a lane every target takes every position once, and lanes running side by side start with
    different targets."""
    if not targets:
        return []
    k = (rnd + lane) % len(targets)
    return [*targets[k:], *targets[:k]]


def prompts(seed: int, count: int, length: int) -> Iterator[list[int]]:
    """``count`` prompts of ``length`` random token ids from ``seed``: with a fresh seed per run no two
    share a prefix block, within the run or with another run on the same workers."""
    rng = random.Random(seed)
    for _ in range(count):
        yield [rng.randrange(TOKEN_LOW, TOKEN_HIGH) for _ in range(length)]


# --------------------------------------------------------------------------------------------
# Arithmetic: per-request figures, percentiles, per-pair ratios and the median's interval.


@dataclass(frozen=True)
class Sample:
    """One counted request: where it ran in the plan and what it measured (ms; None: not measured)."""

    target: str
    concurrency: int
    lane: int
    round: int
    position: int
    ok: bool
    error: str | None = None
    ttft: float | None = None
    second_token_gap: float | None = None
    itl: float | None = None
    itl_after_second: float | None = None
    tpot: float | None = None
    e2e: float | None = None
    itls: tuple[float, ...] = ()
    """Every per-token gap of the request (ms)."""

    def value(self, metric: str) -> float | None:
        v: float | None = getattr(self, metric)
        return v


def _ms(v: float | None) -> float | None:
    return None if v is None else v * 1000.0


def _mean(values: Sequence[float]) -> float | None:
    return statistics.fmean(values) if values else None


def sample_of(rec: RequestRecord, where: Sample) -> Sample:
    """``where`` (a failed sample naming the request's place in the plan) with what ``rec`` measured."""
    kind = error_kind(rec)
    if kind is not None:
        return replace(where, error=f"{kind}: {rec.error}" if rec.error else kind)
    gaps = token_itls(rec.chunk_times_s, rec.chunk_tokens)
    second = second_token_gaps([rec])
    return replace(
        where,
        ok=True,
        ttft=_ms(rec.ttft_s),
        second_token_gap=_ms(second[0]) if second else None,
        itl=_ms(_mean(gaps)),
        itl_after_second=_ms(_mean(token_itls(rec.chunk_times_s[1:], rec.chunk_tokens[1:]))),
        tpot=_ms(tpot(rec.e2e_s, rec.ttft_s, rec.output_tokens)),
        e2e=_ms(rec.e2e_s),
        itls=tuple(g * 1000.0 for g in gaps),
    )


def median_ranks(n: int, confidence: float = CONFIDENCE) -> tuple[int, int, float] | None:
    """(j, k, coverage): the 1-based order statistics x_(j) <= median <= x_(k) hold the median of the
    distribution with probability ``coverage`` >= ``confidence``, the narrowest symmetric such pair
    (the binomial(n, 1/2) interval); None when even (x_(1), x_(n)) covers less."""
    if n < 1:
        return None
    total = 2**n
    best: tuple[int, int, float] | None = None
    tail = 0  # P(B <= j - 1) * 2^n for B ~ binomial(n, 1/2)
    for j in range(1, n // 2 + 1):
        tail += math.comb(n, j - 1)
        coverage = 1.0 - 2.0 * tail / total  # P(j <= B <= n - j)
        if coverage < confidence:
            break
        best = (j, n - j + 1, coverage)
    return best


def median_interval(values: Sequence[float], confidence: float = CONFIDENCE) -> dict[str, Any]:
    """The median of ``values`` and its distribution-free interval (``median_ranks``)."""
    xs = sorted(v for v in values if math.isfinite(v))
    out: dict[str, Any] = {
        "n": len(xs),
        "median": statistics.median(xs) if xs else None,
        "low": None,
        "high": None,
        "coverage": None,
        "method": "binomial order statistics",
    }
    ranks = median_ranks(len(xs), confidence)
    if ranks is not None:
        j, k, coverage = ranks
        out.update(low=xs[j - 1], high=xs[k - 1], coverage=coverage)
    return out


def pair_ratio_map(samples: Sequence[Sample], target: str, baseline: str,
                   metric: str) -> dict[tuple[int, int, int], float]:
    """target / baseline of ``metric`` by pair (concurrency, lane, round), for every pair where both
    requests succeeded and the baseline's figure is positive."""
    base = {(s.concurrency, s.lane, s.round): s for s in samples if s.target == baseline and s.ok}
    out: dict[tuple[int, int, int], float] = {}
    for s in samples:
        if s.target != target or not s.ok:
            continue
        key = (s.concurrency, s.lane, s.round)
        b = base.get(key)
        num, den = s.value(metric), (b.value(metric) if b is not None else None)
        if num is not None and den is not None and den > 0:
            out[key] = num / den
    return out


def pair_ratios(samples: Sequence[Sample], target: str, baseline: str, metric: str) -> list[float]:
    """The per-pair ratios of ``pair_ratio_map``."""
    return list(pair_ratio_map(samples, target, baseline, metric).values())


def round_ratios(samples: Sequence[Sample], target: str, baseline: str, metric: str) -> list[float]:
    """Per round (concurrency, round): the median of its lanes' pair ratios. The lanes of one round
    run at the same time and share the workers, so their pairs are not independent; the rounds
    (run one after another) are the units the binomial interval may treat as independent."""
    by_round: dict[tuple[int, int], list[float]] = {}
    for (c, _lane, rnd), ratio in pair_ratio_map(samples, target, baseline, metric).items():
        by_round.setdefault((c, rnd), []).append(ratio)
    return [statistics.median(v) for _, v in sorted(by_round.items())]


def ratio_interval(samples: Sequence[Sample], target: str, baseline: str, metric: str,
                   concurrency: int) -> dict[str, Any]:
    """The median ratio and its interval: over pairs at concurrency 1, over the per-round medians
    of the lanes' pair ratios above it (``unit`` says which)."""
    if concurrency > 1:
        return median_interval(round_ratios(samples, target, baseline, metric)) | {"unit": "round"}
    return median_interval(pair_ratios(samples, target, baseline, metric)) | {"unit": "pair"}


def target_summary(samples: Sequence[Sample], concurrency: int) -> dict[str, Any]:
    """One target's figures at one concurrency: p50/p99 per metric (``itl_token``: every per-token
    gap), requests/s = concurrency / mean E2E."""
    ok = [s for s in samples if s.ok]
    out: dict[str, Any] = {"requests": len(samples), "ok": len(ok), "errors": len(samples) - len(ok)}
    errors = sorted({s.error for s in samples if s.error})
    if errors:
        out["error_kinds"] = errors[:5]
    series: dict[str, list[float]] = {m: [v for s in ok if (v := s.value(m)) is not None] for m in METRICS}
    series["itl_token"] = [g for s in ok for g in s.itls]
    for name, values in series.items():
        st = stats(values, (50.0, 99.0))
        out[f"{name}_p50_ms"] = None if st is None else st.percentiles[50.0]
        out[f"{name}_p99_ms"] = None if st is None else st.percentiles[99.0]
    e2e = _mean(series["e2e"])
    out["requests_per_s"] = concurrency / (e2e / 1000.0) if e2e else None
    return out


def level_ratios(samples: Sequence[Sample], targets: Sequence[str], baseline: str,
                 concurrency: int) -> dict[str, Any]:
    """Per target other than the baseline, per metric: ``ratio_interval`` at ``concurrency``."""
    return {
        t: {m: ratio_interval(samples, t, baseline, m, concurrency) for m in RATIO_METRICS}
        for t in targets
        if t != baseline
    }


# --------------------------------------------------------------------------------------------
# The workers' own view: vLLM's histograms between two scrapes.


def scrape_totals(text: str) -> dict[str, float]:
    """``name_sum``/``name_count`` of WORKER_HISTOGRAMS and ``PROMPT_SOURCES{source}``, summed over
    every other label, from one ``/metrics`` page."""
    from prometheus_client.parser import text_string_to_metric_families  # noqa: PLC0415

    wanted = {f"{h}_{part}" for h in WORKER_HISTOGRAMS for part in ("sum", "count")}
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in wanted:
                out[s.name] = out.get(s.name, 0.0) + s.value
            elif s.name == PROMPT_SOURCES:
                key = f"{PROMPT_SOURCES}{{{s.labels.get('source', '')}}}"
                out[key] = out.get(key, 0.0) + s.value
    return out


def worker_view(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, Any]:
    """Mean (ms) and count of each histogram over the requests between the scrapes; prompt tokens by
    source over the same span."""
    out: dict[str, Any] = {}
    for h in WORKER_HISTOGRAMS:
        short = h.removeprefix("vllm:").removesuffix("_seconds")
        count = after.get(f"{h}_count", 0.0) - before.get(f"{h}_count", 0.0)
        total = after.get(f"{h}_sum", 0.0) - before.get(f"{h}_sum", 0.0)
        out[f"{short}_mean_ms"] = total / count * 1000.0 if count > 0 else None
        out[f"{short}_count"] = count
    sources = {k for k in (*before, *after) if k.startswith(PROMPT_SOURCES)}
    out["prompt_tokens_by_source"] = {
        k[len(PROMPT_SOURCES) + 1 : -1]: after.get(k, 0.0) - before.get(k, 0.0) for k in sorted(sources)
    }
    return out


async def scrape(session: aiohttp.ClientSession, url: str) -> dict[str, float] | None:
    """One worker's totals (None: no answer; the report then shows no worker view for it)."""
    try:
        async with session.get(f"{url}/metrics", timeout=aiohttp.ClientTimeout(total=10)) as r:
            if r.status != 200:
                return None
            return scrape_totals(await r.text())
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return None


# --------------------------------------------------------------------------------------------
# The load: lanes of triples.


def new_record(index: int, spec: RequestSpec, target: str) -> RequestRecord:
    return RequestRecord(index, uuid.uuid4().hex, target, len(spec.prompt), spec.output_len)


async def run_lanes(
    session: aiohttp.ClientSession,
    targets: Mapping[str, ClientOptions],
    *,
    concurrency: int,
    rounds: range,
    prompt_source: Iterator[list[int]],
    output_len: int,
    records: list[tuple[Sample, RequestRecord]] | None,
) -> None:
    """``concurrency`` lanes side by side, each running ``rounds``: per round one request to each
    target in ``round_order``, each sent when the one before it ended. Counted when ``records`` is
    given (the samples are appended to it)."""
    names = list(targets)

    async def lane(index: int) -> None:
        for rnd in rounds:
            for position, name in enumerate(round_order(names, index, rnd)):
                spec = RequestSpec(prompt=next(prompt_source), output_len=output_len)
                rec = new_record(rnd, spec, name)
                await send_request(session, targets[name], spec, rec, time.perf_counter())
                if records is not None:
                    where = Sample(target=name, concurrency=concurrency, lane=index, round=rnd,
                                   position=position, ok=False)
                    records.append((sample_of(rec, where), rec))

    await asyncio.gather(*(lane(i) for i in range(concurrency)))


async def run_level(
    targets: Mapping[str, ClientOptions],
    workers: Mapping[str, str],
    *,
    concurrency: int,
    rounds: int,
    warmup_rounds: int,
    prompt_source: Iterator[list[int]],
    output_len: int,
) -> tuple[list[tuple[Sample, RequestRecord]], dict[str, Any]]:
    """One concurrency: the warm-up rounds, a scrape of each worker, the counted rounds, a scrape."""
    counted: list[tuple[Sample, RequestRecord]] = []
    async with new_session() as session:
        await run_lanes(session, targets, concurrency=concurrency, rounds=range(-warmup_rounds, 0),
                        prompt_source=prompt_source, output_len=output_len, records=None)
        before = {role: await scrape(session, url) for role, url in workers.items()}
        t0 = time.perf_counter()
        await run_lanes(session, targets, concurrency=concurrency, rounds=range(rounds),
                        prompt_source=prompt_source, output_len=output_len, records=counted)
        wall = time.perf_counter() - t0
        after = {role: await scrape(session, url) for role, url in workers.items()}
    view: dict[str, Any] = {"wall_s": wall}
    for role in workers:
        b, a = before[role], after[role]
        view[role] = worker_view(b, a) if b is not None and a is not None else None
    return counted, view


# --------------------------------------------------------------------------------------------
# Configuration.


@dataclass(frozen=True)
class Config:
    targets: tuple[str, ...]
    concurrencies: tuple[int, ...]
    rounds: tuple[int, ...]
    warmup_rounds: int
    input_len: int
    output_len: int
    seed: int
    request_timeout_s: float
    out_dir: Path
    prefill: str | None = None
    decode: str | None = None
    start_workers: str | None = None
    model: Path | None = None
    vllm_bin: Path | None = None
    router_bin: str | None = None
    install_router: bool = False
    router_venv: Path = REPO_ROOT / ".venv-router"
    pd_proxy_args: tuple[str, ...] = ()
    router_args: tuple[str, ...] = ()
    sim_cmd: str = SIM_CMD
    plots: bool = True

    def rounds_at(self, concurrency: int) -> int:
        return self.rounds[self.concurrencies.index(concurrency)]


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def read_state(path: Path) -> tuple[str, str]:
    """The first prefill and decode URL of a ``pd-workers`` state file."""
    try:
        state = json.loads(path.read_text())
        return str(state["prefill"][0]), str(state["decode"][0])
    except (OSError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise ValueError(
            f"{path}: not a pd-workers state file with a prefill and a decode worker ({exc})"
        ) from None


def parse_args(argv: Sequence[str] | None = None) -> Config:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.real_routers",
        description="pd-proxy (first token from P on and off) against vllm-router on one P/D pair, in "
        "paired requests; writes results/real_routers-*/",
    )
    where = p.add_argument_group("the workers (one of)")
    where.add_argument("--prefill", help="a running prefill worker's URL (with --decode)")
    where.add_argument("--decode", help="a running decode worker's URL (with --prefill)")
    where.add_argument("--workers-state", type=Path, help="a pd-workers state file (run/pd-workers.json)")
    where.add_argument("--start-workers", choices=(START_REAL, START_SIM),
                       help="start one pair here: real vLLM (workers.launcher; --model) or pd-sim")
    p.add_argument("--model", type=Path, default=Path(".cache/tiny-llama"), help="--start-workers real")
    p.add_argument("--vllm-bin", type=Path, help="--start-workers real: the vLLM executable")
    p.add_argument("--targets", default=",".join(TARGETS), help=f"comma list out of {','.join(TARGETS)}")
    p.add_argument("--concurrency", default="1,4", help="lanes, a comma list (default 1,4)")
    p.add_argument("--rounds", default="30,15",
                   help="counted rounds per lane, one per --concurrency or one for all (default 30,15)")
    p.add_argument("--warmup-rounds", type=int, default=1, help="uncounted rounds per lane first")
    p.add_argument("--input-len", type=int, default=448)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--seed", type=int, default=None, help="prompt seed (default: a fresh one every run)")
    p.add_argument("--request-timeout", type=float, default=120.0)
    p.add_argument("--router-bin", help="vllm-router's executable (default: .venv-router/bin, PATH)")
    p.add_argument("--install-router", action="store_true",
                   help="install vllm-router 0.1.17 first (benchmarks/router_env.sh into --router-venv)")
    p.add_argument("--router-venv", type=Path, default=REPO_ROOT / ".venv-router")
    p.add_argument("--pd-proxy-arg", action="append", default=[], help="one more pd-proxy option (repeated)")
    p.add_argument("--router-arg", action="append", default=[], help="one more vllm-router option (repeated)")
    p.add_argument("--sim-cmd", default=SIM_CMD, help="--start-workers sim: the pd-sim command template")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--out", type=Path, help="output folder (default results/real_routers-<UTC time>)")
    a = p.parse_args(argv)
    given = sum(x is not None for x in (a.prefill or a.decode or None, a.workers_state, a.start_workers))
    if given != 1:
        p.error("give the workers one way: --prefill URL --decode URL, --workers-state or --start-workers")
    if (a.prefill is None) != (a.decode is None):
        p.error("--prefill and --decode go together")
    prefill, decode = a.prefill, a.decode
    if a.workers_state is not None:
        try:
            prefill, decode = read_state(a.workers_state)
        except ValueError as exc:
            p.error(str(exc))
    targets = tuple(t.strip() for t in a.targets.split(",") if t.strip())
    unknown = [t for t in targets if t not in TARGETS]
    if unknown or not targets or len(set(targets)) != len(targets):
        p.error(f"--targets: a comma list out of {','.join(TARGETS)}, each once")
    try:
        concurrencies, rounds = _ints(a.concurrency), _ints(a.rounds)
    except ValueError:
        p.error("--concurrency and --rounds take comma lists of whole numbers")
    if not concurrencies or min(concurrencies) < 1 or len(set(concurrencies)) != len(concurrencies):
        p.error("--concurrency: distinct lane counts of at least 1")
    if len(rounds) == 1:
        rounds = rounds * len(concurrencies)
    if len(rounds) != len(concurrencies) or min(rounds) < 1:
        p.error("--rounds: one count of at least 1 per --concurrency, or one for all")
    if a.warmup_rounds < 0 or a.input_len < 1 or a.output_len < 2:
        p.error("--warmup-rounds >= 0, --input-len >= 1 and --output-len >= 2 (the second token's gap)")
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    return Config(
        targets=targets,
        concurrencies=concurrencies,
        rounds=rounds,
        warmup_rounds=a.warmup_rounds,
        input_len=a.input_len,
        output_len=a.output_len,
        seed=a.seed if a.seed is not None else secrets.randbelow(2**31),
        request_timeout_s=a.request_timeout,
        out_dir=(a.out if a.out is not None else REPO_ROOT / "results" / f"real_routers-{stamp}").absolute(),
        prefill=prefill,
        decode=decode,
        start_workers=a.start_workers,
        model=a.model,
        vllm_bin=a.vllm_bin,
        router_bin=a.router_bin,
        install_router=a.install_router,
        router_venv=a.router_venv.absolute(),
        pd_proxy_args=tuple(a.pd_proxy_arg),
        router_args=tuple(a.router_arg),
        sim_cmd=a.sim_cmd,
        plots=not a.no_plots,
    )


# --------------------------------------------------------------------------------------------
# Processes.


class Stack:
    """The processes of a run: pd-sim workers or a launcher cluster, and the routers. ``stop`` ends
    every one of them (idempotent)."""

    def __init__(self, out_dir: Path, procs: list[subprocess.Popen[bytes]]) -> None:
        self.out_dir = out_dir
        self.procs = procs
        self.cluster: Any = None
        self.prefill = ""
        self.decode = ""
        self.skipped: dict[str, str] = {}

    def start(self, name: str, argv: Sequence[str]) -> subprocess.Popen[bytes]:
        proc = start_logged(argv, self.out_dir / f"{name}.log")
        self.procs.append(proc)
        return proc

    def stop(self) -> None:
        stop_all(self.procs)
        self.procs.clear()
        if self.cluster is not None:
            self.cluster.stop()
            self.cluster = None


async def start_workers(cfg: Config, stack: Stack) -> None:
    if cfg.start_workers is None:
        assert cfg.prefill is not None and cfg.decode is not None
        stack.prefill, stack.decode = cfg.prefill.rstrip("/"), cfg.decode.rstrip("/")
        for url in (stack.prefill, stack.decode):
            await wait_ready(url, None, 30.0)
        return
    if cfg.start_workers == START_REAL:
        from workers.launcher import ClusterSettings, start_cluster  # noqa: PLC0415

        settings = ClusterSettings(model=cfg.model or Path(".cache/tiny-llama"), prefill=1, decode=1,
                                   vllm_bin=cfg.vllm_bin, log_dir=cfg.out_dir / "vllm-logs")
        print("real_routers: starting a real vLLM prefill and decode worker (minutes on CPU)",
              file=sys.stderr, flush=True)
        # Called in the loop's thread on purpose: nothing else runs yet, and Ctrl-C during the
        # (bounded) start-up stops what start_cluster started before it propagates.
        stack.cluster = start_cluster(settings)
        stack.prefill, stack.decode = stack.cluster.prefill_urls[0], stack.cluster.decode_urls[0]
        return
    room = max(512, cfg.input_len + cfg.output_len)
    for role in ("prefill", "decode"):
        port = free_port()
        proc = stack.start(f"sim-{role}", render_argv(cfg.sim_cmd, port=port, role=role, max_model_len=room))
        url = f"http://127.0.0.1:{port}"
        await wait_ready(url, proc, 30.0)
        setattr(stack, role, url)


def target_argv(cfg: Config, name: str, port: int, stack: Stack, router: str | None) -> list[str]:
    if name == VLLM_ROUTER:
        argv = render_argv(ROUTER_CMD, router_bin=router, port=port, prefill=stack.prefill,
                           decode=stack.decode, aux_port=free_port())
        return [*argv, *cfg.router_args]
    first = "off" if name == PD_PROXY_OFF else "on"
    argv = render_argv(PD_PROXY_CMD, port=port, prefill=stack.prefill, decode=stack.decode, first_token=first)
    return [*argv, *cfg.pd_proxy_args]


async def start_targets(cfg: Config, stack: Stack) -> dict[str, ClientOptions]:
    """Every target that starts, by name; one that cannot is left out (said on stderr and kept in
    ``stack.skipped``), the others still run."""
    out: dict[str, ClientOptions] = {}
    for name in cfg.targets:
        router = None
        if name == VLLM_ROUTER:
            router = find_router(cfg.router_bin or _venv_router(cfg))
            if router is None:
                why = ("not installed (looked for --router-bin, .venv-router/bin/vllm-router and vllm-router "
                       "on PATH; --install-router or `bash benchmarks/router_env.sh` installs it): left out")
                print(f"real_routers: vllm-router {why}", file=sys.stderr, flush=True)
                stack.skipped[name] = why
                continue
        port = free_port()
        proc = stack.start(name, target_argv(cfg, name, port, stack, router))
        url = f"http://127.0.0.1:{port}"
        try:
            await wait_ready(url, proc, READY_TIMEOUT_S)
        except RuntimeError as exc:
            print(f"real_routers: {name}: {exc} (see {stack.out_dir / (name + '.log')}): left out",
                  file=sys.stderr, flush=True)
            stack.skipped[name] = str(exc)
            continue
        # No Server-Timing report: it would cost pd-proxy work that vllm-router does not do.
        out[name] = ClientOptions(url=url, request_timeout_s=cfg.request_timeout_s, ask_server_timing=False)
    return out


def _venv_router(cfg: Config) -> str | None:
    candidate = cfg.router_venv / "bin" / "vllm-router"
    return str(candidate) if candidate.is_file() else None


def install_router(cfg: Config) -> None:
    subprocess.run(["bash", str(REPO_ROOT / "benchmarks" / "router_env.sh"), str(cfg.router_venv)],
                   check=True, cwd=REPO_ROOT, timeout=900)


# --------------------------------------------------------------------------------------------
# The run and its report.


def baseline_of(names: Sequence[str]) -> str | None:
    """vllm-router; without it pd-proxy-off (the ratios then say what the first token from P
    changes); None with fewer than two targets."""
    if len(names) < 2:
        return None
    return BASELINE if BASELINE in names else (PD_PROXY_OFF if PD_PROXY_OFF in names else names[-1])


def build_level(concurrency: int, rounds: int, names: Sequence[str], baseline: str | None, *,
                samples: Sequence[Sample], view: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "concurrency": concurrency,
        "rounds": rounds,
        "targets": {t: target_summary([s for s in samples if s.target == t], concurrency) for t in names},
        "ratios": level_ratios(samples, names, baseline, concurrency) if baseline is not None else {},
        "workers": dict(view),
        "requests": [{k: v for k, v in asdict(s).items() if k != "itls"} for s in samples],
    }


Counted = list[tuple[Sample, RequestRecord]]
"""One concurrency's counted requests: each sample with the client's record behind it."""


async def run(cfg: Config, stack: Stack) -> tuple[dict[str, Any], dict[int, Counted]]:
    meta: dict[str, Any] = {
        "started_utc": dt.datetime.now(dt.UTC).isoformat(),
        "targets": list(cfg.targets),
        "concurrencies": list(cfg.concurrencies),
        "rounds": list(cfg.rounds),
        "warmup_rounds": cfg.warmup_rounds,
        "input_len": cfg.input_len,
        "output_len": cfg.output_len,
        "seed": cfg.seed,
        "workers_started": cfg.start_workers,
        "cpu_count": os.cpu_count(),
        "loadavg_start": list(os.getloadavg()),
        "interval": f"{CONFIDENCE:.0%} binomial order-statistic interval, over pairs at concurrency 1 and "
        "over the per-round medians of the lanes' pair ratios above it (the lanes of one round run "
        "together: their pairs are not independent)",
        "versions": versions(cfg),
    }
    await start_workers(cfg, stack)
    meta["prefill"], meta["decode"] = stack.prefill, stack.decode
    if stack.cluster is not None:
        meta["workers_startup_s"] = stack.cluster.startup_seconds
    targets = await start_targets(cfg, stack)
    names = list(targets)
    baseline = baseline_of(names)
    meta.update(skipped_targets=dict(stack.skipped), run_targets=names, baseline=baseline)
    if baseline is not None and baseline != BASELINE:
        print(f"real_routers: no {BASELINE}: the ratios are against {baseline}", file=sys.stderr, flush=True)
    total = sum((r + cfg.warmup_rounds) * c for c, r in zip(cfg.concurrencies, cfg.rounds, strict=True))
    source = prompts(cfg.seed, total * max(len(names), 1), cfg.input_len)
    levels: list[dict[str, Any]] = []
    raw: dict[int, Counted] = {}
    workers = {"prefill": stack.prefill, "decode": stack.decode}
    for c in cfg.concurrencies if names else ():
        rounds = cfg.rounds_at(c)
        print(f"real_routers: concurrency {c}: {c} lane(s) x {rounds} round(s) x {len(names)} targets",
              file=sys.stderr, flush=True)
        counted, view = await run_level(targets, workers, concurrency=c, rounds=rounds,
                                        warmup_rounds=cfg.warmup_rounds, prompt_source=source,
                                        output_len=cfg.output_len)
        raw[c] = counted
        levels.append(build_level(c, rounds, names, baseline, samples=[s for s, _ in counted], view=view))
    meta["loadavg_end"] = list(os.getloadavg())
    meta["finished_utc"] = dt.datetime.now(dt.UTC).isoformat()
    result: dict[str, Any] = json_safe({"meta": meta, "levels": levels})
    return result, raw


def versions(cfg: Config) -> dict[str, str]:
    out = {"python": platform.python_version(), "aiohttp": aiohttp.__version__}
    with contextlib.suppress(Exception):
        out["git"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                    timeout=10, cwd=REPO_ROOT, check=True).stdout.strip()
    return out


def _f(v: Any, spec: str = ".1f") -> str:
    return "-" if v is None or (isinstance(v, float) and not math.isfinite(v)) else format(v, spec)


def _ratio_cell(doc: Mapping[str, Any]) -> str:
    if doc.get("median") is None:
        return "-"
    if doc.get("low") is None:
        return f"{doc['median']:.2f}x (n {doc['n']})"
    return f"{doc['median']:.2f}x [{doc['low']:.2f}, {doc['high']:.2f}] (n {doc['n']})"


def ratio_heading(concurrency: int, baseline: Any) -> str:
    if concurrency > 1:
        return (f"Ratios to {baseline}, per round (the median of the round's {concurrency} lanes' pair "
                "ratios: lanes of one round run together, so their pairs are not independent): median "
                "of the rounds [95% interval over rounds] (rounds)")
    return f"Per-pair ratios to {baseline}: median [95% interval] (pairs)"


def format_table(result: Mapping[str, Any]) -> str:
    """The markdown report: per concurrency the targets' percentiles, the ratios (per pair at 1, per
    round above) with their intervals, and the workers' own means."""
    meta = result["meta"]
    lines = [
        f"# pd-proxy against vllm-router on one P/D pair ({meta.get('started_utc', '')})",
        "",
        f"{meta['input_len']} random prompt tokens, {meta['output_len']} output tokens (ignore_eos), "
        f"seed {meta['seed']}; workers: prefill {meta.get('prefill')}, decode {meta.get('decode')}"
        f"{' (started here: ' + meta['workers_started'] + ')' if meta.get('workers_started') else ''}.",
    ]
    if meta.get("interval"):
        lines.append(f"Ratios to {meta.get('baseline')}: the median and its {meta['interval']}.")
    for name, why in (meta.get("skipped_targets") or {}).items():
        lines.append(f"Left out: {name}: {why}.")
    metric_cols = (("ttft", "TTFT"), ("second_token_gap", "2nd-token gap"), ("itl_token", "ITL/token"),
                   ("itl_after_second", "ITL after 2nd"), ("tpot", "TPOT"), ("e2e", "E2E"))
    for level in result["levels"]:
        c = level["concurrency"]
        lines += ["", f"## concurrency {c} ({c} lane(s) x {level['rounds']} rounds, ms, p50 / p99)", ""]
        lines.append("| target | ok | " + " | ".join(t for _, t in metric_cols) + " | req/s |")
        lines.append("| --- | --- | " + " | ".join("---" for _ in metric_cols) + " | --- |")
        for name, doc in level["targets"].items():
            cells = [f"{_f(doc[f'{k}_p50_ms'])} / {_f(doc[f'{k}_p99_ms'])}" for k, _ in metric_cols]
            lines.append(f"| {name} | {doc['ok']}/{doc['requests']} | " + " | ".join(cells)
                         + f" | {_f(doc['requests_per_s'], '.2f')} |")
        if level["ratios"]:
            lines += ["", ratio_heading(c, meta.get("baseline")), ""]
            lines.append("| target | TTFT | TPOT | ITL | ITL after 2nd | E2E |")
            lines.append("| --- | --- | --- | --- | --- | --- |")
            for name, docs in level["ratios"].items():
                lines.append(f"| {name} | " + " | ".join(_ratio_cell(docs[m]) for m in RATIO_METRICS) + " |")
        rows = [(role, view) for role, view in level["workers"].items() if isinstance(view, dict)]
        if rows:
            lines += ["", "The workers' own view over the counted rounds (every target's requests; "
                      "mean ms):", ""]
            heads = ("worker", "requests", "queue", "prefill", "decode", "TTFT", "ITL", "E2E",
                     "prompt tokens by source")
            lines += ["| " + " | ".join(heads) + " |", "|" + " --- |" * len(heads)]
            for role, v in rows:
                src = ", ".join(f"{k} {n:g}" for k, n in v["prompt_tokens_by_source"].items()) or "-"
                means = [_f(v[f"{h}_mean_ms"]) for h in WORKER_COLUMNS]
                count = _f(v["e2e_request_latency_count"], "g")
                lines.append(f"| {role} | {count} | " + " | ".join(means) + f" | {src} |")
    return "\n".join(lines)


def plot_levels(raw: Mapping[int, Sequence[tuple[Sample, RequestRecord]]], out_dir: Path) -> list[Path]:
    from benchmarks.plots import plot_metric_cdfs  # noqa: PLC0415 (matplotlib only when plotting)

    paths = []
    for c, counted in raw.items():
        samples = [s for s, _ in counted if s.ok]
        names = list(dict.fromkeys(s.target for s in samples))
        panels: dict[str, dict[str, list[float]]] = {}
        for title, metric in (("TTFT", "ttft"), ("E2E", "e2e"), ("second-token gap", "second_token_gap")):
            panels[title] = {t: [v for s in samples if s.target == t and (v := s.value(metric)) is not None]
                             for t in names}
        panels["ITL (every per-token gap)"] = {t: [g for s in samples if s.target == t for g in s.itls]
                                              for t in names}
        paths.append(plot_metric_cdfs(panels, out_dir / f"cdf-c{c}.png", f"concurrency {c}"))
    return paths


def write_outputs(cfg: Config, result: Mapping[str, Any],
                  raw: Mapping[int, Sequence[tuple[Sample, RequestRecord]]]) -> list[Path]:
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    paths = [cfg.out_dir / "result.json", cfg.out_dir / "table.md", cfg.out_dir / "requests.jsonl"]
    paths[0].write_text(json.dumps(result, indent=2) + "\n")
    paths[1].write_text(format_table(result) + "\n")
    with paths[2].open("w") as fh:
        for counted in raw.values():
            for s, rec in counted:
                where = {k: getattr(s, k) for k in ("target", "concurrency", "lane", "round", "position")}
                fh.write(json.dumps(json_safe(where | rec.to_json())) + "\n")
    if cfg.plots and any(raw.values()):
        paths += plot_levels(raw, cfg.out_dir)
    return paths


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: Sequence[str] | None = None) -> int:
    cfg = parse_args(argv)
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    if cfg.install_router and VLLM_ROUTER in cfg.targets:
        install_router(cfg)
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        with processes() as procs:
            stack = Stack(cfg.out_dir, procs)
            try:
                result, raw = asyncio.run(run(cfg, stack))
            finally:
                stack.stop()
    except KeyboardInterrupt:
        print("real_routers: interrupted: every process started here was stopped", file=sys.stderr)
        return 130
    except RuntimeError as exc:  # the workers did not start or answer (the launcher's LaunchError too)
        print(f"real_routers: {exc}; every process started here was stopped", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)
    paths = write_outputs(cfg, result, raw)
    print(format_table(result))
    print("wrote " + ", ".join(str(p) for p in paths))
    failed = sum(doc["errors"] for level in result["levels"] for doc in level["targets"].values())
    return 0 if result["levels"] and failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
