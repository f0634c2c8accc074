"""Real vLLM on CPU: the manual P/D hand-off gives exactly the aggregated worker's greedy tokens."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kv_transfer.config import DEFAULT_NIXL_PROGRESS_DELAY_US
from tests.fixtures_vllm import STARTUP_TIMEOUT_S, metric_value, scrape_metrics, vllm_connector
from workers import launcher
from workers.demo import manual_handoff, post_generate
from workers.launcher import Cluster

pytestmark = pytest.mark.vllm

SEED = 20261202
N_PROMPTS = 10
MAX_TOKENS = 16
BLOCK_TOKENS = 128  # the CPU build's KV block size (traces README)
XFER_COUNT = "vllm:nixl_xfer_time_seconds_count"
LAUNCH_ERROR = "pd-workers: error:"  # how the launcher reports a failed `up`

# docs/vllm.md, section 3, item 2 (vLLM 0.32.0; 0.33 adds remote_registration_generation).
PREFILL_PARAM_FIELDS = {
    "do_remote_prefill",
    "do_remote_decode",
    "remote_block_ids",
    "remote_engine_id",
    "remote_request_id",
    "remote_host",
    "remote_port",
    "tp_size",
    "dcp_size",
    "pp_size",
    "remote_num_tokens",
    "remote_blocks_expiry_time",
    "transfer_mode",
    "remote_prefill_cached_tokens",
}


def _prompts() -> list[list[int]]:
    rng = random.Random(SEED)
    # Ids 3..514: byte symbols and merges, no special tokens (so no early </s> in the prompt).
    return [[rng.randrange(3, 515) for _ in range(rng.randint(50, 400))] for _ in range(N_PROMPTS)]


def _xfer_count(url: str) -> float:
    return metric_value(scrape_metrics(url), XFER_COUNT) or 0.0


def _check_prefill_params(
    params: dict[str, Any], prompt: list[int], request_id: str, cluster: Cluster
) -> None:
    assert set(params) >= PREFILL_PARAM_FIELDS, f"missing {PREFILL_PARAM_FIELDS - set(params)}"
    prefill = next(w for w in cluster.workers if w.role == "prefill")
    assert params["do_remote_prefill"] is True
    assert params["do_remote_decode"] is False
    assert params["transfer_mode"] == "pull"
    assert params["remote_host"] == "127.0.0.1"
    assert params["remote_port"] == prefill.side_channel_port
    assert params["remote_num_tokens"] == len(prompt)
    assert params["remote_request_id"].startswith(f"generate-tokens-{request_id}")
    assert isinstance(params["remote_engine_id"], str) and params["remote_engine_id"]
    assert (params["tp_size"], params["dcp_size"], params["pp_size"]) == (1, 1, 1)
    assert params["remote_blocks_expiry_time"] is None
    assert isinstance(params["remote_prefill_cached_tokens"], int)
    blocks = params["remote_block_ids"]
    assert isinstance(blocks, list) and all(isinstance(group, list) for group in blocks)
    # Random prompts share no prefix, so every block is sent, the last partial one included.
    assert [len(group) for group in blocks] == [math.ceil(len(prompt) / BLOCK_TOKENS)]


def test_pd_workers_down_stops_every_process_of_a_real_worker(
    vllm_bin: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """`pd-workers up --detach` then `down`: the API server, its engine and worker processes all end.

    The subject is `down`. A start-up that fails (on the loaded CI machine a worker's log once
    stopped between detecting its KV layout and registering its KV cache, and `up` gave up) is
    reported as a warning with the launcher's own message, and `up` is tried once more.
    """
    state_file = tmp_path / "state.json"
    up = _pd_workers_up(vllm_bin, tiny_model_dir, tmp_path, state_file)
    if up.returncode != 0 and LAUNCH_ERROR in up.stderr:
        assert not state_file.exists(), "a failed `up` stops what it started and removes its state file"
        warnings.warn(f"pd-workers up failed once, tried again: {_launch_error(up.stderr)}", stacklevel=1)
        up = _pd_workers_up(vllm_bin, tiny_model_dir, tmp_path, state_file)
    try:
        assert up.returncode == 0, _launch_error(up.stderr)
        (worker,) = launcher.read_state(state_file)
        pids = launcher.worker_pids(worker)
        assert len(pids) >= 3, pids  # API server, engine core, model worker (and helpers)
        assert json.loads(up.stdout)["prefill"] == [worker.url]
    finally:
        if state_file.exists():
            assert launcher.main(["down", "--state-file", str(state_file)]) == 0
    deadline = time.monotonic() + 30
    while _alive(pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _alive(pids) == []
    assert launcher.worker_pids(worker) == []
    assert not state_file.exists()


def _pd_workers_up(
    vllm_bin: Path, tiny_model_dir: Path, tmp_path: Path, state_file: Path
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "workers.launcher", "up", "--prefill", "1", "--decode", "0", "--tokens-only",
         "--model", str(tiny_model_dir), "--vllm-bin", str(vllm_bin), "--state-file", str(state_file),
         "--log-dir", str(tmp_path / "logs"), "--detach", "--startup-timeout", str(STARTUP_TIMEOUT_S)],
        capture_output=True, text=True, timeout=STARTUP_TIMEOUT_S + 180, check=False,
    )  # fmt: skip


def _launch_error(stderr: str) -> str:
    """The launcher's message (what failed, and when) and the end of the worker's log tail after it."""
    message = stderr[stderr.find(LAUNCH_ERROR) :] if LAUNCH_ERROR in stderr else stderr
    head, _, rest = message.partition("\n")
    return f"{head}\n...\n{rest[-2500:]}" if len(rest) > 2500 else message


def _alive(pids: list[int]) -> list[int]:
    """The PIDs that still exist and are not zombies."""
    left = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            left.append(pid)
    return left


async def test_manual_handoff_matches_aggregated_greedy_output(vllm_cluster: Cluster) -> None:
    prefill_url = vllm_cluster.prefill_urls[0]
    decode_url = vllm_cluster.decode_urls[0]
    aggregated_url = vllm_cluster.aggregated_urls[0]
    async with aiohttp.ClientSession(connector=vllm_connector()) as session:
        for i, prompt in enumerate(_prompts()):
            body = {"token_ids": prompt, "sampling_params": {"temperature": 0, "max_tokens": MAX_TOKENS}}
            request_id = f"e2e-handoff-{i}"
            reference = await post_generate(
                session, aggregated_url, {**body, "request_id": f"{request_id}-agg"}
            )
            before = _xfer_count(decode_url)
            handoff = await manual_handoff(session, prefill_url, decode_url, body, request_id)
            after = _xfer_count(decode_url)

            _check_prefill_params(handoff.kv_transfer_params, prompt, request_id, vllm_cluster)
            assert handoff.prefill_reply["choices"][0]["finish_reason"] in ("length", "stop")  # EOS is ok
            ref_choice = reference["choices"][0]
            # Greedy may stop early on </s> (id 1); otherwise it runs to max_tokens.
            assert ref_choice["finish_reason"] == "length" or ref_choice["token_ids"][-1:] == [1]
            assert 1 <= len(ref_choice["token_ids"]) <= MAX_TOKENS
            assert handoff.decode_reply["choices"][0]["finish_reason"] == ref_choice["finish_reason"]
            assert handoff.token_ids == reference["choices"][0]["token_ids"], (
                f"prompt {i} ({len(prompt)} tokens)"
            )
            assert handoff.decode_reply["usage"]["prompt_tokens"] == len(prompt)
            assert handoff.decode_reply["kv_transfer_params"] is None
            assert after - before == 1, f"prompt {i}: decode's {XFER_COUNT} went {before} -> {after}"


def test_the_cpu_pd_workers_nixl_progress_thread_sleeps_between_events(vllm_cluster: Cluster) -> None:
    """The launcher makes a CPU P or D worker's NIXL agent with a poll delay (kv_transfer/nixl_progress):
    with NIXL's own setting its progress thread busy-polls, a core per worker. The line is printed
    where the agent is made, in the worker's model process; the aggregated worker has no agent."""
    line = f"progress thread poll delay {DEFAULT_NIXL_PROGRESS_DELAY_US} us"
    for worker in vllm_cluster.workers:
        text = Path(worker.log).read_text(errors="replace")
        assert text.count(line) == (0 if worker.role == "aggregated" else 1), (worker.role, worker.log)
