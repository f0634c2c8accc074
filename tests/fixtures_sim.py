"""Fixtures that run pd-sim workers on loopback (127.0.0.1, ephemeral ports).

``sim_factory`` — in-process workers::

    async def test_x(sim_factory):
        p = await sim_factory(role="prefill", zero_latency=True, lease_seconds=0.5)
        d = await sim_factory(role="decode", zero_latency=True)
        p.url                      # "http://127.0.0.1:<port>"
        await p.state()            # GET /sim/state as a dict
        await p.set_faults(fail_next=1, fail_status=503)   # POST /sim/faults
        await d.pulled_bytes()     # KV bytes the worker pulled so far (its /metrics)
        p.settings, p.app          # the SimSettings and the aiohttp Application

  Keyword arguments are ``workers.sim.SimSettings`` fields (``faults=`` takes a ``Faults`` or a dict).
  Each worker is served by an ``AppRunner`` with ``handler_cancellation=True`` (as ``pd-sim`` itself),
  bound to port 0; all are shut down at teardown.

``sim_process_factory`` — real ``pd-sim`` subprocesses (for kill / crash tests)::

    async def test_y(sim_process_factory):
        proc = await sim_process_factory("--role", "prefill", "--zero-latency")
        proc.url, proc.port, proc.process   # process is an asyncio.subprocess.Process
        await proc.kill()                    # SIGKILL and reap

  The CLI is started with ``--host 127.0.0.1 --port 0`` and prints its bound port as a JSON line.
  Every process still running at teardown is killed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from workers.sim import Faults, SimSettings, build_app

_START_TIMEOUT_S = 20.0


@dataclass
class SimWorker:
    """One in-process pd-sim worker."""

    url: str
    host: str
    port: int
    settings: SimSettings
    app: web.Application
    runner: web.AppRunner
    session: aiohttp.ClientSession

    async def state(self) -> dict[str, Any]:
        async with self.session.get(f"{self.url}/sim/state") as r:
            r.raise_for_status()
            data: dict[str, Any] = await r.json()
            return data

    async def set_faults(self, **faults: Any) -> dict[str, Any]:
        async with self.session.post(f"{self.url}/sim/faults", json=faults) as r:
            r.raise_for_status()
            data: dict[str, Any] = await r.json()
            return data

    async def pulled_bytes(self) -> float:
        """KV bytes this (decode) worker pulled so far: its ``vllm:nixl_bytes_transferred`` sum."""
        async with self.session.get(f"{self.url}/metrics") as r:
            r.raise_for_status()
            text = await r.text()
        return sum(s.value for f in text_string_to_metric_families(text)
                   if f.name == "vllm:nixl_bytes_transferred" for s in f.samples if s.name.endswith("_sum"))

    async def close(self) -> None:
        await self.runner.cleanup()


SimFactory = Callable[..., Awaitable[SimWorker]]


@pytest.fixture
async def sim_factory() -> AsyncIterator[SimFactory]:
    workers: list[SimWorker] = []
    session = aiohttp.ClientSession()

    async def make(**kwargs: Any) -> SimWorker:
        faults = kwargs.pop("faults", None)
        if isinstance(faults, dict):
            faults = Faults(**faults)
        settings = SimSettings(**kwargs) if faults is None else SimSettings(faults=faults, **kwargs)
        app = build_app(settings)
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = next(int(a[1]) for a in runner.addresses if isinstance(a, tuple))
        worker = SimWorker(f"http://127.0.0.1:{port}", "127.0.0.1", port, settings, app, runner, session)
        workers.append(worker)
        return worker

    try:
        yield make
    finally:
        for w in reversed(workers):
            await w.close()
        await session.close()


@dataclass
class SimProcess:
    """A ``pd-sim`` subprocess."""

    url: str
    port: int
    process: asyncio.subprocess.Process
    args: tuple[str, ...] = field(default_factory=tuple)

    async def kill(self) -> None:
        if self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.kill()
        await self.process.wait()

    async def terminate(self) -> int:
        if self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.terminate()
        return await self.process.wait()


async def start_sim_process(*args: str) -> SimProcess:
    """Start ``pd-sim`` on 127.0.0.1 with an OS-chosen port and wait until it listens."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "workers.sim.cli",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), _START_TIMEOUT_S)
        info = json.loads(line)
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        raise
    return SimProcess(str(info["url"]), int(info["port"]), proc, tuple(args))


@pytest.fixture
async def sim_process_factory() -> AsyncIterator[Callable[..., Awaitable[SimProcess]]]:
    procs: list[SimProcess] = []

    async def make(*args: str) -> SimProcess:
        p = await start_sim_process(*args)
        procs.append(p)
        return p

    try:
        yield make
    finally:
        for p in procs:
            await p.kill()
