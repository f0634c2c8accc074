"""Soak: pd-proxy under high concurrency for a bounded time, with pd-sim faults switched on and
off, watching for leaks.

    python -m benchmarks.soak --duration 600 --concurrency 128 [--interval 10] [--out soak.json]

Starts on 127.0.0.1 only: ``--prefill-workers`` + ``--decode-workers`` ``pd-sim`` processes and
one ``pd-proxy`` process (their command lines; ports chosen by the OS). Clients loop until the
duration ends: most read their answer (streams and not), some disconnect mid-stream, some abort
through the abort endpoint. Every ``--fault-period`` seconds a random fault goes on for half the
period on a random worker (5xx, hang before/after headers, no KV params, refused KV pulls, reset
or error mid-stream, slow chunks), then off.

Every ``--interval`` seconds it records, from the proxy's ``GET /debug/runtime`` and the client
side: proxy RSS, the Python objects the proxy's collector tracks, pending asyncio tasks, upstream
connections (in use / idle), requests in flight, outcomes and the p99 latency of the requests
completed in that window. After the load stops it lets the world settle (in-flight requests end,
idle keep-alive connections and KV leases expire) and takes a final sample.

Verdict (exit status 1 when any fails): RSS growth from the first sample after warm-up to the
final one within ``--max-rss-growth-mib``; the Python objects still reachable (counted after a
full collection, ``/debug/runtime?collect=1``) at the end within ``--max-object-growth`` of their
count before the load (the warm caches and the start-up work of the first requests are in it; a
leak of an object per request is not); pending tasks back to the pre-load baseline (+ a small
slack); no upstream connection in use and at most two idle per worker (the health probes keep
some); nothing in flight; no KV held on any worker. ``--proxy-arg`` passes an option to pd-proxy
(``--proxy-arg=--log-level=debug``).
Writes the JSON record (``--out``) and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import socket
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

GENERATE = "/inference/v1/generate"
ABORT = "/inference/v1/abort_requests"
_READY_TIMEOUT_S = 30.0

SIM_TIMING = ("--itl-ms", "4", "--prefill-base-ms", "2", "--prefill-per-token-ms", "0.01",
              "--transfer-per-block-ms", "0.05", "--max-model-len", "1024", "--lease-seconds", "5")
PROXY_TIMEOUTS = ("--prefill-timeout", "3", "--decode-timeout", "30", "--stream-idle-timeout", "3",
                  "--connect-timeout", "2", "--lease-duration", "5",
                  "--kv-block-size", "16", "--drain-timeout", "5")

PREFILL_FAULTS: tuple[dict[str, Any], ...] = (
    {"fail_next": 25, "fail_status": 503}, {"drop_kv_params": True}, {"hang_before_headers": True},
    {"refuse_kv_pulls": True}, {"hang_after_headers": True},
)
DECODE_FAULTS: tuple[dict[str, Any], ...] = (
    {"fail_next": 25, "fail_status": 500}, {"reset_after_tokens": 10}, {"error_after_tokens": 10},
    {"chunk_delay_ms": 30.0}, {"hang_after_headers": True}, {"hang_before_headers": True},
)


@dataclass
class SoakConfig:
    duration: float = 600.0
    concurrency: int = 128
    interval: float = 10.0
    fault_period: float = 20.0
    warmup: float | None = None
    """Seconds before the RSS reference sample (default: 10% of the duration, at most 60 s)."""
    prefill_workers: int = 2
    decode_workers: int = 2
    max_rss_growth_mib: float = 64.0
    max_object_growth: int = 50_000
    task_slack: int = 8
    settle_timeout: float = 30.0
    seed: int = 0
    faults: tuple[str, ...] = ()
    """A scripted sequence (``p0:hang_before_headers``, ...) applied in turn, one per half period,
    instead of random faults: to replay a window sequence a random soak found."""
    out: str | None = None
    proxy_log: str | None = None
    """Append the proxy's log (its warnings: retries, blame, migrations) to this file."""
    proxy_args: tuple[str, ...] = ()
    """More options for pd-proxy, after the soak's own."""
    quiet: bool = False

    @property
    def warmup_s(self) -> float:
        return self.warmup if self.warmup is not None else min(60.0, self.duration * 0.1)


@dataclass
class Window:
    t: float
    rss_mib: float | None
    """None (and the proxy-side fields below too) when the proxy did not answer the sample."""
    objects: int | None
    """The Python objects the proxy's collector tracks (garbage not yet collected included)."""
    tasks: int | None
    conns_in_use: int | None
    conns_idle: int | None
    in_flight: int | None
    background: int | None
    leases_open: int | None
    completed: int
    p50_ms: float | None
    p99_ms: float | None
    outcomes: dict[str, int] = field(default_factory=dict)
    fault: str | None = None
    """The faults (port:kind) active at any time in the window (the label used to be the fault at
    the sampling instant, which put the last window's 502s from drop_kv_params under "no fault")."""


@dataclass
class Stats:
    latencies: list[float] = field(default_factory=list)
    outcomes: dict[str, int] = field(default_factory=dict)

    def add(self, outcome: str, latency: float | None) -> None:
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1
        if latency is not None:
            self.latencies.append(latency)

    def take(self) -> tuple[list[float], dict[str, int]]:
        lat, out = self.latencies, self.outcomes
        self.latencies, self.outcomes = [], {}
        return lat, out


def percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1))
    return ordered[k]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Stack:
    """The processes of one soak: pd-sim workers and pd-proxy, all on loopback."""

    def __init__(self) -> None:
        self.procs: list[asyncio.subprocess.Process] = []
        self.prefill: list[str] = []
        self.decode: list[str] = []
        self.proxy_url = ""

    async def _sim(self, role: str) -> str:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "workers.sim.cli", "--host", "127.0.0.1", "--port", "0", "--role", role,
            *SIM_TIMING, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
        self.procs.append(proc)
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), _READY_TIMEOUT_S)
        return str(json.loads(line)["url"])

    async def start(self, cfg: SoakConfig) -> None:
        self.prefill = [await self._sim("prefill") for _ in range(cfg.prefill_workers)]
        self.decode = [await self._sim("decode") for _ in range(cfg.decode_workers)]
        port = _free_port()
        log_file = Path(cfg.proxy_log).open("ab") if cfg.proxy_log else None  # noqa: SIM115, ASYNC230 (once, at start)
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "proxy.cli", "--host", "127.0.0.1", "--port", str(port),
                "--prefill", *self.prefill, "--decode", *self.decode, *PROXY_TIMEOUTS,
                "--log-level", "WARNING" if log_file else "ERROR", *cfg.proxy_args,
                stdout=asyncio.subprocess.DEVNULL, stderr=log_file or asyncio.subprocess.DEVNULL)
        finally:
            if log_file is not None:
                log_file.close()  # the child has its own descriptor
        self.procs.append(proc)
        self.proxy_url = f"http://127.0.0.1:{port}"

    async def wait_ready(self, session: aiohttp.ClientSession) -> None:
        deadline = time.monotonic() + _READY_TIMEOUT_S
        while time.monotonic() < deadline:
            with contextlib.suppress(aiohttp.ClientError, OSError):
                async with session.get(self.proxy_url + "/debug/runtime") as r:
                    if r.status == 200:
                        return
            await asyncio.sleep(0.2)
        raise RuntimeError("pd-proxy did not start")

    async def stop(self) -> None:
        for proc in self.procs:
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.terminate()
        for proc in self.procs:
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()


async def _json(session: aiohttp.ClientSession, method: str, url: str, *, limit: float = 10.0,
                **kw: Any) -> Any:
    async with session.request(method, url, timeout=aiohttp.ClientTimeout(total=limit), **kw) as r:
        return await r.json()


def _reason(body: bytes) -> str:
    """The error message of a refused request (vLLM's error shape), so that a window's 503s say
    which pool had no worker, its 429s which admission limit, its 502s which hop."""
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return body[:60].decode("utf-8", "replace") or "?"
    return str(message)[:80]


def parse_fault(spec: str) -> tuple[str, int, dict[str, Any]]:
    """``p0:hang_before_headers`` -> ("prefill", 0, the fault of that kind from the tables)."""
    where, _, kind = spec.partition(":")
    role = {"p": "prefill", "d": "decode"}.get(where[:1])
    table = PREFILL_FAULTS if role == "prefill" else DECODE_FAULTS
    fault = next((f for f in table if kind in f), None)
    if role is None or not where[1:].isdigit() or fault is None:
        kinds = sorted({k for f in (*PREFILL_FAULTS, *DECODE_FAULTS) for k in f if k != "fail_status"})
        raise ValueError(f"bad fault {spec!r}: want p<N>:<kind> or d<N>:<kind>, kind one of {kinds}")
    return role, int(where[1:]), fault


async def one_request(session: aiohttp.ClientSession, url: str, rng: random.Random, stats: Stats) -> None:
    """One client request with a random shape and behaviour; its outcome goes into ``stats``."""
    stream = rng.random() < 0.6
    roll = rng.random()
    behaviour = "read" if roll < 0.8 else ("disconnect" if roll < 0.9 else "abort")
    rid = f"soak-{rng.getrandbits(48):012x}"
    body = {"token_ids": [rng.randint(3, 514) for _ in range(rng.randint(8, 200))], "stream": stream,
            "sampling_params": {"temperature": 0, "max_tokens": rng.randint(8, 48), "ignore_eos": True}}
    t0 = time.monotonic()
    abort_task: asyncio.Task[Any] | None = None
    if behaviour == "abort":
        async def abort_later() -> None:
            await asyncio.sleep(rng.uniform(0.0, 0.2))
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                await _json(session, "POST", url + ABORT, json={"request_ids": [f"generate-tokens-{rid}"]},
                            headers={"Accept": "*/*"})
        abort_task = asyncio.get_running_loop().create_task(abort_later())
    try:
        async with session.post(url + GENERATE, json=body, headers={"X-Request-Id": rid},
                                timeout=aiohttp.ClientTimeout(total=60)) as r:
            if r.status != 200:
                stats.add(f"http_{r.status}:{_reason(await r.read())}", None)
                return
            if behaviour == "disconnect" and stream:
                await r.content.readuntil(b"\n\n")
                r.close()
                stats.add("disconnected", None)
                return
            raw = await r.read()
        if stream:
            tail = raw.rstrip().rsplit(b"\n\n", 2)
            last = tail[-2] if len(tail) >= 2 else b""
            if not raw.endswith(b"data: [DONE]\n\n"):
                outcome = "stream_truncated"
            elif b'"error"' in last:
                outcome = "stream_error"
            elif b'"finish_reason":"abort"' in raw:
                outcome = "aborted"
            else:
                outcome = "ok"
        else:
            outcome = "aborted" if b'"finish_reason":"abort"' in raw else "ok"
        stats.add(outcome, time.monotonic() - t0 if outcome == "ok" else None)
    except (aiohttp.ClientError, TimeoutError) as e:
        stats.add(f"client_{type(e).__name__}", None)
    finally:
        if abort_task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await abort_task


async def soak(cfg: SoakConfig) -> dict[str, Any]:
    rng = random.Random(cfg.seed)
    stack = Stack()
    windows: list[Window] = []
    stats = Stats()
    fault_now: list[str | None] = [None]
    window_faults: list[str] = []  # every fault active at some time in the current window
    started = time.monotonic()

    def log(msg: str) -> None:
        if not cfg.quiet:
            print(msg, flush=True)

    sessions: list[aiohttp.ClientSession | None] = [None]
    try:
        await stack.start(cfg)
        # Two client sessions: the load's (closed when the load stops, so that its keep-alive
        # connections to the proxy do not count as the proxy's tasks) and a small control one.
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=4)) as control:
            session = sessions[0] = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=cfg.concurrency + 16))
            await stack.wait_ready(control)
            url = stack.proxy_url
            baseline = await _json(control, "GET", url + "/debug/runtime?collect=1")
            t_start = time.monotonic()
            t_end = t_start + cfg.duration

            async def sample(t: float) -> Window:
                try:
                    rt = await _json(control, "GET", url + "/debug/runtime", limit=30.0)
                except (aiohttp.ClientError, TimeoutError):
                    rt = None  # the proxy is too busy to answer in time: a gap, not a failure
                lat, outcomes = stats.take()
                seen = list(dict.fromkeys(window_faults))
                window_faults[:] = [fault_now[0]] if fault_now[0] else []
                conns = rt["upstream_connections"] if rt else {}
                rss = rt.get("rss_bytes") if rt else None
                w = Window(t=round(t, 1), rss_mib=round(rss / 2**20, 2) if rss else None,
                           objects=rt.get("python_objects") if rt else None,
                           tasks=rt["tasks"] if rt else None,
                           conns_in_use=conns.get("in_use"), conns_idle=conns.get("idle"),
                           in_flight=rt["requests_in_flight"] if rt else None,
                           background=rt["background_tasks"] if rt else None,
                           leases_open=rt["kv_leases_open"] if rt else None, completed=sum(outcomes.values()),
                           p50_ms=_ms(percentile(lat, 0.5)), p99_ms=_ms(percentile(lat, 0.99)),
                           outcomes=outcomes, fault=" ".join(seen) or None)
                windows.append(w)
                log(_row(w))
                return w

            async def client() -> None:
                while time.monotonic() < t_end:
                    await one_request(session, url, rng, stats)

            async def faults() -> None:
                workers = [*((u, PREFILL_FAULTS) for u in stack.prefill),
                           *((u, DECODE_FAULTS) for u in stack.decode)]
                script = [parse_fault(f) for f in cfg.faults]
                urls = {"prefill": stack.prefill, "decode": stack.decode}
                step = 0
                while time.monotonic() + cfg.fault_period / 2 < t_end:
                    await asyncio.sleep(cfg.fault_period / 2)
                    if script:
                        if step >= len(script):
                            break
                        role, index, fault = script[step]
                        worker = urls[role][index]
                        step += 1
                    else:
                        worker, choices = rng.choice(workers)
                        fault = rng.choice(choices)
                    with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                        await _json(control, "POST", worker + "/sim/faults", json=fault)
                    label = f"{worker.rsplit(':', 1)[1]}:{','.join(fault)}"
                    fault_now[0] = label
                    window_faults.append(label)
                    await asyncio.sleep(min(cfg.fault_period / 2, max(0.0, t_end - time.monotonic())))
                    with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                        await _json(control, "POST", worker + "/sim/faults", json={"reset": True})
                    fault_now[0] = None

            async def sampler() -> None:
                next_t = t_start + cfg.interval
                while next_t <= t_end + 1e-6:
                    await asyncio.sleep(max(0.0, next_t - time.monotonic()))
                    await sample(next_t - t_start)
                    next_t += cfg.interval

            log(_header())
            fault_task = asyncio.get_running_loop().create_task(faults())
            sampler_task = asyncio.get_running_loop().create_task(sampler())
            await asyncio.gather(*(client() for _ in range(cfg.concurrency)))
            await session.close()
            fault_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await fault_task
            await sampler_task
            for u in (*stack.prefill, *stack.decode):
                await _json(control, "POST", u + "/sim/faults", json={"reset": True})
            fault_now[0] = None
            settled, kv_held = await _settle(control, stack, cfg.settle_timeout,
                                             max_idle=2 * (cfg.prefill_workers + cfg.decode_workers))
            final = await sample(time.monotonic() - t_start)
            reachable = await _json(control, "GET", url + "/debug/runtime?collect=1")
            final_sims = [await _json(control, "GET", u + "/sim/state")
                          for u in (*stack.prefill, *stack.decode)]
    finally:
        if sessions[0] is not None:
            await sessions[0].close()
        await stack.stop()

    answered = [w for w in windows if w.rss_mib is not None]
    ref = next((w for w in answered if w.t >= cfg.warmup_s), answered[0] if answered else None)
    steady = [w for w in windows[:-1] if w.t >= cfg.warmup_s and w.p99_ms is not None]
    rss_growth = (final.rss_mib - ref.rss_mib) if ref and ref.rss_mib and final.rss_mib else None
    leaked_tasks = None if final.tasks is None else final.tasks - int(baseline["tasks"])
    object_growth = int(reachable["python_objects"]) - int(baseline["python_objects"])
    totals: dict[str, int] = {}
    for w in windows:
        for k, v in w.outcomes.items():
            totals[k] = totals.get(k, 0) + v
    checks = {
        "rss_growth_ok": rss_growth is not None and rss_growth <= cfg.max_rss_growth_mib,
        "objects_ok": object_growth <= cfg.max_object_growth,
        "tasks_ok": leaked_tasks is not None and leaked_tasks <= cfg.task_slack,
        # in use: none; idle: the keep-alive pool, at most about one per worker once quiet
        "connections_ok": final.conns_in_use == 0 and final.conns_idle is not None
        and final.conns_idle <= 2 * (cfg.prefill_workers + cfg.decode_workers),
        "nothing_in_flight": final.in_flight == 0 and final.background == 0 and final.leases_open == 0,
        "no_kv_held": kv_held == 0,
        "settled": settled,
    }
    report = {
        "config": asdict(cfg),
        "elapsed_s": round(time.monotonic() - started, 1),
        "baseline": baseline,
        "windows": [asdict(w) for w in windows],
        "summary": {
            "requests": sum(totals.values()),
            "unanswered_samples": sum(1 for w in windows if w.rss_mib is None),
            "outcomes": totals,
            "rss_reference_mib": ref.rss_mib if ref else None,
            "rss_final_mib": final.rss_mib,
            "rss_growth_mib": None if rss_growth is None else round(rss_growth, 2),
            "objects_baseline": baseline["python_objects"],
            "objects_final": reachable["python_objects"],
            "object_growth": object_growth,
            "gc_collections_final": reachable["gc"]["collections"],
            "tasks_baseline": baseline["tasks"],
            "tasks_final": final.tasks,
            "leaked_tasks": leaked_tasks,
            "connections_in_use_final": final.conns_in_use,
            "connections_idle_final": final.conns_idle,
            "kv_held_final": kv_held,
            "p99_first_ms": steady[0].p99_ms if steady else None,
            "p99_last_ms": steady[-1].p99_ms if steady else None,
            "p99_max_ms": max((w.p99_ms for w in steady if w.p99_ms is not None), default=None),
            "sim_releases": [s.get("releases") for s in final_sims],
        },
        "checks": checks,
        "ok": all(checks.values()),
    }
    if cfg.out:
        _write(Path(cfg.out), report)
    log(_summary(report))
    return report


def _write(path: Path, report: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))


async def _settle(session: aiohttp.ClientSession, stack: Stack, limit: float,
                  max_idle: int) -> tuple[bool, int]:
    """Wait (bounded) until nothing is in flight, no upstream connection is in use and at most
    ``max_idle`` idle (the health probes keep some), and no worker holds KV. Returns whether it
    settled and the KV leases still held."""
    deadline = time.monotonic() + limit
    kv_held = -1
    while True:
        try:
            rt = await _json(session, "GET", stack.proxy_url + "/debug/runtime", limit=30.0)
            states = [await _json(session, "GET", u + "/sim/state", limit=30.0)
                      for u in (*stack.prefill, *stack.decode)]
        except (aiohttp.ClientError, TimeoutError):
            if time.monotonic() > deadline:
                return False, kv_held
            continue
        kv_held = sum(len(s["kv_held"]) for s in states)
        busy = rt["requests_in_flight"] or rt["background_tasks"] or rt["kv_leases_open"] \
            or rt["upstream_connections"]["in_use"] or rt["upstream_connections"]["idle"] > max_idle \
            or kv_held or any(s["inflight"] for s in states)
        if not busy:
            return True, kv_held
        if time.monotonic() > deadline:
            return False, kv_held
        await asyncio.sleep(0.5)


def _ms(v: float | None) -> float | None:
    return None if v is None else round(v * 1000.0, 1)


_COLS = ("t_s", "rss_mib", "objects", "tasks", "conn_use", "conn_idle", "inflight", "bg", "leases", "done",
         "p50_ms", "p99_ms", "errors", "fault")


def _header() -> str:
    return " ".join(f"{c:>9}" for c in _COLS[:-1]) + "  fault"


def _row(w: Window) -> str:
    errors = sum(v for k, v in w.outcomes.items() if k not in ("ok", "aborted", "disconnected"))
    vals = (w.t, w.rss_mib, w.objects, w.tasks, w.conns_in_use, w.conns_idle, w.in_flight, w.background,
            w.leases_open, w.completed, w.p50_ms, w.p99_ms, errors)
    return " ".join(f"{'-' if v is None else v:>9}" for v in vals) + f"  {w.fault or '-'}"


def _summary(report: dict[str, Any]) -> str:
    s = report["summary"]
    lines = ["", "soak summary"]
    for key in ("requests", "unanswered_samples", "outcomes", "rss_reference_mib", "rss_final_mib",
                "rss_growth_mib", "objects_baseline", "objects_final", "object_growth",
                "gc_collections_final", "tasks_baseline", "tasks_final", "leaked_tasks",
                "connections_in_use_final", "connections_idle_final", "kv_held_final", "p99_first_ms",
                "p99_last_ms", "p99_max_ms"):
        lines.append(f"  {key:<26} {s[key]}")
    lines.append(f"  {'checks':<26} {report['checks']}")
    lines.append(f"  {'verdict':<26} {'OK' if report['ok'] else 'FAIL'}")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> SoakConfig:
    p = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    p.add_argument("--concurrency", type=int, default=128)
    p.add_argument("--interval", type=float, default=10.0, help="seconds between samples")
    p.add_argument("--fault-period", type=float, default=20.0, help="a fault is on for half of each period")
    p.add_argument("--warmup", type=float, default=None, help="seconds before the RSS reference sample")
    p.add_argument("--prefill-workers", type=int, default=2)
    p.add_argument("--decode-workers", type=int, default=2)
    p.add_argument("--max-rss-growth-mib", type=float, default=64.0)
    p.add_argument("--max-object-growth", type=int, default=50_000,
                   help="Python objects still reachable at the end over their count before the load")
    p.add_argument("--task-slack", type=int, default=8)
    p.add_argument("--settle-timeout", type=float, default=30.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fault", action="append", default=[], metavar="pN:KIND",
                   help="a scripted fault (repeatable, applied in order, one per half period) instead "
                        "of random ones, e.g. --fault p0:hang_before_headers --fault d0:hang_after_headers")
    p.add_argument("--out", default=None, help="write the JSON record here")
    p.add_argument("--proxy-log", default=None, metavar="FILE",
                   help="append the proxy's log at WARNING (retries, blame, migrations) to FILE")
    p.add_argument("--proxy-arg", action="append", default=[], metavar="ARG",
                   help="an option for pd-proxy (repeatable; written with =: --proxy-arg=--log-level=debug)")
    a = p.parse_args(argv)
    cfg = SoakConfig(duration=a.duration, concurrency=a.concurrency, interval=a.interval,
                      fault_period=a.fault_period, warmup=a.warmup, prefill_workers=a.prefill_workers,
                      decode_workers=a.decode_workers, max_rss_growth_mib=a.max_rss_growth_mib,
                      task_slack=a.task_slack, settle_timeout=a.settle_timeout, seed=a.seed, out=a.out,
                      faults=tuple(a.fault), proxy_log=a.proxy_log, proxy_args=tuple(a.proxy_arg),
                      max_object_growth=a.max_object_growth)
    counts = {"prefill": cfg.prefill_workers, "decode": cfg.decode_workers}
    for spec in cfg.faults:
        try:
            role, index, _ = parse_fault(spec)
        except ValueError as e:
            p.error(str(e))
        if index >= counts[role]:
            p.error(f"{spec}: no such worker")
    return cfg


def main(argv: Sequence[str] | None = None) -> int:
    report = asyncio.run(soak(parse_args(argv)))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
