"""KV probes (``--kv-probe URL``): how long a worker keeps the KV of cancelled requests.

A probe polls one worker every ``interval_s`` during a run and after it, until the worker is back
at its idle level (or ``free_timeout_s`` passed). Two sources, chosen by asking the worker:

* ``sim-state``: pd-sim's ``GET /sim/state``. Blocks held in total, and per request (the prompt's
  blocks while it is prefilled or decoded, then the blocks under a P/D lease until the decode side
  pulls them, the lease expires or an abort frees them), matched to pd-bench's request ids. Every
  cancel is attributed, under any load.
* ``metrics``: any vLLM's ``GET /metrics``: ``vllm:kv_cache_usage_perc`` times the usable blocks
  (``num_gpu_blocks`` - 1 of ``vllm:cache_config_info``; usage is left a fraction when the worker
  does not say). The total only: a cancel is attributed when no other request of the run was in
  flight from its send until the worker was back at its idle level (``--kv-settle`` with
  ``--max-concurrency 1`` makes every cancel so).

Per cancelled request (analysis is pure, :func:`analyse`): **cancel-to-free**, from the cancel
to the first poll at which the request holds nothing on the worker (for good); and **stranded KV**,
the block-seconds it held after its cancel. Only polls at or after the cancel count: a cancel whose
blocks no later poll saw counts as freed at once (``cancels_holding`` counts the others). Polls
bound both figures: each is good to one interval.
For the run: the block-seconds held over the idle level, and the **drain**, from the end of the
run's last request (no client waits for anything after it) until the worker is idle again, with
the block-seconds held meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import math
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import aiohttp

SIM_STATE: Final = "sim-state"
METRICS: Final = "metrics"
USAGE_METRIC: Final = "vllm:kv_cache_usage_perc"
CACHE_INFO_METRIC: Final = "vllm:cache_config_info"
_SAMPLE_RE: Final = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(?:[^"}]|"(?:[^"\\]|\\.)*")*\})?\s+(\S+)')
_LABEL_RE: Final = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


class ProbeError(RuntimeError):
    """A probe URL that answers neither as pd-sim nor with vLLM's KV usage metric."""


@dataclass(frozen=True, slots=True)
class KvSample:
    """One poll: seconds since the run's start, KV held (blocks, or a fraction when the worker's
    block count is unknown), and per request (``sim-state`` only) the blocks of each of ours."""

    t: float
    held: float
    per_request: dict[str, int] | None = None


def parse_metrics(text: str) -> tuple[float | None, int | None]:
    """(``vllm:kv_cache_usage_perc`` summed over engines, usable blocks from ``cache_config_info``)."""
    usage: float | None = None
    blocks = 0
    seen_blocks = False
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE_RE.match(line)
        if m is None:
            continue
        name = m.group(1)
        if name == USAGE_METRIC:
            with contextlib.suppress(ValueError):
                usage = (usage or 0.0) + float(m.group(3))
        elif name == CACHE_INFO_METRIC and m.group(2):
            labels = dict(_LABEL_RE.findall(m.group(2)))
            with contextlib.suppress(KeyError, ValueError):
                blocks += int(labels["num_gpu_blocks"]) - 1  # vLLM's usage leaves out the null block
                seen_blocks = True
    return usage, (blocks if seen_blocks and blocks > 0 else None)


def sim_state_holdings(
    state: dict[str, Any], id_pattern: re.Pattern[str] | None
) -> tuple[int, dict[str, int]]:
    """Blocks used in total and per pd-bench request id, from pd-sim's ``/sim/state``."""
    total = int(state.get("kv_blocks_used") or 0)
    per: dict[str, int] = {}
    if id_pattern is None:
        return total, per
    entries = [*(state.get("inflight") or []), *(state.get("kv_held") or [])]
    for entry in entries:
        if not isinstance(entry, dict):
            continue
        blocks = entry.get("blocks")
        if not isinstance(blocks, int) or blocks <= 0:
            continue
        for key in ("request_id", "remote_request_id"):
            value = entry.get(key)
            m = id_pattern.search(value) if isinstance(value, str) else None
            if m is not None:
                per[m.group(0)] = per.get(m.group(0), 0) + blocks
                break
    return total, per


class KvProbe:
    """Polls one worker in the background; see the module docstring."""

    def __init__(
        self,
        url: str,
        session: aiohttp.ClientSession,
        *,
        interval_s: float = 0.02,
        id_pattern: re.Pattern[str] | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.session = session
        self.interval_s = interval_s
        self.id_pattern = id_pattern
        self.source: str | None = None
        self.total_blocks: int | None = None
        self.samples: list[KvSample] = []
        self.errors = 0
        self.t0 = time.perf_counter()
        self._task: asyncio.Task[None] | None = None
        self._timeout = aiohttp.ClientTimeout(total=max(2.0, 10 * interval_s))

    async def detect(self) -> None:
        """Pick the source: pd-sim's state when the worker has it, else vLLM's metrics."""
        with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
            async with self.session.get(f"{self.url}/sim/state", timeout=self._timeout) as r:
                if r.status == 200:
                    state = json.loads(await r.read())
                    if isinstance(state, dict) and isinstance(state.get("kv_blocks_used"), int):
                        self.source = SIM_STATE
                        return
        try:
            async with self.session.get(f"{self.url}/metrics", timeout=self._timeout) as r:
                text = await r.text() if r.status == 200 else ""
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise ProbeError(f"KV probe {self.url}: no answer ({type(exc).__name__})") from None
        usage, blocks = parse_metrics(text)
        if usage is None:
            raise ProbeError(
                f"KV probe {self.url}: neither pd-sim's /sim/state nor {USAGE_METRIC} in /metrics"
            )
        self.source = METRICS
        self.total_blocks = blocks

    @property
    def unit(self) -> str:
        return "blocks" if self.source == SIM_STATE or self.total_blocks is not None else "fraction"

    async def read(self) -> KvSample | None:
        t = time.perf_counter() - self.t0
        try:
            if self.source == SIM_STATE:
                async with self.session.get(f"{self.url}/sim/state", timeout=self._timeout) as r:
                    state = json.loads(await r.read())
                total, per = sim_state_holdings(state, self.id_pattern)
                return KvSample(t, float(total), per)
            async with self.session.get(f"{self.url}/metrics", timeout=self._timeout) as r:
                usage, _ = parse_metrics(await r.text())
        except (aiohttp.ClientError, TimeoutError, ValueError):
            self.errors += 1
            return None
        if usage is None:
            self.errors += 1
            return None
        return KvSample(t, usage * self.total_blocks if self.total_blocks else usage)

    async def _poll(self) -> None:
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        while True:
            sample = await self.read()
            if sample is not None:
                self.samples.append(sample)
            next_at = max(next_at + self.interval_s, loop.time())
            await asyncio.sleep(next_at - loop.time())

    def start(self, t0: float) -> None:
        self.t0 = t0
        self._task = asyncio.create_task(self._poll())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    @property
    def tolerance(self) -> float:
        return 0.5 if self.unit == "blocks" else 1e-6

    async def wait_until_idle(self, idle: float, timeout_s: float, tracked: Sequence[str] = ()) -> bool:
        """Until a sample at the idle level (and, with per-request data, none of ``tracked``
        holding anything) comes in; False after ``timeout_s``."""
        deadline = time.perf_counter() + timeout_s
        seen = len(self.samples)
        while time.perf_counter() < deadline:
            for s in self.samples[seen:]:
                if s.held <= idle + self.tolerance and not (
                    s.per_request and any(s.per_request.get(r, 0) for r in tracked)
                ):
                    return True
            seen = len(self.samples)
            await asyncio.sleep(self.interval_s)
        return False


# ------------------------------------------------------------------------------- analysis


@dataclass(frozen=True, slots=True)
class Interval:
    """A request of the run: its id, when it was sent and ended (seconds since the start), and
    when it was cancelled (None: not cancelled)."""

    request_id: str
    start: float
    end: float
    cancel: float | None = None


@dataclass(slots=True)
class CancelFree:
    request_id: str
    cancel: float
    attributed: bool
    held_after_cancel: bool = False
    freed: float | None = None  # None: still held when the observation ended
    stranded_block_s: float = 0.0

    @property
    def cancel_to_free_s(self) -> float | None:
        return None if self.freed is None else max(0.0, self.freed - self.cancel)


@dataclass(slots=True)
class KvReport:
    url: str
    source: str
    unit: str
    total_blocks: int | None
    idle: float
    peak: float
    observed_s: float
    samples: int
    errors: int
    held_over_idle_block_s: float
    drain_s: float | None
    drain_block_s: float
    cancels: list[CancelFree] = field(default_factory=list)

    def to_json(self, percentiles: Sequence[float]) -> dict[str, Any]:
        from benchmarks.metrics import stats, stats_keys  # noqa: PLC0415

        holding = [c for c in self.cancels if c.attributed and c.held_after_cancel]
        freed = [c.cancel_to_free_s for c in holding if c.cancel_to_free_s is not None]
        out: dict[str, Any] = {
            "url": self.url,
            "source": self.source,
            "unit": self.unit,
            "total_blocks": self.total_blocks,
            "idle": self.idle,
            "peak": self.peak,
            "observed_s": self.observed_s,
            "samples": self.samples,
            "errors": self.errors,
            "held_over_idle_block_s": self.held_over_idle_block_s,
            "drain_s": self.drain_s,
            "drain_block_s": self.drain_block_s,
            "cancels": len(self.cancels),
            "cancels_attributed": sum(1 for c in self.cancels if c.attributed),
            "cancels_holding": len(holding),
            "not_freed": sum(1 for c in holding if c.freed is None),
            # freed only after a second or more (or never): a lease that ran out, not a release
            "held_over_1s": sum(1 for c in holding if (c.cancel_to_free_s or math.inf) >= 1.0),
            "stranded_block_s": sum(c.stranded_block_s for c in holding),
            "stranded_block_s_per_cancel": (
                sum(c.stranded_block_s for c in holding) / len(holding) if holding else None
            ),
            "cancel_to_free_max_ms": max(freed) * 1000.0 if freed else None,
            # every cancel a poll saw holding KV: when (ms since the run began), how long to the free
            "holding": [
                {
                    "request_id": c.request_id,
                    "cancel_ms": c.cancel * 1000.0,
                    "cancel_to_free_ms": None if c.cancel_to_free_s is None else c.cancel_to_free_s * 1000.0,
                    "stranded_block_s": c.stranded_block_s,
                }
                for c in holding
            ],
        }
        out.update(stats_keys("cancel_to_free", stats(freed, percentiles), percentiles))
        return out


def _integral(samples: Sequence[KvSample], lo: float, hi: float, level: float = 0.0) -> float:
    """Held above ``level`` times time over [lo, hi], each sample holding until the next one."""
    return _area([(s.t, s.held - level) for s in samples], lo, hi)


def _area(points: Sequence[tuple[float, float]], lo: float, hi: float) -> float:
    total = 0.0
    for (t0, v), (t1, _) in itertools.pairwise(points):
        x0, x1 = max(t0, lo), min(t1, hi)
        if x1 > x0 and v > 0:
            total += v * (x1 - x0)
    return total


def _free_after(points: Sequence[tuple[float, float]], cancel: float, tol: float) -> CancelFree:
    """When what ``points`` (time, held above idle) shows was freed for good after ``cancel``: the
    poll after the last one holding anything. Only polls at or after the cancel count (a poll
    before it cannot tell a free just before the cancel from one just after): a cancel counts as
    holding KV when a later poll still saw it, and its stranded block-seconds run from that poll."""
    out = CancelFree("", cancel, attributed=True)
    after = [(t, v) for t, v in points if t >= cancel]
    held = [i for i, (_, v) in enumerate(after) if v > tol]
    if not held:
        out.freed = cancel
        return out
    out.held_after_cancel = True
    last = held[-1]
    out.freed = after[last + 1][0] if last + 1 < len(after) else None
    stop = out.freed if out.freed is not None else after[-1][0]
    out.stranded_block_s = _area(after, cancel, stop)
    return out


def _per_request_free(samples: Sequence[KvSample], rid: str, cancel: float) -> CancelFree:
    points = [(s.t, float((s.per_request or {}).get(rid, 0))) for s in samples]
    out = _free_after(points, cancel, 0.0)
    out.request_id = rid
    return out


def _aggregate_free(
    samples: Sequence[KvSample], iv: Interval, others: Sequence[Interval], idle: float, tol: float
) -> CancelFree:
    """Without per-request data the worker's total stands for the request's own holding; that is
    only true while nobody else of the run is in flight (``attributed``)."""
    assert iv.cancel is not None
    nxt = min((o.start for o in others if o.start > iv.start), default=float("inf"))
    points = [(s.t, s.held - idle) for s in samples if s.t < nxt]
    out = _free_after(points, iv.cancel, tol)
    out.request_id = iv.request_id
    end = out.freed if out.freed is not None else (points[-1][0] if points else iv.cancel)
    out.attributed = bool(points) and not any(o.start < end and o.end > iv.start for o in others)
    return out


def analyse(
    samples: Sequence[KvSample],
    intervals: Sequence[Interval],
    *,
    url: str = "",
    source: str = SIM_STATE,
    unit: str = "blocks",
    total_blocks: int | None = None,
    errors: int = 0,
    tolerance: float = 0.5,
) -> KvReport:
    """The probe's figures for one run (see the module docstring). Samples before 0 (the run's
    start) give the idle level."""
    pre = [s.held for s in samples if s.t < 0]
    idle = min(pre) if pre else (min(s.held for s in samples) if samples else 0.0)
    run = [s for s in samples if s.t >= 0]
    observed = run[-1].t if run else 0.0
    last_end = max((iv.end for iv in intervals), default=0.0)
    drain_s: float | None = None
    for s in samples:
        if s.t >= last_end and s.held <= idle + tolerance:
            drain_s = s.t - last_end
            break
    report = KvReport(
        url=url,
        source=source,
        unit=unit,
        total_blocks=total_blocks,
        idle=idle,
        peak=max((s.held for s in run), default=idle),
        observed_s=observed,
        samples=len(samples),
        errors=errors,
        held_over_idle_block_s=_integral(samples, 0.0, observed, idle),
        drain_s=drain_s,
        drain_block_s=_integral(samples, last_end, observed, idle),
    )
    per_request = source == SIM_STATE
    for iv in intervals:
        if iv.cancel is None:
            continue
        if per_request:
            report.cancels.append(_per_request_free(samples, iv.request_id, iv.cancel))
        else:
            others = [o for o in intervals if o.request_id != iv.request_id]
            report.cancels.append(_aggregate_free(samples, iv, others, idle, tolerance))
    return report
