"""What a cancellation costs, per router: ``python -m benchmarks.cancel_bench``.

    python -m benchmarks.cancel_bench [--quick]                       # pd-sim workers
    python -m benchmarks.cancel_bench --real-vllm --model .cache/tiny-llama   # real vLLM on CPU

Starts a prefill and a decode worker (pd-sim processes, or real vLLM through
``workers.launcher``), then runs the same cancellation scenarios through each target:

* ``floor``: pd-bench doing the two hops itself (``pd-bench --two-hop P D``): a cancel reaches
  whichever worker holds the request at once (its connection closes or the abort goes to it);
  between the hops nothing frees the prefill worker's blocks;
* ``pd-proxy``: this project's proxy in front of the two workers;
* ``vllm-router``: the vLLM project's router in P/D mode (``--router-bin``, else
  ``.venv-router/bin/vllm-router`` as ``benchmarks/router_env.sh`` installs it, else
  ``vllm-router`` on PATH). Nothing is installed here: when it is missing it is left out with a
  message saying so. ``--router-cmd`` starts any other router the same way.

A scenario is a cancel phase and mode (``before-first-token:disconnect``, ``mid-stream:abort``,
``after=0.05:disconnect`` for ``--cancel-after 0.05``, ...). Each is one ``pd-bench run`` per target
with ``--cancel-rate`` (its baseline run without cancellations first,
for the TTFT penalty) and a KV probe on both workers. Targets take turns within a scenario, their
order rotated from one scenario to the next. pd-sim reports every request's KV (so every cancel is
attributed under load); real vLLM only its total usage, so the real-vLLM variant adds an isolated
run per scenario (``--isolated N``: requests one at a time, each cancelled, each sent only once the
workers are idle again), which attributes every cancel from the total.

Outputs go to ``results/cancel_bench-<UTC time>/``: each run's result JSON and records,
``result.json`` (the figures of every run; for pd-proxy also its KV-lease ledger's closures by
reason over the run, ``pd_proxy_kv_leases_closed_total``: pulled, aborted (released), expired),
``table.md`` (the table for ``benchmarks/README.md``) and ``cancel_bench.png``. Every process
started here is stopped at the end (by its PID).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import aiohttp

from benchmarks.cancel import CANCEL_AT, CancelConfig
from benchmarks.client import CANCEL_MODES
from benchmarks.datasets import DatasetConfig
from benchmarks.runner import BenchConfig, BenchResult, arun_benchmark

REPO_ROOT: Final = Path(__file__).resolve().parent.parent
FLOOR: Final = "floor"
PD_PROXY: Final = "pd-proxy"
VLLM_ROUTER: Final = "vllm-router"
TARGETS: Final = (FLOOR, PD_PROXY, VLLM_ROUTER)
SCENARIOS: Final = ("before-first-token:disconnect", "before-first-token:abort", "mid-stream:disconnect")
SIM_HANDOFF_S: Final = 0.05
"""On the pd-sim workers a 256-token prompt's prefill takes 20 + 0.1 x 256 = 45.6 ms and the pull
of its 16 blocks 16 ms: a cancel 50 ms after the send lands in the hand-off, where the prefill
worker holds the KV and only the decode side's pull (or a release) frees it."""
SIM_SCENARIOS: Final = (*SCENARIOS, f"after={SIM_HANDOFF_S:g}:disconnect")
READY_TIMEOUT_S: Final = 60.0

# pd-sim workers: a prefill worker with room for the KV of 8 prompts of 256 tokens (a leaked lease
# takes an eighth of it for --lease-seconds), a 1 ms per block pull, 10 ms between tokens.
SIM_TIMING: Final = (
    "--prefill-base-ms 20 --prefill-per-token-ms 0.1 --itl-ms 10 --transfer-per-block-ms 1"
)
DEFAULT_SIM_CMD: Final = (
    "{python} -m workers.sim.cli --host 127.0.0.1 --port {port} --role {role} " + SIM_TIMING
    + " --lease-seconds {lease} --num-kv-blocks {blocks}"
)
DEFAULT_PD_PROXY_CMD: Final = (
    "{python} -m proxy.cli --host 127.0.0.1 --port {port} --prefill {prefill} --decode {decode}"
    " --log-level WARNING --kv-block-size {block_size} --lease-duration {lease}"
)
DEFAULT_ROUTER_CMD: Final = (
    "{router_bin} --host 127.0.0.1 --port {port} --vllm-pd-disaggregation"
    " --prefill {prefill} --decode {decode} --policy round_robin --log-level warning"
    " --prometheus-port {aux_port}"
)


@dataclass
class Settings:
    targets: tuple[str, ...]
    scenarios: tuple[str, ...]
    cancel_rate: float
    num_prompts: int
    request_rate: float
    max_concurrency: int
    input_len: int
    output_len: int
    warmups: int
    lease_s: int
    prefill_blocks: int
    isolated: int
    seed: int
    result_dir: Path
    real_vllm: bool = False
    model: Path | None = None
    router_bin: str | None = None
    router_cmd: str = DEFAULT_ROUTER_CMD
    workers: tuple[str, str] | None = None
    kv_block_size: int | None = None
    extra_targets: dict[str, str] = field(default_factory=dict)
    probe_interval_s: float = 0.02
    free_timeout_s: float = 30.0
    request_timeout_s: float = 120.0


@dataclass
class Stack:
    prefill: str
    decode: str
    targets: dict[str, str] = field(default_factory=dict)  # name -> base URL (not the floor)
    skipped: dict[str, str] = field(default_factory=dict)
    block_size: int = 16


class Processes:
    """The processes this benchmark starts; each one is stopped by its PID at the end."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: list[tuple[str, subprocess.Popen[bytes]]] = []

    def start(self, name: str, argv: Sequence[str]) -> subprocess.Popen[bytes]:
        log = (self.log_dir / f"{name}.log").open("wb")
        try:
            proc = subprocess.Popen(list(argv), stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT,
                                    start_new_session=True)
        finally:
            log.close()
        self.procs.append((name, proc))
        return proc

    def stop(self) -> None:
        for _, proc in reversed(self.procs):
            if proc.poll() is None:
                proc.terminate()
        for _, proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs.clear()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def wait_healthy(url: str, proc: subprocess.Popen[bytes] | None, name: str, log: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode} (log: {log})")
            with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError):
                async with s.get(f"{url}/health", timeout=aiohttp.ClientTimeout(total=2)) as r:
                    if r.status == 200:
                        return
            await asyncio.sleep(0.2)
    raise RuntimeError(f"{name} not healthy at {url} after {READY_TIMEOUT_S:g} s (log: {log})")


def find_router(explicit: str | None) -> str | None:
    """vllm-router's executable, if it is installed (nothing is installed here)."""
    if explicit:
        return explicit if Path(explicit).is_file() else None
    for candidate in (REPO_ROOT / ".venv-router" / "bin" / "vllm-router",):
        if candidate.is_file():
            return str(candidate)
    return shutil.which("vllm-router")


def render_argv(template: str, **values: Any) -> list[str]:
    """A command template (``{python}`` and ``values`` filled in) as an argv."""
    return shlex.split(template.format(python=sys.executable, **values))


async def start_sim_stack(cfg: Settings, procs: Processes) -> Stack:
    urls: dict[str, str] = {}
    for role, blocks in (("prefill", cfg.prefill_blocks), ("decode", 4096)):
        port = free_port()
        argv = render_argv(DEFAULT_SIM_CMD, port=port, role=role, lease=cfg.lease_s, blocks=blocks)
        proc = procs.start(f"sim-{role}", argv)
        urls[role] = f"http://127.0.0.1:{port}"
        await wait_healthy(urls[role], proc, f"pd-sim {role}", procs.log_dir / f"sim-{role}.log")
    return Stack(prefill=urls["prefill"], decode=urls["decode"], block_size=16)


def start_vllm_stack(cfg: Settings) -> tuple[Stack, Any]:
    """Real vLLM prefill and decode workers (the lead's CPU pair); returns the stack and the
    cluster (a context manager that stops them)."""
    from workers.launcher import ClusterSettings, start_cluster  # noqa: PLC0415

    assert cfg.model is not None
    cluster = start_cluster(
        ClusterSettings(
            model=cfg.model, prefill=1, decode=1, lease_seconds=cfg.lease_s,
            log_dir=cfg.result_dir / "vllm-logs",
        )
    )
    return Stack(prefill=cluster.prefill_urls[0], decode=cluster.decode_urls[0], block_size=128), cluster


async def start_routers(cfg: Settings, stack: Stack, procs: Processes) -> None:
    for name in cfg.targets:
        if name == FLOOR:
            continue
        if name == PD_PROXY:
            template = DEFAULT_PD_PROXY_CMD
            values: dict[str, Any] = {"block_size": stack.block_size, "lease": cfg.lease_s}
        elif name == VLLM_ROUTER:
            router = find_router(cfg.router_bin)
            if router is None and cfg.router_cmd == DEFAULT_ROUTER_CMD:
                why = (
                    "not installed (looked for --router-bin, .venv-router/bin/vllm-router and "
                    "vllm-router on PATH; `bash benchmarks/router_env.sh` installs it): left out"
                )
                print(f"cancel_bench: vllm-router {why}", file=sys.stderr, flush=True)
                stack.skipped[name] = why
                continue
            template = cfg.router_cmd
            values = {"router_bin": router or "vllm-router", "aux_port": free_port()}
        else:
            continue
        port = free_port()
        argv = render_argv(template, port=port, prefill=stack.prefill, decode=stack.decode, **values)
        proc = procs.start(name, argv)
        url = f"http://127.0.0.1:{port}"
        try:
            await wait_healthy(url, proc, name, procs.log_dir / f"{name}.log")
        except RuntimeError as exc:
            print(f"cancel_bench: {exc}: left out", file=sys.stderr, flush=True)
            stack.skipped[name] = str(exc)
            continue
        stack.targets[name] = url


def parse_scenario(text: str) -> tuple[str, str]:
    """``AT:MODE`` -> (AT, MODE); AT is a phase or ``after=SECONDS``."""
    at, _, mode = text.partition(":")
    return at, mode or "disconnect"


def _after_s(at: str) -> float | None:
    if not at.startswith("after="):
        return None
    try:
        value = float(at.removeprefix("after="))
    except ValueError:
        return None
    return value if value >= 0 else None


def bench_config(cfg: Settings, stack: Stack, target: str, scenario: str, *, isolated: bool) -> BenchConfig:
    at, mode = parse_scenario(scenario)
    n = cfg.isolated if isolated else cfg.num_prompts
    ds = DatasetConfig(num_requests=n, input_len=cfg.input_len, output_len=cfg.output_len, seed=cfg.seed)
    label = f"{target}-{at.replace('=', '')}-{mode}" + ("-isolated" if isolated else "")
    base = BenchConfig(
        url=stack.decode if target == FLOOR else stack.targets[target],
        dataset=ds,
        request_rate=float("inf") if isolated else cfg.request_rate,
        max_concurrency=1 if isolated else cfg.max_concurrency,
        warmup=cfg.warmups,
        percentiles=(50.0, 99.0),
        goodput_ms={"ttft": 500.0 if cfg.real_vllm else 200.0},
        request_timeout_s=cfg.request_timeout_s,
        result_dir=str(cfg.result_dir / "runs"),
        label=label,
        plots=False,
        progress=False,
        two_hop=(stack.prefill, stack.decode) if target == FLOOR else None,
        cancel=CancelConfig(
            rate=1.0 if isolated else cfg.cancel_rate,
            at=None if _after_s(at) is not None else at,
            after_s=_after_s(at),
            mode=mode,
        ),
        kv_probes=(stack.prefill, stack.decode),
        kv_probe_interval_s=cfg.probe_interval_s,
        kv_free_timeout_s=cfg.free_timeout_s,
        kv_settle=isolated,
    )
    return base


def figures(target: str, scenario: str, res: BenchResult, *, isolated: bool) -> dict[str, Any]:
    """The figures of one run that the table and the plot show."""
    d = res.data
    probes = d.get("kv_probes") or []
    p = probes[0] if probes else {}
    dec = probes[1] if len(probes) > 1 else {}
    return {
        "target": target,
        "scenario": scenario,
        "isolated": isolated,
        "completed": d.get("completed"),
        "failed": d.get("failed"),
        "cancelled": d.get("cancelled"),
        "cancel_phases": d.get("cancel_phases"),
        "abort_calls": d.get("abort_calls"),
        "abort_calls_ok": d.get("abort_calls_ok"),
        "aborts_run_out": d.get("aborts_run_out"),
        "median_ttft_ms": d.get("median_ttft_ms"),
        "p99_ttft_ms": d.get("p99_ttft_ms"),
        "median_itl_ms": d.get("median_itl_ms"),
        "request_goodput": d.get("request_goodput"),
        "goodput_fraction": d.get("goodput_fraction"),
        "ttft_penalty_median_ms": d.get("ttft_penalty_median_ms"),
        "ttft_penalty_p99_ms": d.get("ttft_penalty_p99_ms"),
        "ttft_penalty_mean_paired_ms": d.get("ttft_penalty_mean_paired_ms"),
        "baseline_median_ttft_ms": d.get("baseline_median_ttft_ms"),
        "baseline_p99_ttft_ms": d.get("baseline_p99_ttft_ms"),
        "p_cancels_holding": p.get("cancels_holding"),
        "p_cancels_attributed": p.get("cancels_attributed"),
        "p_cancel_to_free_median_ms": p.get("median_cancel_to_free_ms"),
        "p_cancel_to_free_max_ms": p.get("cancel_to_free_max_ms"),
        "p_not_freed": p.get("not_freed"),
        "p_held_over_1s": p.get("held_over_1s"),
        "p_stranded_block_s": p.get("stranded_block_s"),
        "p_stranded_block_s_per_cancel": p.get("stranded_block_s_per_cancel"),
        "p_drain_s": p.get("drain_s"),
        "d_cancel_to_free_median_ms": dec.get("median_cancel_to_free_ms"),
        "d_cancel_to_free_max_ms": dec.get("cancel_to_free_max_ms"),
        "d_stranded_block_s": dec.get("stranded_block_s"),
        "result_json": str(res.files.get("result_json", "")),
    }


def _f(v: Any, digits: int = 1) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def _ordered(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """By scenario (in run order), then floor, pd-proxy, vllm-router, any other target."""
    scen = {s: i for i, s in enumerate(dict.fromkeys(r["scenario"] for r in rows))}
    rank = {t: i for i, t in enumerate(TARGETS)}
    return sorted(rows, key=lambda r: (scen[r["scenario"]], r["isolated"], rank.get(r["target"], len(rank))))


def table(rows: Sequence[dict[str, Any]]) -> str:
    """The markdown table for benchmarks/README.md."""
    rows = _ordered(rows)
    head = (
        "| scenario | target | ok / cancelled / failed | aborts run out | survivors' TTFT p50 / p99 ms "
        "| TTFT penalty p50 / p99 ms | ITL p50 ms | P cancels holding KV | P cancel-to-free p50 / max ms "
        "| P KV block-s stranded "
        "(per cancel) | P held > 1 s / not freed | D cancel-to-free p50 / max ms |"
    )
    lines = [head, "| " + " | ".join(["---"] * 12) + " |"]
    for r in rows:
        scen = r["scenario"] + (" (isolated)" if r["isolated"] else "")
        lines.append(
            f"| {scen} | {r['target']} | {_f(r['completed'])} / {_f(r['cancelled'])} / {_f(r['failed'])} "
            f"| {_f(r.get('aborts_run_out')) if r.get('abort_calls') else '-'} "
            f"| {_f(r['median_ttft_ms'])} / {_f(r['p99_ttft_ms'])} "
            f"| {_f(r['ttft_penalty_median_ms'])} / {_f(r['ttft_penalty_p99_ms'])} "
            f"| {_f(r['median_itl_ms'])} | {_f(r['p_cancels_holding'])} "
            f"| {_f(r['p_cancel_to_free_median_ms'])} / {_f(r['p_cancel_to_free_max_ms'])} "
            f"| {_f(r['p_stranded_block_s'], 2)} ({_f(r['p_stranded_block_s_per_cancel'], 3)}) "
            f"| {_f(r.get('p_held_over_1s'))} / {_f(r['p_not_freed'])} "
            f"| {_f(r['d_cancel_to_free_median_ms'])} / {_f(r['d_cancel_to_free_max_ms'])} |"
        )
    return "\n".join(lines)


def plot(rows: Sequence[dict[str, Any]], path: Path) -> Path:
    """Per scenario and target: P's cancel-to-free (median, max), the KV block-seconds stranded on
    P, and the survivors' TTFT penalty (p50, p99)."""
    from matplotlib.figure import Figure  # noqa: PLC0415

    scenarios = list(dict.fromkeys(r["scenario"] + (" iso" if r["isolated"] else "") for r in rows))
    targets = list(dict.fromkeys(r["target"] for r in rows))
    fig = Figure(figsize=(14, 4.6))
    axes = fig.subplots(1, 3)
    width = 0.8 / max(1, len(targets))

    def value(scen: str, target: str, key: str) -> float:
        for r in rows:
            if r["target"] == target and r["scenario"] + (" iso" if r["isolated"] else "") == scen:
                v = r.get(key)
                return float(v) if isinstance(v, int | float) else 0.0
        return 0.0

    panels = (
        (axes[0], ("p_cancel_to_free_median_ms", "p_cancel_to_free_max_ms"), "P cancel-to-free (ms)", True),
        (axes[1], ("p_stranded_block_s",), "P KV block-seconds stranded", True),
        (axes[2], ("ttft_penalty_median_ms", "ttft_penalty_p99_ms"), "survivors' TTFT penalty (ms)", True),
    )
    for ax, keys, title, log in panels:
        for ti, target in enumerate(targets):
            xs = [si + (ti - (len(targets) - 1) / 2) * width for si in range(len(scenarios))]
            # the second key (max, p99) as a wide light bar behind, the first (median) solid on top
            for ki in reversed(range(len(keys))):
                key = keys[ki]
                vals = [value(s, target, key) for s in scenarios]
                name = f"{target} {key.split('_')[-2]}" if len(keys) > 1 else target
                ax.bar(xs, vals, width * (0.5 if ki == 0 and len(keys) > 1 else 0.9), label=name,
                       alpha=1.0 if ki == 0 else 0.35, color=f"C{ti}")
        ax.set_xticks(range(len(scenarios)), [s.replace(":", "\n").replace("-first-", "-first-\n")
                                              for s in scenarios], fontsize=7)
        ax.set_title(title)
        if log:
            ax.set_yscale("symlog", linthresh=1 if "block" in title else 10)
        ax.grid(alpha=0.3, axis="y")
        ax.axhline(0, color="black", linewidth=0.5)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path


LEDGER_METRIC: Final = "pd_proxy_kv_leases_closed_total"


async def ledger(url: str) -> dict[str, float] | None:
    """pd-proxy's KV-lease ledger: leases closed so far, by reason (None: not a pd-proxy)."""
    try:
        async with aiohttp.ClientSession() as s, s.get(f"{url}/metrics",
                                                       timeout=aiohttp.ClientTimeout(total=10)) as r:
            text = await r.text() if r.status == 200 else ""
    except (aiohttp.ClientError, TimeoutError):
        return None
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(LEDGER_METRIC + "{"):
            labels, _, value = line.rpartition(" ")
            reason = labels.split('reason="', 1)[1].split('"', 1)[0] if 'reason="' in labels else "?"
            with contextlib.suppress(ValueError):
                out[reason] = out.get(reason, 0.0) + float(value)
    return out if "pd_proxy_" in text else None  # a pd-proxy before its first closure: {}


def plan(targets: Sequence[str], scenarios: Sequence[str]) -> Iterator[tuple[str, str]]:
    """Every scenario, the targets taking turns, their order rotated from scenario to scenario."""
    for i, scen in enumerate(scenarios):
        k = i % max(1, len(targets))
        for target in [*targets[k:], *targets[:k]]:
            yield scen, target


async def run_all(cfg: Settings, stack: Stack) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    names = [t for t in cfg.targets if t == FLOOR or t in stack.targets]
    names += [t for t in cfg.extra_targets if t not in names]
    for scen, target in plan(names, cfg.scenarios):
        runs = [False] + ([True] if cfg.isolated > 0 else [])
        for isolated in runs:
            bc = bench_config(cfg, stack, target, scen, isolated=isolated)
            print(f"cancel_bench: {target} {scen}{' isolated' if isolated else ''} ...", flush=True)
            before = await ledger(bc.url) if target != FLOOR else None
            res = await arun_benchmark(bc)
            row = figures(target, scen, res, isolated=isolated)
            after = await ledger(bc.url) if before is not None else None
            if before is not None and after is not None:
                # the proxy's own account of the leases of both runs (baseline and cancels)
                row["proxy_leases_closed"] = {k: after[k] - before.get(k, 0.0) for k in after}
            rows.append(row)
    return {"rows": rows}


def parse_args(argv: Sequence[str] | None) -> Settings:
    p = argparse.ArgumentParser(prog="python -m benchmarks.cancel_bench", description=__doc__.split("\n")[0])
    p.add_argument("--targets", default=",".join(TARGETS),
                   help="comma list out of floor,pd-proxy,vllm-router")
    p.add_argument("--scenarios", default=None,
                   help="comma list of AT:MODE (AT before-first-token|mid-stream|first-token|"
                        "after=SECONDS, MODE disconnect|abort); default "
                        f"{','.join(SIM_SCENARIOS)} on pd-sim, {','.join(SCENARIOS)} on real vLLM")
    p.add_argument("--quick", action="store_true", help="fewer requests (a smoke run)")
    p.add_argument("--cancel-rate", type=float, default=0.3)
    p.add_argument("--num-prompts", type=int, default=None)
    p.add_argument("--request-rate", type=float, default=None)
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=None)
    p.add_argument("--num-warmups", type=int, default=4)
    p.add_argument("--lease-seconds", type=int, default=None,
                   help="the prefill worker's KV lease (pd-sim default 5, real vLLM default 10)")
    p.add_argument("--prefill-kv-blocks", type=int, default=129,
                   help="pd-sim prefill worker's KV blocks (129: room for 8 prompts of 256 tokens)")
    p.add_argument("--isolated", type=int, default=None,
                   help="requests of the isolated run per scenario (default 0 on pd-sim, 5 on real vLLM)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result-dir", type=Path, default=None)
    p.add_argument("--real-vllm", action="store_true", help="real vLLM prefill and decode workers on CPU")
    p.add_argument("--model", type=Path, default=None, help="--real-vllm: the model folder")
    p.add_argument("--router-bin", default=None, help="vllm-router's executable")
    p.add_argument("--router-cmd", default=DEFAULT_ROUTER_CMD,
                   help="the vllm-router target's command "
                        "({router_bin} {port} {prefill} {decode} {aux_port})")
    p.add_argument("--workers", nargs=2, metavar=("PREFILL_URL", "DECODE_URL"), default=None,
                   help="use these running workers instead of starting pd-sim ones")
    p.add_argument("--kv-block-size", type=int, default=None,
                   help="the workers' KV block in tokens, for pd-proxy (default 16 on pd-sim, 128 on vLLM)")
    p.add_argument("--target", action="append", default=[], metavar="NAME=URL",
                   help="also drive this running router (in front of --workers), e.g. my-router=http://...")
    p.add_argument("--free-timeout", type=float, default=None,
                   help="seconds to watch the workers for freed KV after each run (default lease + 10)")
    a = p.parse_args(argv)
    if a.real_vllm and a.model is None:
        p.error("--real-vllm needs --model DIR (e.g. .cache/tiny-llama)")
    targets = tuple(t.strip() for t in a.targets.split(",") if t.strip())
    if bad := [t for t in targets if t not in TARGETS]:
        p.error(f"unknown target(s): {', '.join(bad)}")
    extra: dict[str, str] = {}
    for item in a.target:
        name, sep, url = item.partition("=")
        if not sep or not name or not url.startswith(("http://", "https://")) or name in TARGETS:
            p.error(f"--target wants NAME=http://HOST:PORT with a new name, got {item!r}")
        extra[name] = url.rstrip("/")
    if extra and not a.workers:
        p.error("--target needs --workers (the prefill and decode workers the router sends to)")
    if a.workers and a.real_vllm:
        p.error("--workers and --real-vllm exclude each other")
    real = bool(a.real_vllm)
    default = SCENARIOS if real or a.workers else SIM_SCENARIOS
    scenarios = tuple(s.strip() for s in a.scenarios.split(",") if s.strip()) if a.scenarios else default
    for s in scenarios:
        at, mode = parse_scenario(s)
        good_at = at in CANCEL_AT or _after_s(at) is not None
        if not good_at or mode not in CANCEL_MODES:
            p.error(f"bad scenario {s!r}: AT:MODE, AT before-first-token|mid-stream|first-token|"
                    "after=SECONDS, MODE disconnect|abort")
    lease = a.lease_seconds or (10 if real else 5)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    return Settings(
        targets=targets,
        scenarios=scenarios,
        cancel_rate=a.cancel_rate,
        num_prompts=a.num_prompts or (40 if real else 60 if a.quick else 200),
        request_rate=a.request_rate or (2.0 if real else 20.0),
        max_concurrency=a.max_concurrency or (4 if real else 16),
        input_len=a.input_len,
        output_len=a.output_len or (16 if real else 32),
        warmups=a.num_warmups,
        lease_s=lease,
        prefill_blocks=a.prefill_kv_blocks,
        isolated=a.isolated if a.isolated is not None else (5 if real else 0),
        seed=a.seed,
        result_dir=a.result_dir or REPO_ROOT / "results" / f"cancel_bench-{stamp}",
        real_vllm=real,
        model=a.model,
        router_bin=a.router_bin,
        router_cmd=a.router_cmd,
        workers=(a.workers[0].rstrip("/"), a.workers[1].rstrip("/")) if a.workers else None,
        extra_targets=extra,
        kv_block_size=a.kv_block_size,
        probe_interval_s=0.05 if real else 0.01,
        free_timeout_s=a.free_timeout or lease + 10.0,
        request_timeout_s=300.0 if real else 120.0,
    )


async def _main(cfg: Settings) -> int:
    cfg.result_dir.mkdir(parents=True, exist_ok=True)
    procs = Processes(cfg.result_dir)
    cluster: Any = None
    try:
        if cfg.real_vllm:
            stack, cluster = await asyncio.to_thread(start_vllm_stack, cfg)
        elif cfg.workers is not None:
            stack = Stack(prefill=cfg.workers[0], decode=cfg.workers[1])
        else:
            stack = await start_sim_stack(cfg, procs)
        if cfg.kv_block_size:
            stack.block_size = cfg.kv_block_size
        await start_routers(cfg, stack, procs)
        stack.targets.update(cfg.extra_targets)
        started = dt.datetime.now(dt.UTC).isoformat()
        out = await run_all(cfg, stack)
    finally:
        procs.stop()
        if cluster is not None:
            cluster.stop()
    out["meta"] = {
        "started_utc": started,
        "workers": "real vLLM (CPU)" if cfg.real_vllm else "pd-sim",
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(cfg).items()},
        "skipped_targets": stack.skipped,
        "loadavg_end": list(os.getloadavg()),
    }
    (cfg.result_dir / "result.json").write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")
    text = table(out["rows"])
    (cfg.result_dir / "table.md").write_text(text + "\n", encoding="utf-8")
    png = plot(out["rows"], cfg.result_dir / "cancel_bench.png")
    print(text)
    for name, why in stack.skipped.items():
        print(f"{name}: {why}")
    print(f"result: {cfg.result_dir / 'result.json'}\ntable: {cfg.result_dir / 'table.md'}\nplot: {png}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    cfg = parse_args(argv)
    return asyncio.run(_main(cfg))


if __name__ == "__main__":
    raise SystemExit(main())

