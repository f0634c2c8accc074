"""benchmarks.cancel_bench: its plan, table, plot and command line, and one small run on pd-sim."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks import cancel_bench
from benchmarks.cancel_bench import FLOOR, PD_PROXY, Stack, bench_config, parse_args, plan, plot, table

REPO = Path(__file__).resolve().parents[2]


def _row(target: str, scenario: str, **kw: Any) -> dict[str, Any]:
    row: dict[str, Any] = dict.fromkeys(
        ("completed", "failed", "cancelled", "median_ttft_ms", "p99_ttft_ms", "ttft_penalty_median_ms",
         "ttft_penalty_p99_ms", "median_itl_ms", "p_cancels_holding", "p_cancel_to_free_median_ms",
         "p_cancel_to_free_max_ms", "p_stranded_block_s", "p_stranded_block_s_per_cancel", "p_not_freed",
         "d_cancel_to_free_median_ms", "d_cancel_to_free_max_ms")
    )  # fmt: skip
    row.update(target=target, scenario=scenario, isolated=False, **kw)
    return row


def test_targets_take_turns_in_a_rotating_order() -> None:
    got = list(plan(["a", "b", "c"], ["s1", "s2", "s3", "s4"]))
    assert [t for s, t in got if s == "s1"] == ["a", "b", "c"]
    assert [t for s, t in got if s == "s2"] == ["b", "c", "a"]
    assert [t for s, t in got if s == "s4"] == ["a", "b", "c"]


def test_table_and_plot(tmp_path: Path) -> None:
    rows = [
        _row(FLOOR, "before-first-token:disconnect", completed=42, cancelled=18, failed=0,
             p_cancel_to_free_median_ms=12.3, p_cancel_to_free_max_ms=5004.5, p_stranded_block_s=82.64,
             p_stranded_block_s_per_cancel=5.51, p_not_freed=0),
        _row(PD_PROXY, "before-first-token:disconnect", completed=42, cancelled=18, failed=0,
             p_cancel_to_free_max_ms=23.6),
    ]  # fmt: skip
    rows[0]["p_held_over_1s"] = 1
    rows[1].update(abort_calls=18, aborts_run_out=2)
    rows.reverse()  # the table orders them: floor first
    text = table(rows)
    lines = text.splitlines()
    assert len(lines) == 4 and all(line.count("|") == 13 for line in lines)
    assert "| before-first-token:disconnect | floor | 42 / 18 / 0 | - |" in lines[2]  # no abort calls
    assert "| pd-proxy | 42 / 18 / 0 | 2 |" in lines[3]
    assert "12.3 / 5004.5" in lines[2] and "82.64 (5.510)" in lines[2] and "| 1 / 0 |" in lines[2]
    assert "- / 23.6" in lines[3]  # a figure the run did not have is a dash
    png = plot(rows, tmp_path / "p.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_scenario_becomes_a_pd_bench_run(tmp_path: Path) -> None:
    cfg = parse_args(["--quick", "--result-dir", str(tmp_path)])
    stack = Stack(
        prefill="http://127.0.0.1:1", decode="http://127.0.0.1:2", targets={PD_PROXY: "http://127.0.0.1:3"}
    )
    floor = bench_config(cfg, stack, FLOOR, "before-first-token:abort", isolated=False)
    assert floor.two_hop == ("http://127.0.0.1:1", "http://127.0.0.1:2") and floor.url == "http://127.0.0.1:2"
    assert floor.cancel is not None and (floor.cancel.at, floor.cancel.mode) == (
        "before-first-token",
        "abort",
    )
    assert floor.kv_probes == ("http://127.0.0.1:1", "http://127.0.0.1:2") and not floor.kv_settle
    handoff = bench_config(cfg, stack, PD_PROXY, "after=0.05:abort", isolated=False)
    assert handoff.cancel is not None and (handoff.cancel.at, handoff.cancel.after_s) == (None, 0.05)
    assert cfg.scenarios[-1] == "after=0.05:disconnect"  # pd-sim's default adds the hand-off window
    first = bench_config(cfg, stack, PD_PROXY, "first-token:abort", isolated=False)
    assert first.cancel is not None and (first.cancel.at, first.cancel.mode) == ("first-token", "abort")
    iso = bench_config(cfg, stack, PD_PROXY, "mid-stream:disconnect", isolated=True)
    assert iso.url == "http://127.0.0.1:3" and iso.two_hop is None
    assert iso.max_concurrency == 1 and iso.kv_settle and iso.cancel is not None and iso.cancel.rate == 1.0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--real-vllm"], "--real-vllm needs --model"),
        (["--targets", "floor,haproxy"], "unknown target"),
        (["--scenarios", "sometime:disconnect"], "bad scenario"),
        (["--scenarios", "after=-1:disconnect"], "bad scenario"),
        (["--target", "r=http://127.0.0.1:5"], "--target needs --workers"),
    ],
)
def test_bad_arguments(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert message in capsys.readouterr().err


def test_real_vllm_defaults_are_sized_for_the_cpu_pair(tmp_path: Path) -> None:
    cfg = parse_args(["--real-vllm", "--model", str(tmp_path)])
    assert cfg.real_vllm and cfg.isolated == 5 and cfg.lease_s == 10 and cfg.num_prompts == 40
    assert cfg.request_rate == 2.0 and cfg.max_concurrency == 4
    assert not any(s.startswith("after=") for s in cfg.scenarios)  # no fixed hand-off time on vLLM


def test_a_small_run_on_pd_sim(tmp_path: Path) -> None:
    # Three processes (pd-sim P and D, pd-proxy), one scenario, 8 requests per run; vllm-router
    # is asked for with a binary that does not exist: it is left out, with a message.
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable, "-m", "benchmarks.cancel_bench", "--quick", "--num-prompts", "8",
            "--num-warmups", "1", "--targets", "floor,pd-proxy,vllm-router", "--router-bin",
            str(tmp_path / "no-router"), "--scenarios", "before-first-token:disconnect",
            "--result-dir", str(out), "--lease-seconds", "2",
        ],
        cwd=REPO, capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "vllm-router not installed" in proc.stderr
    result = json.loads((out / "result.json").read_text())
    assert [r["target"] for r in result["rows"]] == [FLOOR, PD_PROXY]
    assert "vllm-router" in result["meta"]["skipped_targets"]
    for row in result["rows"]:
        assert row["completed"] + row["cancelled"] == 8 and row["failed"] == 0
        assert row["p_cancels_holding"] is not None
    floor, proxy = result["rows"]
    assert "proxy_leases_closed" not in floor
    # pd-proxy's ledger: every lease of both runs closed, none by running out
    closed = proxy["proxy_leases_closed"]
    assert closed.get("pulled", 0) >= 8 and closed.get("expired", 0) == 0
    assert (out / "table.md").read_text().count("\n") == 4
    assert (out / "cancel_bench.png").exists()
    assert not [line for line in proc.stdout.splitlines() if "Traceback" in line]


def test_module_docstring_names_every_target() -> None:
    doc = cancel_bench.__doc__ or ""
    assert all(t in doc for t in cancel_bench.TARGETS)
