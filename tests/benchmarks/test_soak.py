"""The soak benchmark, run for a few seconds: it starts its processes, applies faults, samples the
proxy, settles, and its verdict finds no leak (a short run of the real thing; the 10-minute figures
are in the reliability report)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.soak import SoakConfig, parse_args, percentile, soak

pytestmark = pytest.mark.timeout(120)


async def test_a_short_soak_finds_no_leak(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    cfg = SoakConfig(duration=3.0, concurrency=6, interval=1.0, fault_period=1.0, warmup=0.0,
                     prefill_workers=1, decode_workers=1, settle_timeout=30.0, quiet=True, out=str(out))
    report = await soak(cfg)
    assert report["ok"], report["checks"]
    assert json.loads(out.read_text())["summary"] == report["summary"]
    s = report["summary"]
    assert s["requests"] > 0 and s["outcomes"].get("ok", 0) > 0
    assert s["leaked_tasks"] <= cfg.task_slack and s["connections_in_use_final"] == 0
    assert s["kv_held_final"] == 0
    windows = report["windows"]
    assert len(windows) >= 3  # one per interval, then the final one
    assert any(w["fault"] for w in windows), "faults were switched on during the run"
    assert all(w["rss_mib"] and w["rss_mib"] > 0 for w in windows)


def test_cli_defaults_are_the_ten_minute_soak() -> None:
    cfg = parse_args([])
    assert (cfg.duration, cfg.concurrency) == (600.0, 128)
    assert parse_args(["--duration", "5", "--concurrency", "3"]).concurrency == 3


def test_percentile() -> None:
    assert percentile([], 0.99) is None
    assert percentile([5.0], 0.99) == 5.0
    assert percentile([float(i) for i in range(1, 101)], 0.99) == 99.0
