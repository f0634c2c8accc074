"""The soak benchmark, run for a few seconds: it starts its processes, applies faults, samples the
proxy, settles, and its verdict finds no leak (a short run of the real thing; the 10-minute figures
are in the reliability report)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.soak import SoakConfig, _reason, parse_args, parse_fault, percentile, soak

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
    # the objects: counted in every sample, and reachable ones before and after the load
    assert all(w["objects"] and w["objects"] > 10_000 for w in windows)
    assert report["checks"]["objects_ok"] and s["object_growth"] <= cfg.max_object_growth
    assert s["objects_final"] == s["objects_baseline"] + s["object_growth"]


def test_cli_defaults_are_the_ten_minute_soak() -> None:
    cfg = parse_args([])
    assert (cfg.duration, cfg.concurrency) == (600.0, 128)
    assert (cfg.max_object_growth, cfg.proxy_args) == (50_000, ())
    assert parse_args(["--duration", "5", "--concurrency", "3"]).concurrency == 3
    cfg = parse_args(["--proxy-arg=--log-level=debug", "--proxy-arg=--otel", "--max-object-growth", "9"])
    assert (cfg.proxy_args, cfg.max_object_growth) == (("--log-level=debug", "--otel"), 9)


def test_percentile() -> None:
    assert percentile([], 0.99) is None
    assert percentile([5.0], 0.99) == 5.0
    assert percentile([float(i) for i in range(1, 101)], 0.99) == 99.0


def test_a_scripted_fault_names_its_worker_and_a_kind_from_the_tables() -> None:
    assert parse_fault("p1:hang_before_headers") == ("prefill", 1, {"hang_before_headers": True})
    assert parse_fault("d0:fail_next") == ("decode", 0, {"fail_next": 25, "fail_status": 500})
    for bad in ("x0:hang_after_headers", "p:hang_after_headers", "p0:no_such_fault", "d0:refuse_kv_pulls"):
        with pytest.raises(ValueError, match="bad fault"):
            parse_fault(bad)
    assert parse_args(["--fault", "p0:drop_kv_params", "--fault", "d1:reset_after_tokens"]).faults == (
        "p0:drop_kv_params", "d1:reset_after_tokens")
    with pytest.raises(SystemExit):
        parse_args(["--fault", "d2:reset_after_tokens"])  # two decode workers: d0 and d1


def test_a_refusal_is_counted_with_its_reason() -> None:
    body = b'{"error":{"message":"no decode worker is available","type":"ServiceUnavailableError",' \
        b'"code":503}}'
    assert _reason(body) == "no decode worker is available"
    assert _reason(b"Bad Request") == "Bad Request"
    assert _reason(b"") == "?"
