"""``pd-proxy --workers N``: N processes on one port, metrics summed, aborts reach any process,
admin changes reach every process, every process stops on SIGTERM/SIGINT, a crashed child stops
the rest."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from proxy.config.settings import ProxySettings
from proxy.http.multiproc import Supervisor
from tests import sse

GEN = "/inference/v1/generate"
ABORT = "/inference/v1/abort_requests"
PROMPT = [260 + (j * 7) % 200 for j in range(40)]
_LISTENING = re.compile(rb"(\d+) worker processes on http://127\.0\.0\.1:(\d+) \(pids ([\d,]+); "
                        rb"metrics in ([^)]+)\)")
_ADMIN = re.compile(rb"admin API on http://127\.0\.0\.1:(\d+)/admin/workers \(every process\)")
ADMIN_KEY = "admin-key-Mp62"
ADMIN_AUTH = {"Authorization": f"Bearer {ADMIN_KEY}"}


@dataclass
class MultiProxy:
    process: asyncio.subprocess.Process
    url: str
    child_pids: list[int]
    log: Path
    metrics_dir: Path

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is not serving: look at its state
    with contextlib.suppress(OSError):
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat[stat.rindex(")") + 2] != "Z"
    return False


async def _wait_dead(pids: list[int], limit: float) -> bool:
    for _ in range(int(limit / 0.05)):
        if not any(_alive(p) for p in pids):
            return True
        await asyncio.sleep(0.05)
    return not any(_alive(p) for p in pids)


@pytest.fixture
async def multiproxy(tmp_path: Path) -> AsyncIterator[Callable[..., Awaitable[MultiProxy]]]:
    started: list[MultiProxy] = []

    async def start(prefill: str, decode: str, *extra: str, workers: int = 2,
                    env: dict[str, str] | None = None) -> MultiProxy:
        log = tmp_path / f"proxy-{len(started)}.log"
        with log.open("wb") as out:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "proxy.cli", "--host", "127.0.0.1", "--port", "0",
                "--workers", str(workers), "--prefill", prefill, "--decode", decode,
                "--kv-block-size", "16", "--drain-timeout", "5", *extra,
                stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=asyncio.subprocess.STDOUT,
                env={**os.environ, **(env or {})})
        match = None
        for _ in range(300):  # bounded: 30 s
            match = _LISTENING.search(log.read_bytes())
            if match or proc.returncode is not None:
                break
            await asyncio.sleep(0.1)
        assert match is not None, log.read_text()
        mp = MultiProxy(proc, f"http://127.0.0.1:{int(match[2])}",
                        [int(p) for p in match[3].split(b",")], log, Path(match[4].decode()))
        started.append(mp)
        assert len(mp.child_pids) == workers
        # ready when every child answers: poll /health over fresh connections (bounded)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
            for _ in range(300):
                with contextlib.suppress(aiohttp.ClientError):
                    async with s.get(mp.url + "/health") as r:
                        if r.status == 200 and mp.log_text().count("Running on") >= workers:
                            break
                await asyncio.sleep(0.1)
        return mp

    yield start
    for mp in started:
        if mp.process.returncode is None:
            mp.process.send_signal(signal.SIGKILL)
            await mp.process.wait()
        for pid in mp.child_pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def fresh() -> aiohttp.ClientSession:
    """One new TCP connection per request: each may land on any process."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))


async def metric(url: str, name: str, **labels: str) -> float:
    async with fresh() as s, s.get(url + "/metrics") as r:
        text = (await r.read()).decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith((name + "{", name + " ")) and \
                all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def served_by(log: str) -> set[str]:
    return set(re.findall(r"pd_proxy\.access\[(\d+)\]", log))


# ---------------------------------------------------------------- units


def test_supervisor_refuses_bad_worker_counts() -> None:
    s = ProxySettings(prefill_urls=("http://127.0.0.1:1",), decode_urls=("http://127.0.0.1:2",), port=0)
    with pytest.raises(ValueError, match="at least 1"):
        Supervisor(s, 0)
    no_broadcast = ProxySettings(prefill_urls=s.prefill_urls, decode_urls=s.decode_urls, port=0,
                                 abort_unknown_broadcast=False)
    with pytest.raises(ValueError, match="broadcast"):
        Supervisor(no_broadcast, 2)


def test_supervisor_resolves_port_zero() -> None:
    s = ProxySettings(prefill_urls=("http://127.0.0.1:1",), decode_urls=("http://127.0.0.1:2",), port=0)
    sup = Supervisor(s, 2)
    try:
        assert sup.port > 0
        assert sup.settings.port == sup.port
    finally:
        sup.close()


# ---------------------------------------------------------------- two processes


async def test_two_processes_serve_one_port_and_sum_metrics(sim_factory: Any, multiproxy: Any) -> None:
    p = await sim_factory(role="prefill", zero_latency=True)
    d = await sim_factory(role="decode", zero_latency=True)
    mp = await multiproxy(p.url, d.url)
    n = 24
    async with fresh() as s:
        for i in range(n):
            body = {"token_ids": PROMPT, "sampling_params": {"max_tokens": 4, "temperature": 0}}
            async with s.post(mp.url + GEN, json=body, headers={"X-Request-Id": f"m{i}"}) as r:
                assert r.status == 200
                doc = await r.json()
                assert len(doc["choices"][0]["token_ids"]) == 4
    # 24 fresh connections spread by the kernel's hash: both processes served (p = 2^-23 not)
    assert served_by(mp.log_text()) == {"0", "1"}
    # whichever process serves /metrics, the counters are the sum over both
    for _ in range(4):
        assert await metric(mp.url, "pd_proxy_requests_total", outcome="ok") == n
    assert await metric(mp.url, "pd_proxy_inflight_requests") == 0
    assert await metric(mp.url, "pd_proxy_build_info") == 1  # livemax: one series, not one per pid


async def _stream_until_first_token(s: aiohttp.ClientSession, url: str, rid: str,
                                    out: list[bytes], first: asyncio.Event) -> None:
    body = {"token_ids": PROMPT, "stream": True,
            "sampling_params": {"max_tokens": 2000, "temperature": 0, "ignore_eos": True}}
    async with s.post(url + GEN, json=body, headers={"X-Request-Id": rid}) as r:
        assert r.status == 200
        async for chunk in r.content.iter_any():
            out.append(chunk)
            if b"token_ids" in chunk:
                first.set()


async def test_abort_reaches_the_request_whatever_process_holds_it(sim_factory: Any,
                                                                    multiproxy: Any) -> None:
    p = await sim_factory(role="prefill", zero_latency=True)
    d = await sim_factory(role="decode", itl_ms=100.0, prefill_base_ms=0.0, prefill_per_token_ms=0.0)
    mp = await multiproxy(p.url, d.url)
    same = other = 0
    for i in range(16):  # until the abort has landed on both the owning and the other process
        rid = f"ab{i}"
        events: list[bytes] = []
        first = asyncio.Event()
        async with fresh() as s:
            task = asyncio.create_task(_stream_until_first_token(s, mp.url, rid, events, first))
            await asyncio.wait_for(first.wait(), 20)
            unknown_before = await metric(mp.url, "pd_proxy_aborts_total", source="client_call",
                                          state="unknown")
            async with fresh() as a, a.post(mp.url + ABORT,
                                            json={"request_ids": [f"generate-tokens-{rid}"]}) as r:
                assert r.status == 200
            await asyncio.wait_for(task, 20)  # the stream ends: nothing left hanging
        raw = b"".join(events)
        datas = sse.events(raw, comments=True)
        assert datas[-1] == b"[DONE]"
        finals = [json.loads(x)["choices"][0]["finish_reason"] for x in datas[:-1]
                  if json.loads(x).get("choices")]
        assert finals[-1] == "abort", raw[-400:]
        assert len(finals) < 2000  # ended by the abort, not by max_tokens
        unknown_after = await metric(mp.url, "pd_proxy_aborts_total", source="client_call",
                                     state="unknown")
        if unknown_after > unknown_before:
            other += 1  # the process that got the abort did not hold the request: broadcast
        else:
            same += 1
        if same and other:
            break
    assert other >= 1 and same >= 1, (same, other)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
async def test_signal_stops_every_process(sim_factory: Any, multiproxy: Any, sig: signal.Signals) -> None:
    p = await sim_factory(role="prefill", zero_latency=True)
    d = await sim_factory(role="decode", zero_latency=True)
    mp = await multiproxy(p.url, d.url)
    assert mp.metrics_dir.is_dir()
    assert all(_alive(pid) for pid in mp.child_pids)
    mp.process.send_signal(sig)
    assert await asyncio.wait_for(mp.process.wait(), 30) == 0
    assert await _wait_dead(mp.child_pids, 10)
    assert mp.log_text().count("Running on") == 2
    assert not mp.metrics_dir.exists()  # the parent removes the metrics directory it made


async def test_a_crashed_child_stops_the_others(sim_factory: Any, multiproxy: Any) -> None:
    p = await sim_factory(role="prefill", zero_latency=True)
    d = await sim_factory(role="decode", zero_latency=True)
    mp = await multiproxy(p.url, d.url)
    os.kill(mp.child_pids[0], signal.SIGKILL)
    assert await asyncio.wait_for(mp.process.wait(), 30) == 1
    assert await _wait_dead(mp.child_pids, 10)
    assert "exited with code" in mp.log_text()


# ---------------------------------------------------------------- admin changes, every process


async def _views(admin: str, tries: int = 1) -> dict[int, dict[str, Any]]:
    """``GET /admin/workers`` over ``tries`` fresh connections: each answering process's view."""
    views: dict[int, dict[str, Any]] = {}
    for _ in range(tries):
        async with fresh() as s, s.get(admin + "/admin/workers", headers=ADMIN_AUTH) as r:
            assert r.status == 200
            doc = await r.json()
        views[doc["process"]] = {w["url"]: w for w in doc["pools"]["decode"]}
    return views


async def _until_every_process(mp: MultiProxy, admin: str, check: Callable[[dict[str, Any]], bool]) -> None:
    """Poll (bounded: 300 fresh connections) until every child's last seen view passes ``check``."""
    last: dict[int, dict[str, Any]] = {}
    for _ in range(300):
        last.update(await _views(admin))
        if set(last) == set(mp.child_pids) and all(check(v) for v in last.values()):
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"not every process applied the change: {last}")


async def test_admin_changes_reach_every_process(sim_factory: Any, multiproxy: Any) -> None:
    p = await sim_factory(role="prefill", zero_latency=True)
    d = await sim_factory(role="decode", zero_latency=True)
    d2 = await sim_factory(role="decode", zero_latency=True)
    mp = await multiproxy(p.url, d.url, "--admin-port", "0", env={"PD_PROXY_ADMIN_KEY": ADMIN_KEY})
    match = _ADMIN.search(mp.log.read_bytes())
    assert match is not None, mp.log_text()
    admin = f"http://127.0.0.1:{int(match[1])}"
    async with fresh() as s, s.get(mp.url + "/admin/workers", headers=ADMIN_AUTH) as r:
        assert r.status == 404  # the admin API is on its own port only

    # add: one process takes the call, both end up with the worker
    async with fresh() as s, s.post(admin + "/admin/workers", json={"pool": "decode", "url": d2.url},
                                    headers=ADMIN_AUTH) as r:
        assert r.status == 201
    await _until_every_process(mp, admin, lambda v: d2.url in v)

    # drain the first decode worker: no process sends it anything from then on
    async with fresh() as s, s.post(admin + "/admin/workers/drain", json={"pool": "decode", "url": d.url},
                                    headers=ADMIN_AUTH) as r:
        assert r.status == 200
    await _until_every_process(mp, admin, lambda v: v[d.url]["draining"])
    before = await metric(mp.url, "pd_proxy_upstream_requests_total", pool="decode", worker=d.url)
    n = 16
    async with fresh() as s:
        for i in range(n):
            body = {"token_ids": PROMPT, "sampling_params": {"max_tokens": 2, "temperature": 0}}
            async with s.post(mp.url + GEN, json=body, headers={"X-Request-Id": f"dr{i}"}) as r:
                assert r.status == 200
    assert served_by(mp.log_text()) == {"0", "1"}
    assert await metric(mp.url, "pd_proxy_upstream_requests_total", pool="decode", worker=d.url) == before
    assert await metric(mp.url, "pd_proxy_upstream_requests_total", pool="decode", worker=d2.url) == n

    # remove the worker that served: every process drops it, and /metrics (whichever process
    # answers, from the shared files) no longer shows its series
    async with fresh() as s, s.delete(admin + "/admin/workers", json={"pool": "decode", "url": d2.url},
                                      headers=ADMIN_AUTH) as r:
        assert r.status == 200
    await _until_every_process(mp, admin, lambda v: d2.url not in v)
    for _ in range(8):
        async with fresh() as s, s.get(mp.url + "/metrics") as r:
            text = await r.text()
        assert f'worker="{d2.url}"' not in text
        assert f'worker="{d.url}"' in text
