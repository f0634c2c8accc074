"""The speed benchmark's own plumbing (a short, bounded run; no speed is asserted here)."""

from __future__ import annotations

from benchmarks.sim_speed import run


async def test_sim_speed_counts_every_token() -> None:
    res = await run(concurrency=2, max_tokens=16, seconds=0.3, core=None, sim_args=[])
    assert res["requests"] >= 2
    assert res["tokens"] == res["requests"] * 16
    assert res["tokens_per_s"] > 0
