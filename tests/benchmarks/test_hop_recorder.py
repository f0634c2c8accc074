"""benchmarks.hop_recorder in front of pd-sim: the bytes both ways are those of the worker, a
stream's chunks are kept in order, and one record per request is written (credentials redacted)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import IO, Any

import aiohttp
import pytest
from aiohttp import web

from benchmarks.hop_recorder import build_app, hop_pairs, read_records, side_calls
from benchmarks.sim_stack import free_port
from tests import sse

GENERATE = "/inference/v1/generate"
KEY = "sk-do-not-log-me"
Start = Callable[[str], Awaitable[tuple[str, Path]]]


@pytest.fixture
async def recorder(tmp_path: Path) -> AsyncIterator[Start]:
    """Starts a recorder in front of an upstream URL: (its URL, its record file)."""
    runners: list[web.AppRunner] = []
    files: list[IO[str]] = []

    async def start(upstream: str) -> tuple[str, Path]:
        path = tmp_path / f"hops-{len(runners)}.jsonl"
        fh = path.open("a")
        files.append(fh)
        runner = web.AppRunner(build_app(upstream, fh, timeout_s=30.0), handler_cancellation=True,
                               access_log=None, shutdown_timeout=1.0)
        await runner.setup()
        runners.append(runner)
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = next(int(a[1]) for a in runner.addresses if isinstance(a, tuple))
        return f"http://127.0.0.1:{port}", path

    try:
        yield start
    finally:
        for r in runners:
            await r.cleanup()
        for fh in files:
            fh.close()


def gen_body(rid: str, *, stream: bool, max_tokens: int = 6) -> dict[str, Any]:
    return {"request_id": rid, "token_ids": list(range(3, 40)), "stream": stream, "output_mode": "text",
            "sampling_params": {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}}


async def post_raw(url: str, body: bytes, headers: dict[str, str]) -> tuple[int, bytes, list[bytes]]:
    """Status, the whole body and the body as read piece by piece."""
    async with aiohttp.ClientSession() as s, s.post(url + GENERATE, data=body, headers=headers,
                                                    timeout=aiohttp.ClientTimeout(total=30)) as r:
        pieces = [p async for p in r.content.iter_any()]
        return r.status, b"".join(pieces), pieces


async def records_when(path: Path, count: int) -> list[dict[str, Any]]:
    """The file's records once it holds ``count`` (polled, at most 10 s)."""
    for _ in range(200):
        recs = read_records(path)
        if len(recs) >= count:
            return recs
        await asyncio.sleep(0.05)
    raise AssertionError(f"{path}: fewer than {count} records after 10 s")


@pytest.mark.parametrize("stream", [False, True])
async def test_answers_are_the_workers_bytes_and_each_request_is_recorded(
        sim_factory: Any, recorder: Start, stream: bool) -> None:
    sim = await sim_factory(role="aggregated", zero_latency=True, api_key=KEY)
    url, path = await recorder(sim.url)
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}", "X-Request-Id": "r1"}
    raw = json.dumps(gen_body("r1", stream=stream)).encode()

    direct = await post_raw(sim.url, raw, headers)
    through = await post_raw(url, raw, headers)

    assert direct[0] == through[0] == 200  # the key reached the worker
    assert through[1] == direct[1]
    (rec,) = await records_when(path, 1)
    assert rec["method"] == "POST" and rec["path"] == GENERATE and rec["status"] == 200
    assert rec["outcome"] == "ok"
    assert rec["body"] == json.loads(raw) and rec["body_bytes"] == len(raw)
    sent = {k.lower(): v for k, v in rec["headers"]}
    assert sent["authorization"] == "<redacted>" and sent["x-request-id"] == "r1"
    assert KEY not in path.read_text()
    assert rec["chunk_text"].encode() == direct[1]
    assert sum(n for _, n in rec["chunks"]) == len(direct[1])
    times = [t for t, _ in rec["chunks"]]
    assert times == sorted(times) and rec["headers_ms"] <= times[0] <= rec["done_ms"]
    assert rec["body_read_ms"] <= rec["headers_ms"]


async def test_a_streams_chunks_are_recorded_in_order(sim_factory: Any, recorder: Start) -> None:
    """pd-sim spaces the tokens: the events reach the client, and the record, in the worker's order."""
    sim = await sim_factory(role="aggregated", prefill_base_ms=0, prefill_per_token_ms=0, itl_ms=5.0)
    url, path = await recorder(sim.url)
    raw = json.dumps(gen_body("r2", stream=True, max_tokens=8)).encode()
    status, whole, _ = await post_raw(url, raw, {"Content-Type": "application/json"})
    direct = await post_raw(sim.url, raw, {"Content-Type": "application/json"})
    assert status == 200 and whole == direct[1]
    assert len(sse.json_events(whole)) == 8
    (rec,) = await records_when(path, 1)
    assert rec["chunk_text"].encode() == whole
    assert sum(n for _, n in rec["chunks"]) == len(whole)
    times = [t for t, _ in rec["chunks"]]
    assert times == sorted(times)


async def test_every_request_is_recorded_gets_and_errors_too(sim_factory: Any, recorder: Start) -> None:
    sim = await sim_factory(role="decode", zero_latency=True)
    url, path = await recorder(sim.url)
    async with aiohttp.ClientSession() as s:
        for p in ("/health", "/metrics", "/v1/models?x=1"):
            async with s.get(url + p) as r, s.get(sim.url + p) as d:
                assert r.status == d.status == 200
                if p == "/health":  # the others hold counters and times that move between reads
                    assert await r.read() == await d.read()
        json_type = {"Content-Type": "application/json"}
        async with s.post(url + GENERATE, data=b"not json", headers=json_type) as r:
            assert r.status == 400
    recs = await records_when(path, 4)
    assert [(r["method"], r["path"], r["status"]) for r in recs] == [
        ("GET", "/health", 200), ("GET", "/metrics", 200), ("GET", "/v1/models?x=1", 200),
        ("POST", GENERATE, 400)]
    assert recs[-1]["body_text"] == "not json" and "body" not in recs[-1]


async def test_an_unreachable_upstream_is_a_502_and_recorded(recorder: Start) -> None:
    url, path = await recorder(f"http://127.0.0.1:{free_port()}")  # nothing listens there
    status, body, _ = await post_raw(url, b"{}", {"Content-Type": "application/json"})
    assert status == 502
    assert set(json.loads(body)["error"]) == {"message", "type", "param", "code"}
    (rec,) = await records_when(path, 1)
    assert rec["outcome"] == "upstream_error" and rec["status"] is None


async def test_a_client_gone_mid_stream_closes_the_hop_and_is_recorded(
        sim_factory: Any, recorder: Start) -> None:
    sim = await sim_factory(role="aggregated", prefill_base_ms=0, prefill_per_token_ms=0, itl_ms=50.0)
    url, path = await recorder(sim.url)
    raw = json.dumps(gen_body("r3", stream=True, max_tokens=200)).encode()
    async with aiohttp.ClientSession() as s:
        r = await s.post(url + GENERATE, data=raw, headers={"Content-Type": "application/json"})
        assert r.status == 200
        await r.content.readuntil(b"\n\n")  # one event, then the client goes away
        (running,) = (await sim.state())["inflight"]
        assert running["output_tokens"] < 200  # the event came before the worker's answer ended
        r.close()
    (rec,) = await records_when(path, 1)
    assert rec["outcome"] == "client_gone" and rec["status"] == 200 and rec["chunks"]
    for _ in range(200):  # the worker saw its client (the recorder) go: nothing left running
        if not (await sim.state())["inflight"]:
            break
        await asyncio.sleep(0.05)
    else:
        raise AssertionError("the worker still runs the request 10 s after its client went")


def hop(path: str, arrived: float, prompt: list[int] | None, chunks: list[list[float]],
        method: str = "POST") -> dict[str, Any]:
    body = None if prompt is None else {"token_ids": prompt}
    return {"method": method, "path": path, "arrived": arrived, "body": body, "chunks": chunks}


def test_hop_pairs_matches_each_decode_hop_to_its_prompts_last_prefill_hop() -> None:
    p = [hop(GENERATE, 100.0, [5, 6], [[200.0, 10]]),       # a first try of prompt [5, 6]
         hop(GENERATE, 101.0, [5, 6], [[300.0, 10]]),       # its retry: last byte at 101.3
         hop(GENERATE, 100.0, [7], [[50.0, 10]]),
         hop("/health", 100.5, None, [])]
    d = [hop(GENERATE, 101.302, [5, 6], [[20.0, 5], [90.0, 5]]),
         hop(GENERATE, 100.1, [9], [[1.0, 5]])]             # decode-only: no prefill hop
    (pair,) = hop_pairs(p, d)
    assert pair["p_answer_ms"] == 300.0
    assert pair["d_after_p_last_ms"] == pytest.approx(2.0, abs=1e-3)
    assert (pair["d_first_chunk_ms"], pair["d_last_chunk_ms"]) == (20.0, 90.0)


def test_side_calls_counts_what_is_not_a_generate_hop_per_second() -> None:
    recs = [hop("/health", 10.0 + i, None, [], "GET") for i in range(4)]
    recs += [hop("/metrics?x=1", 11.0, None, [], "GET"), hop(GENERATE, 11.0, [3], []),
             hop("/health", 20.0, None, [], "GET")]  # outside the window
    assert side_calls(recs, 10.0, 14.0) == {"GET /health": 1.0, "GET /metrics": 0.25}
