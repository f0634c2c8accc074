"""The local-prefill alarm on real vLLM (``proxy.observe.local_prefill``), on the session's workers:

- healthy hand-offs through the real P/D pair leave both counters at 0;
- a decode pool made of the aggregated worker (no KV connector: it ignores P's
  ``kv_transfer_params`` and computes the prompt itself) makes
  ``pd_proxy_decode_local_prefill_tokens_total`` grow;
- a pull from the real decode worker to a closed side-channel port, naming an engine it never met
  (so NIXL must handshake anew), makes ``pd_proxy_decode_failed_pulls_total`` grow. The decode
  worker keeps vLLM's ``kv_load_failure_policy: "fail"``: it answers an error to the hop and to
  the proxy's retry with the same KV (two failed pulls), then the proxy runs the request
  decode-only (``X-PD-Decode-Only: decode_retry``) and the client gets its 200. That decode-only
  prompt is expected compute: the local-prefill counter stays at 0.
"""

from __future__ import annotations

import asyncio
import random
import socket
import uuid
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any, cast

import aiohttp
import pytest
from aiohttp import web

from proxy.http.app import METRICS, SERVING
from proxy.pools import PoolSettings
from tests.e2e.proxy_stack import run_proxy
from workers.launcher import Cluster

pytestmark = pytest.mark.vllm

POLL_LIMIT_S = 300.0
INTERVAL_S = 0.5
"""The alarm's scrape interval in these tests (the default is 15 s)."""
PROMPT_TOKENS = 200
POOLS = PoolSettings(bypass_when_prefill_unavailable=False, preflight=False)


def _value(app: web.Application, name: str, worker: str, **labels: str) -> float:
    v = app[METRICS].registry.get_sample_value(name, {"pool": "decode", "worker": worker, **labels})
    return float(v or 0.0)


def _local_prefill(app: web.Application, d: str) -> float:
    return _value(app, "pd_proxy_decode_local_prefill_tokens_total", d)


def _failed_pulls(app: web.Application, d: str) -> float:
    return _value(app, "pd_proxy_decode_failed_pulls_total", d)


async def _wait(check: Callable[[], bool], what: str) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + POLL_LIMIT_S
    while not check():
        if loop.time() > end:
            raise AssertionError(f"never saw {what}")
        await asyncio.sleep(0.5)


async def _generate(session: aiohttp.ClientSession, url: str, rng: random.Random) -> aiohttp.ClientResponse:
    """One non-stream request of a fresh prompt (no prefix cache hit anywhere); its body read."""
    body = {"token_ids": [rng.randrange(3, 515) for _ in range(PROMPT_TOKENS)],
            "sampling_params": {"temperature": 0, "max_tokens": 2}}
    async with session.post(url + "/inference/v1/generate", json=body,
                            timeout=aiohttp.ClientTimeout(total=POLL_LIMIT_S)) as r:
        await r.read()
        return r


async def _baseline(app: web.Application, d: str) -> None:
    """The alarm scraped ``d`` once: what its counters show from now on is counted."""
    alarm = app[SERVING].core.local_prefill
    await _wait(lambda: alarm.scraped(d), f"the first scrape of {d}")


async def test_healthy_handoffs_leave_both_counters_at_zero(vllm_cluster: Cluster) -> None:
    d = vllm_cluster.decode_urls[0]
    rng = random.Random(4501)
    async with run_proxy(vllm_cluster, pools=POOLS, local_prefill_interval=INTERVAL_S) as (url, app), \
            aiohttp.ClientSession() as session:
        await _baseline(app, d)
        for _ in range(3):
            r = await _generate(session, url, rng)
            assert r.status == 200 and "X-PD-Decode-Only" not in r.headers  # through P, P's KV
        await _wait(lambda: _value(app, "pd_proxy_decode_prompt_tokens_total", d,
                                   source="external_kv_transfer") >= 3 * (PROMPT_TOKENS - 128),
                    "the three hand-offs scraped")
        await asyncio.sleep(10 * INTERVAL_S)  # a few more scrapes
        seen = {"local_prefill": _local_prefill(app, d), "failed_pulls": _failed_pulls(app, d),
                "local_compute": _value(app, "pd_proxy_decode_prompt_tokens_total", d,
                                        source="local_compute"),
                "external": _value(app, "pd_proxy_decode_prompt_tokens_total", d,
                                   source="external_kv_transfer")}
        print(f"healthy: {seen}")
        assert seen["local_prefill"] == 0 and seen["failed_pulls"] == 0


async def test_a_decode_worker_that_ignores_the_handoff_counts_as_local_prefill(
        vllm_cluster: Cluster) -> None:
    agg = vllm_cluster.aggregated_urls[0]
    pair = cast(Cluster, SimpleNamespace(prefill_urls=vllm_cluster.prefill_urls, decode_urls=[agg]))
    rng = random.Random(4502)
    async with run_proxy(pair, pools=POOLS, local_prefill_interval=INTERVAL_S) as (url, app), \
            aiohttp.ClientSession() as session:
        await _baseline(app, agg)
        r = await _generate(session, url, rng)
        assert r.status == 200 and "X-PD-Decode-Only" not in r.headers  # P's KV went with it
        # It computed the whole prompt; the proxy expected the last token at most.
        await _wait(lambda: _local_prefill(app, agg) >= PROMPT_TOKENS - 1, "the local prefill counted")
        print(f"ignored hand-off: local_prefill={_local_prefill(app, agg)} "
              f"failed_pulls={_failed_pulls(app, agg)}")
        assert _failed_pulls(app, agg) == 0  # no pull was tried


async def test_a_pull_to_a_closed_port_counts_as_a_failed_pull(
        vllm_cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    d = vllm_cluster.decode_urls[0]
    rng = random.Random(4503)
    with socket.socket() as dead:  # bound, never listening: the handshake gets no answer
        dead.bind(("127.0.0.1", 0))
        dead_port = dead.getsockname()[1]
        async with run_proxy(vllm_cluster, pools=POOLS, local_prefill_interval=INTERVAL_S) as (url, app), \
                aiohttp.ClientSession() as session:
            await _baseline(app, d)
            # P's params name an engine D never met behind a port nobody listens on: NIXL keeps
            # the handshake of an engine id it met whatever port later params name, so a new id
            # makes D handshake anew, and that handshake fails.
            core = app[SERVING].core
            rewrite = core.rewrite_remote_host

            def wrong_port(params: dict[str, Any], worker: str) -> dict[str, Any]:
                return {**rewrite(params, worker), "remote_port": dead_port,
                        "remote_engine_id": uuid.uuid4().hex}

            monkeypatch.setattr(core, "rewrite_remote_host", wrong_port)
            r = await _generate(session, url, rng)
            await _wait(lambda: _failed_pulls(app, d) >= 1, "the failed pull counted")
            await asyncio.sleep(10 * INTERVAL_S)  # a few more scrapes
            metrics = app[METRICS].registry
            rescued = metrics.get_sample_value("pd_proxy_decode_only_total", {"reason": "decode_retry"})
            print(f"failed pull: status={r.status} decode_only={r.headers.get('X-PD-Decode-Only')} "
                  f"failed_pulls={_failed_pulls(app, d)} local_prefill={_local_prefill(app, d)} "
                  f"decode_retry={rescued}")
            # D (policy "fail") answered errors; the proxy ran the request decode-only on it.
            assert r.status == 200 and r.headers.get("X-PD-Decode-Only") == "decode_retry"
            assert rescued == 1
            assert _local_prefill(app, d) == 0  # the decode-only compute was expected
