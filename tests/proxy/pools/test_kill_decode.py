"""2 prefill + 2 decode pd-sim processes; one decode worker is SIGKILLed mid-run.

Every request is migratable (greedy, no stop strings), so every one must end with status 200,
[DONE], no error event and exactly the tokens of an uninterrupted run. The test prints the
counts (sent / migrated / decode retries / failed) for the report."""

from __future__ import annotations

import asyncio
from typing import Any

from proxy.config.settings import ProxySettings
from proxy.http.app import SERVING, build_app
from proxy.pools import PoolSettings
from tests.sse import datas

N_REQUESTS = 48
CONCURRENCY = 8
MAX_TOKENS = 64
KILL_AFTER = 8  # completed requests before the kill


def prompt(i: int) -> list[int]:
    return [260 + (i * 13 + j * 7) % 200 for j in range(40)]


async def stream(client: Any, i: int) -> tuple[int, list[Any]]:
    body = {"token_ids": prompt(i % 8), "stream": True,
            "sampling_params": {"temperature": 0, "max_tokens": MAX_TOKENS}}
    r = await client.post("/inference/v1/generate", json=body)
    raw = await r.read()
    return r.status, datas(raw, comments=True)


def tokens(events: list[Any]) -> list[int]:
    return [t for e in events if isinstance(e, dict)
            for c in e.get("choices", []) for t in c.get("token_ids", [])]


async def metric(client: Any, name: str, **labels: str) -> float:
    text = (await (await client.get("/metrics")).read()).decode()
    for line in text.splitlines():
        if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def test_kill_one_decode_worker_mid_run(sim_process_factory: Any, aiohttp_client: Any) -> None:
    timing = ("--itl-ms", "10", "--prefill-base-ms", "2")
    ps = [await sim_process_factory("--role", "prefill", *timing) for _ in range(2)]
    ds = [await sim_process_factory("--role", "decode", *timing) for _ in range(2)]
    settings = ProxySettings(prefill_urls=tuple(p.url for p in ps), decode_urls=tuple(d.url for d in ds),
                             kv_block_size=16,  # pd-sim's (40-token prompts are not bypassed)
                             pools=PoolSettings(health_interval=0.2, health_timeout=0.5, decode_attempts=3))
    app = build_app(settings)
    client = await aiohttp_client(app, server_kwargs={"handler_cancellation": True})
    runs = await asyncio.wait_for(asyncio.gather(*(stream(client, i) for i in range(8))), 60)
    assert all(status == 200 for status, _ in runs)
    baseline = {i: tokens(events) for i, (_, events) in enumerate(runs)}
    assert all(len(b) == MAX_TOKENS for b in baseline.values())

    sem = asyncio.Semaphore(CONCURRENCY)
    completed = 0
    enough = asyncio.Event()
    results: list[tuple[int, int, list[Any]]] = []
    on_victim: list[int] = []

    async def one(i: int) -> None:
        nonlocal completed
        async with sem:
            status, events = await stream(client, i)
        results.append((i, status, events))
        completed += 1
        if completed >= KILL_AFTER:
            enough.set()

    async def killer() -> None:
        await enough.wait()
        victim = app[SERVING].decode_pool.get(ds[0].url)
        assert victim is not None
        # kill while the victim streams to several clients (bounded wait for that moment)
        for _ in range(500):
            if victim.inflight >= CONCURRENCY // 2 - 1:
                break
            await asyncio.sleep(0.005)
        on_victim.append(victim.inflight)
        await ds[0].kill()

    kill_task = asyncio.create_task(killer())
    await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(N_REQUESTS))), 120)
    await asyncio.wait_for(kill_task, 10)

    failed = [i for i, status, events in results
              if status != 200 or events[-1] != "[DONE]"
              or any(isinstance(e, dict) and "error" in e for e in events)
              or tokens(events) != baseline[i % 8]]
    migrated = await metric(client, "pd_proxy_migrations_total")
    retried = await metric(client, "pd_proxy_retries_total", hop="decode")
    print(f"\nkill-one-decode run: sent={N_REQUESTS} migrated={int(migrated)} "
          f"decode_retries={int(retried)} failed={len(failed)} in_flight_on_killed_worker={on_victim}")
    assert len(results) == N_REQUESTS
    assert failed == []
    assert migrated + retried >= 1  # the kill hit requests in flight or about to start
    assert ds[0].process.returncode is not None
    serving = app[SERVING]
    assert len(serving.table) == 0
