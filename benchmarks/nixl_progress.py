"""What NIXL's progress thread costs a real CPU P/D pair: ``python -m benchmarks.nixl_progress``.

    python -m benchmarks.nixl_progress --model .cache/tiny-llama [--delays 0,1000] [--rounds 2]

For each progress delay (``pd-workers up --nixl-progress-delay-us``; 0 is NIXL's own busy poll),
in turns, ``--rounds`` times: starts one real prefill and one real decode worker on CPU
(``workers.launcher``, each on its own core as ``pd-workers`` places them), then

* **idle**: the CPU both workers' process trees use over ``--idle-seconds`` with nothing to do;
* **hand-offs**: ``--requests`` manual hand-offs one after the other (the prefill hop, then the
  decode hop with P's ``kv_transfer_params``, the KV pulled over NIXL; random 256-token prompts,
  ``--max-tokens`` greedy tokens): each one's wall time (p50, p90), and the workers' CPU a hand-off;

and stops them. Both workers' logs say which delay their agent got. The figures go to stdout and,
with ``--out``, to a JSON file. Nothing is asserted: read them as ratios within one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

from benchmarks.datasets import DatasetConfig, random_dataset
from benchmarks.procstat import tree_cpu_seconds
from workers.demo import manual_handoff
from workers.launcher import Cluster, ClusterSettings, start_cluster


def _cpu(cluster: Cluster) -> dict[str, float]:
    return {w.role: tree_cpu_seconds(w.pid) for w in cluster.workers}


def _spent(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {role: after[role] - before[role] for role in before}


async def _handoffs(cluster: Cluster, requests: int, max_tokens: int, seed: int) -> list[float]:
    prefill, decode = (next(w.url for w in cluster.workers if w.role == r) for r in ("prefill", "decode"))
    dataset = DatasetConfig(num_requests=requests, input_len=256, output_len=max_tokens, seed=seed)
    specs = random_dataset(dataset)
    walls: list[float] = []
    async with aiohttp.ClientSession() as session:
        for i, spec in enumerate(specs):
            body = {
                "token_ids": spec.prompt,
                "sampling_params": {"max_tokens": spec.output_len, "temperature": 0.0},
                "stream": False,
            }
            start = time.perf_counter()
            await manual_handoff(session, prefill, decode, body, f"nixl-progress-{seed}-{i}")
            walls.append(time.perf_counter() - start)
    return walls


def measure(args: argparse.Namespace, delay_us: int, round_no: int) -> dict[str, Any]:
    settings = ClusterSettings(
        model=args.model, prefill=1, decode=1, vllm_bin=args.vllm_bin, nixl_progress_delay_us=delay_us,
        log_dir=args.log_dir / f"delay{delay_us}-round{round_no}", startup_timeout=args.startup_timeout,
    )  # fmt: skip
    with start_cluster(settings) as cluster:
        asyncio.run(_handoffs(cluster, 2, args.max_tokens, seed=-1))  # warm-up: the first pull connects
        time.sleep(2.0)
        before = _cpu(cluster)
        time.sleep(args.idle_seconds)
        idle = _spent(before, _cpu(cluster))
        before = _cpu(cluster)
        walls = asyncio.run(_handoffs(cluster, args.requests, args.max_tokens, seed=round_no))
        busy = _spent(before, _cpu(cluster))
    walls_ms = sorted(w * 1000 for w in walls)
    return {
        "delay_us": delay_us,
        "round": round_no,
        "idle_cores": {role: round(s / args.idle_seconds, 3) for role, s in idle.items()},
        "handoff_ms_p50": round(statistics.median(walls_ms), 1),
        "handoff_ms_p90": round(walls_ms[int(0.9 * (len(walls_ms) - 1))], 1),
        "cpu_ms_per_handoff": {role: round(s * 1000 / args.requests, 1) for role, s in busy.items()},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.nixl_progress", description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--vllm-bin", type=Path, default=None)
    p.add_argument("--delays", default="0,1000", help="progress delays (us), comma list; 0: NIXL's busy poll")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--requests", type=int, default=20)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--idle-seconds", type=float, default=10.0)
    p.add_argument("--startup-timeout", type=float, default=420.0)
    p.add_argument("--log-dir", type=Path, default=Path("run/logs/nixl_progress"))
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    delays = [int(d) for d in args.delays.split(",")]
    if args.rounds < 1 or args.requests < 1 or args.idle_seconds <= 0 or any(d < 0 for d in delays):
        p.error("rounds and requests at least 1, idle seconds positive, delays 0 or more")
    results = []
    for round_no in range(args.rounds):
        for delay_us in delays if round_no % 2 == 0 else delays[::-1]:
            result = measure(args, delay_us, round_no)
            print(json.dumps(result), flush=True)
            results.append(result)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
