"""Several pd-proxy replicas behind one Service: two ``pd-proxy`` processes on different ports in front of
the same pd-sim pools. An abort sent to either replica reaches the request (the replica that does not
know the id sends it to every worker), and session affinity and prefix-aware routing pick the same
workers whichever replica a request lands on (rendezvous hashing over the membership)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests import sse
from tests.fixtures_sim import SimFactory, SimWorker

GEN = "/inference/v1/generate"
ABORT = "/inference/v1/abort_requests"
SLOW_DECODE = {"zero_latency": False, "itl_ms": 20.0, "prefill_base_ms": 0.0, "prefill_per_token_ms": 0.0,
               "transfer_per_block_ms": 0.0}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Replica:
    url: str
    process: asyncio.subprocess.Process
    log: Path

    async def upstream_counts(self, session: aiohttp.ClientSession) -> dict[tuple[str, str], float]:
        """``pd_proxy_upstream_requests_total`` by (pool, worker), as this replica counts them."""
        async with session.get(self.url + "/metrics") as r:
            text = await r.text()
        return {(s.labels["pool"], s.labels["worker"]): s.value
                for f in text_string_to_metric_families(text) for s in f.samples
                if s.name == "pd_proxy_upstream_requests_total"}


@pytest.fixture
async def replicas(tmp_path: Path) -> AsyncIterator[Callable[..., Awaitable[list[Replica]]]]:
    started: list[Replica] = []

    async def start(prefill: list[SimWorker], decode: list[SimWorker], *extra: str,
                    n: int = 2) -> list[Replica]:
        out = []
        for i in range(n):
            port = free_port()
            log = tmp_path / f"replica-{i}.log"
            with log.open("wb") as sink:
                proc = await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "proxy.cli", "--host", "127.0.0.1", "--port", str(port),
                    "--prefill", *(w.url for w in prefill), "--decode", *(w.url for w in decode),
                    "--drain-timeout", "2", *extra,
                    stdin=asyncio.subprocess.DEVNULL, stdout=sink, stderr=asyncio.subprocess.STDOUT)
            replica = Replica(f"http://127.0.0.1:{port}", proc, log)
            started.append(replica)
            out.append(replica)
        async with aiohttp.ClientSession() as session:
            for replica in out:  # up, both pools reachable: /health answers 200 (bounded: 30 s)
                for _ in range(300):
                    assert replica.process.returncode is None, replica.log.read_text()
                    with contextlib.suppress(aiohttp.ClientError):
                        async with session.get(replica.url + "/health") as r:
                            if r.status == 200:
                                break
                    await asyncio.sleep(0.1)
                else:
                    raise AssertionError(replica.log.read_text())
        return out

    yield start
    for replica in started:
        if replica.process.returncode is None:
            replica.process.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(replica.process.wait(), 10)
            except TimeoutError:
                replica.process.kill()
                await replica.process.wait()


async def quiet(workers: list[SimWorker], limit: float = 5.0) -> None:
    """Nothing held or running on any worker (bounded)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + limit
    while True:
        states = [await w.state() for w in workers]
        if not any(s["kv_held"] or s["inflight"] or s["kv_blocks_used"] for s in states):
            return
        assert loop.time() < end, states
        await asyncio.sleep(0.05)


def finish_reasons(raw: bytes) -> list[str]:
    return [c["finish_reason"] for e in sse.json_events(raw, comments=True)
            for c in e.get("choices", []) if c.get("finish_reason")]


def prompt(n: int, first: int = 0) -> list[int]:
    return [first + 3, *(260 + (i * 7) % 200 for i in range(n - 1))]


async def test_an_abort_sent_to_either_replica_reaches_the_request(
        sim_factory: SimFactory, replicas: Callable[..., Awaitable[list[Replica]]]) -> None:
    p = [await sim_factory(role="prefill", **SLOW_DECODE) for _ in range(2)]
    d = [await sim_factory(role="decode", **SLOW_DECODE) for _ in range(2)]
    a, b = await replicas(p, d)
    async with aiohttp.ClientSession() as session:
        for n, (via, other) in enumerate(((a, b), (b, a))):
            rid = f"cross-{n}"
            body = {"token_ids": prompt(40), "request_id": rid, "stream": True,
                    "sampling_params": {"temperature": 0, "max_tokens": 400, "ignore_eos": True}}
            async with session.post(via.url + GEN, json=body) as r:
                assert r.status == 200
                seen = b""
                while seen.count(b"\n\n") < 3:  # decoding: the first events arrived
                    seen += await r.content.readany()
                ids = {"request_ids": [f"generate-tokens-{rid}"]}
                async with session.post(other.url + ABORT, json=ids) as ab:
                    assert ab.status == 200
                seen += await asyncio.wait_for(r.read(), 10)
            assert finish_reasons(seen) == ["abort"] and seen.endswith(b"data: [DONE]\n\n")
            assert seen.count(b"token_ids") < 400  # ended by the abort, not by max_tokens
            await quiet([*p, *d])


async def route(session: aiohttp.ClientSession, replica: Replica, body: dict[str, Any],
                headers: dict[str, str] | None = None) -> tuple[str, str]:
    """Send one request through ``replica``; the (prefill, decode) workers it used, from its metrics."""
    before = await replica.upstream_counts(session)
    async with session.post(replica.url + GEN, json=body, headers=headers or {}) as r:
        assert r.status == 200, await r.text()
        assert "X-PD-Decode-Only" not in r.headers, r.headers["X-PD-Decode-Only"]  # both hops ran
        await r.read()
    after = await replica.upstream_counts(session)
    used = {key for key, value in after.items() if value > before.get(key, 0.0)}
    (prefill,) = [w for pool, w in used if pool == "prefill"]
    (decode,) = [w for pool, w in used if pool == "decode"]
    return prefill, decode


async def test_session_affinity_picks_the_same_workers_on_every_replica(
        sim_factory: SimFactory, replicas: Callable[..., Awaitable[list[Replica]]]) -> None:
    """48-token prompts: three KV blocks of pd-sim (GPU vLLM's 16-token block), so both hops run."""
    p = [await sim_factory(role="prefill", zero_latency=True) for _ in range(3)]
    d = [await sim_factory(role="decode", zero_latency=True) for _ in range(3)]
    a, b = await replicas(p, d, "--prefill-policy", "session", "--decode-policy", "session")
    body = {"token_ids": prompt(48), "sampling_params": {"temperature": 0, "max_tokens": 4}}
    chosen: dict[str, tuple[str, str]] = {}
    async with aiohttp.ClientSession() as session:
        for n in range(12):
            headers = {"X-Session-ID": f"user-{n}"}
            first = await route(session, a, body, headers)
            assert await route(session, b, body, headers) == first, n
            assert await route(session, a, body, headers) == first, n
            chosen[f"user-{n}"] = first
    assert len({decode for _, decode in chosen.values()}) > 1  # the sessions spread over the pool
    await quiet([*p, *d])


async def test_prefix_routing_picks_the_same_workers_on_every_replica(
        sim_factory: SimFactory, replicas: Callable[..., Awaitable[list[Replica]]]) -> None:
    """Prompts of 48 tokens sharing their first two blocks (32 tokens) by family, sent alternately to
    either replica: each family stays on one prefill and one decode worker, whichever replica took it."""
    p = [await sim_factory(role="prefill", zero_latency=True) for _ in range(3)]
    d = [await sim_factory(role="decode", zero_latency=True) for _ in range(3)]
    a, b = await replicas(p, d, "--prefill-policy", "prefix", "--decode-policy", "prefix",
                          "--prefix-blocks", "2")
    families: dict[int, set[tuple[str, str]]] = {}
    async with aiohttp.ClientSession() as session:
        for family in range(10):
            head = prompt(32, first=family)
            for tail in range(4):
                body = {"token_ids": [*head, *(400 + tail + i for i in range(16))],
                        "sampling_params": {"temperature": 0, "max_tokens": 4}}
                families.setdefault(family, set()).add(await route(session, (a, b)[tail % 2], body))
    assert all(len(used) == 1 for used in families.values()), families
    assert len({next(iter(used))[0] for used in families.values()}) > 1  # families spread over the pool
    await quiet([*p, *d])
