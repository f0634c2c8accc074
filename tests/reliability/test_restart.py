"""A worker restarted mid-run: a pd-sim decode *process* is killed in the middle of a stream and
started again on the same port. The client whose stream broke gets a clean in-band error and
``[DONE]`` (one decode worker: nowhere to migrate); nothing is held anywhere; the next request is
served by the restarted worker. Also the prefill worker: killed while it prefills. Processes come
from the ``sim_process_factory`` fixture, which kills whatever is left at teardown."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest

from proxy.config.settings import ProxySettings
from proxy.http.app import build_app
from tests.fixtures_sim import SimProcess
from tests.reliability.harness import GENERATE, serve, sse_events, start_world

pytestmark = pytest.mark.timeout(90)

ProcessFactory = Callable[..., Awaitable[SimProcess]]
"""``sim_process_factory`` (tests/fixtures_sim.py): every process it started is killed at teardown."""

PROMPT = [3 + (11 * i) % 500 for i in range(48)]
SLOW = ("--itl-ms", "15", "--prefill-base-ms", "0", "--prefill-per-token-ms", "0",
        "--transfer-per-block-ms", "0", "--remote-prefill-step-ms", "0")


def body(stream: bool, max_tokens: int = 40) -> dict[str, Any]:
    return {"token_ids": PROMPT, "stream": stream,
            "sampling_params": {"temperature": 0, "max_tokens": max_tokens, "ignore_eos": True}}


async def served_again(session: aiohttp.ClientSession, url: str, limit: float = 20.0) -> None:
    """The restarted worker serves again (bounded: health and circuit recovery may take a few
    probes)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit
    while True:
        async with session.post(url + GENERATE, json=body(False, 4)) as r:
            raw = await r.read()
            if r.status == 200:
                assert json.loads(raw)["choices"][0]["finish_reason"] == "length"
                return
        assert loop.time() < deadline, f"not served again: {r.status} {raw[:200]!r}"
        await asyncio.sleep(0.2)


async def until_inflight(session: aiohttp.ClientSession, proc: SimProcess, limit: float = 10.0) -> None:
    """Until the worker process has a request in flight (bounded)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit
    while not (await sim_state(session, proc))["inflight"]:
        assert loop.time() < deadline, "the worker never got the request"
        await asyncio.sleep(0.01)  # polling another process


async def sim_state(session: aiohttp.ClientSession, proc: SimProcess) -> dict[str, Any]:
    async with session.get(proc.url + "/sim/state") as r:
        data: dict[str, Any] = await r.json()
        return data


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "full"])
async def test_decode_worker_restarted_mid_stream(stream: bool, sim_process_factory: ProcessFactory) -> None:
    d = await sim_process_factory("--role", "decode", *SLOW)
    w = await start_world(decode=(), extra_decode_urls=[d.url], decode_timeout=5.0)
    try:
        async def client() -> tuple[int, bytes]:
            async with w.session.post(w.url + GENERATE, json=body(stream)) as r:
                if stream:
                    # Two events: the prefill worker's token (first_token_from_prefill), then one
                    # relayed from D, so D pulled the KV and is streaming when it is killed.
                    first = await r.content.readuntil(b"\n\n") + await r.content.readuntil(b"\n\n")
                    started.set()
                    return r.status, first + await r.read()
                return r.status, await r.read()

        started = asyncio.Event()
        task = asyncio.get_running_loop().create_task(client())
        if stream:
            await asyncio.wait_for(started.wait(), 10)
        else:
            await until_inflight(w.session, d)
        await d.kill()  # SIGKILL: connections reset, nothing cleaned up on that side
        status, raw = await asyncio.wait_for(task, 20)
        if stream:
            events = sse_events(raw)
            assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == 502, events[-3:]
        else:
            assert status == 502 and json.loads(raw)["error"]["code"] == 502
        d = await sim_process_factory("--role", "decode", *SLOW, "--port", str(d.port))
        await served_again(w.session, w.url)
        await w.wait_clean()
        st = await sim_state(w.session, d)
        assert not st["inflight"] and not st["kv_held"]
        assert (await w.releases()).get("expired", 0) == 0
    finally:
        await w.close()
        await d.kill()
    await w.assert_no_tasks_after_close()


async def test_prefill_worker_restarted_while_prefilling(sim_process_factory: ProcessFactory) -> None:
    p = await sim_process_factory("--role", "prefill", "--prefill-base-ms", "400",
                                  "--prefill-per-token-ms", "0")
    w = await start_world()
    await w.runner.cleanup()  # the same world, its proxy in front of the prefill process instead
    w.app = build_app(ProxySettings(prefill_urls=(p.url,), decode_urls=(w.d.url,), kv_block_size=16))
    w.runner, w.url = await serve(w.app)
    await asyncio.sleep(0)
    w.steady = {t for t in asyncio.all_tasks() if not t.done()}
    try:
        async def kill_soon() -> None:
            await until_inflight(w.session, p)
            await p.kill()

        killer = asyncio.get_running_loop().create_task(kill_soon())
        async with w.session.post(w.url + GENERATE, json=body(False, 4)) as r:
            raw = await r.read()
        await killer
        assert r.status == 502 and json.loads(raw)["error"]["code"] == 502
        p = await sim_process_factory("--role", "prefill", "--port", str(p.port))
        await served_again(w.session, w.url)
        await w.wait_clean()
        assert not (await sim_state(w.session, p))["kv_held"]
    finally:
        await w.close()
        await p.kill()
    await w.assert_no_tasks_after_close()
