"""The local-prefill alarm on real vLLM: a decode worker whose KV pull fails under
``kv_load_failure_policy: "recompute"`` computes the prompt itself and answers 200; the proxy's
``pd_proxy_decode_local_prefill_tokens_total`` counts it, and stays at 0 for a healthy hand-off."""

from __future__ import annotations

import asyncio
import json
import random
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import aiohttp
import pytest

from kv_transfer.config import kv_transfer_config
from proxy.app import METRICS, SERVING
from proxy.pools import PoolSettings
from tests.e2e.proxy_stack import run_proxy
from tests.fixtures_vllm import STARTUP_TIMEOUT_S
from workers.launcher import Cluster, ClusterSettings, LaunchError, start_cluster

pytestmark = pytest.mark.vllm

POLL_LIMIT_S = 300.0


@pytest.fixture
def recomputing_decode(vllm_bin: Path, tiny_model_dir: Path, tmp_path: Path) -> Iterator[Cluster]:
    """One decode worker of its own that recomputes a prompt whose KV it could not pull (the
    session's decode worker keeps vLLM's default, which answers an error instead)."""
    config = kv_transfer_config("decode")
    assert config is not None
    kv = config.as_dict()
    kv["kv_load_failure_policy"] = "recompute"
    settings = ClusterSettings(model=tiny_model_dir, prefill=0, decode=1, vllm_bin=vllm_bin,
                               log_dir=tmp_path, startup_timeout=STARTUP_TIMEOUT_S,
                               extra_args=("--kv-transfer-config", json.dumps(kv)))  # the last one counts
    try:
        cluster = start_cluster(settings)
    except LaunchError as exc:
        pytest.fail(f"could not start the decode worker: {exc}", pytrace=False)
    with cluster:
        yield cluster


def _value(app: Any, name: str, worker: str, **labels: str) -> float:
    v = app[METRICS].registry.get_sample_value(name, {"pool": "decode", "worker": worker, **labels})
    return float(v or 0.0)


async def _wait(check: Any, what: str) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + POLL_LIMIT_S
    while not check():
        if loop.time() > end:
            raise AssertionError(f"never saw {what}")
        await asyncio.sleep(0.5)


async def test_a_failed_pull_recomputed_on_the_decode_worker_trips_the_alarm(
        vllm_cluster: Cluster, recomputing_decode: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    d = recomputing_decode.decode_urls[0]
    pair = cast(Cluster, SimpleNamespace(prefill_urls=vllm_cluster.prefill_urls, decode_urls=[d]))
    rng = random.Random(45)
    with socket.socket() as dead:  # bound, never listening: the pull's handshake gets nowhere
        dead.bind(("127.0.0.1", 0))
        dead_port = dead.getsockname()[1]
        async with run_proxy(pair,
                             pools=PoolSettings(bypass_when_prefill_unavailable=False,
                                                scrape_interval=0.5)) as (url, app), \
                aiohttp.ClientSession() as session:

            async def generate(n: int) -> None:
                body = {"token_ids": [rng.randrange(3, 515) for _ in range(n)],
                        "sampling_params": {"temperature": 0, "max_tokens": 2}}
                async with session.post(url + "/inference/v1/generate", json=body,
                                        timeout=aiohttp.ClientTimeout(total=POLL_LIMIT_S)) as r:
                    assert r.status == 200, await r.text()
                    assert "X-PD-Decode-Only" not in r.headers  # the request went through P

            # A healthy hand-off: D pulls the prompt and computes none of it.
            await generate(200)
            await _wait(lambda: _value(app, "pd_proxy_decode_prompt_tokens_total", d,
                                       source="external_kv_transfer") > 0, "the hand-off scraped")
            await asyncio.sleep(2.0)  # a few more scrapes
            assert _value(app, "pd_proxy_decode_local_prefill_tokens_total", d) == 0
            # P's params now name an engine D never met, behind a side-channel port nobody
            # listens on: D must handshake anew (NIXL keeps the handshake of an engine id it
            # met, whatever port later params name), the pull fails, D recomputes the prompt
            # and answers 200 all the same.
            core = app[SERVING].core
            rewrite = core.rewrite_remote_host

            def wrong_port(params: dict[str, Any], worker: str) -> dict[str, Any]:
                return {**rewrite(params, worker), "remote_port": dead_port,
                        "remote_engine_id": uuid.uuid4().hex}

            monkeypatch.setattr(core, "rewrite_remote_host", wrong_port)
            await generate(200)
            await _wait(lambda: _value(app, "pd_proxy_decode_local_prefill_tokens_total", d) > 0,
                        "the local prefill counted")
