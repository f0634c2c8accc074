"""``make demo``'s entry point, run against pd-sim workers (the real-vLLM path is the same code)."""

from __future__ import annotations

import io
import os
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from benchmarks import BenchConfig, BenchResult, RequestRecord
from deploy import demo


def _live_children() -> list[str]:
    """This test process's children that are still running (zombies excluded)."""
    out = subprocess.run(["ps", "-o", "pid=,stat=,args=", "--ppid", str(os.getpid())],
                         check=False, capture_output=True, text=True)  # fmt: skip
    return [line for line in out.stdout.splitlines() if line.split()[1][0] != "Z" and " ps " not in line]


def test_demo_sends_one_request_benchmarks_and_stops_everything(tmp_path: Path) -> None:
    out = io.StringIO()
    args = demo.parse_args(
        ["--workers", "sim", "--requests", "4", "--first-token-requests", "3", "--run-dir",
         str(tmp_path / "run"), "--result-dir", str(tmp_path / "results")]
    )  # fmt: skip
    assert demo.run(args, out) == 0
    text = out.getvalue()
    assert "KV crossed P->D over NIXL: yes" in text
    assert "one chat request through pd-proxy" in text and text.count("KV crossed P->D over NIXL: yes") == 2
    assert "Successful requests:                      4" in text
    assert "Failed requests:                          0" in text
    # the summary puts the hand-off gap beside TTFT: the second token waits for the KV pull
    summary = text.split("first token from the prefill worker, on vs off", 1)[0]
    gap = next(line.split() for line in summary.splitlines() if line.startswith("  2nd-token gap"))
    assert len(gap) == 2 + 3 + 4 and all(float(v) >= 0 for v in gap[2:])  # mean median std p50..p99
    # the local-prefill alarm scraped D after the benchmark and found every prompt's KV pulled
    alarm = next(line for line in summary.splitlines() if line.startswith("decode worker prefilled"))
    assert f"{demo.LOCAL_PREFILL} 0, {demo.FAILED_PULLS} 0, of " in alarm and alarm.endswith(
        "prompt tokens seen on D (ok, D pulled every prompt's KV)"), alarm
    printed = dict(
        line.split(":", 1) for line in text.splitlines() if ":" in line and not line.startswith(" ")
    )
    dashboards = Path(printed["Grafana dashboards"].strip())
    scrape = Path(printed["Prometheus scrape config"].strip())
    assert dashboards.is_absolute() and len(list(dashboards.glob("*.json"))) >= 4
    assert scrape.is_absolute() and "scrape_configs" in scrape.read_text()
    for key in ("result_json", "cdf_png"):  # the plots and the result, where the summary says
        path = Path(printed[key].strip())
        assert path.is_absolute() and path.is_file() and path.parent == tmp_path / "results", key
    # the first-token comparison: a second proxy with the feature off in front of the same workers
    section = text.split("first token from the prefill worker, on vs off", 1)[1]
    rows = {" ".join(line.split()[:-2]): line.split()[-2:] for line in section.splitlines()
            if line.startswith("  ")}  # fmt: skip
    assert rows["first token from P"] == ["3/3", "0/3"]  # P's token went first on every stream with it on
    assert rows["failed"] == ["0", "0"]
    for q in ("p50", "p99"):
        assert all(float(v) >= 0 for v in rows[f"2nd-token gap {q}"])
    assert rows["first_to_second p50"][1] == "-"  # no stream of the off proxy has the stage
    assert f"{demo.MISMATCH_COUNT} (on): 0" in section
    assert (tmp_path / "run" / "logs" / "pd-proxy-first-token-off.log").is_file()
    on_json = Path(printed["on result_json"].strip())
    off_json = Path(printed["off result_json"].strip())
    assert on_json.parent == off_json.parent == tmp_path / "results"
    assert "nothing left running" in text
    assert _live_children() == []


def test_demo_fails_when_the_kv_did_not_cross(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(demo, "metric_sum", lambda url, sample: 0.0)
    out = io.StringIO()
    args = demo.parse_args(
        ["--workers", "sim", "--requests", "2", "--first-token-requests", "0", "--run-dir",
         str(tmp_path / "run"), "--result-dir", str(tmp_path / "results")]
    )  # fmt: skip
    assert demo.run(args, out) == 1
    assert "KV crossed P->D over NIXL: NO" in out.getvalue()
    assert "on vs off" not in out.getvalue()  # 0 skips the comparison


@pytest.mark.parametrize("bad", ["-1", "201", "x"])
def test_first_token_requests_are_bounded(bad: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        demo.parse_args(["--workers", "sim", "--first-token-requests", bad])
    assert "--first-token-requests" in capsys.readouterr().err


def _record(i: int, chunks_ms: list[float], timing: dict[str, float] | None, ok: bool = True
            ) -> RequestRecord:  # fmt: skip
    rec = RequestRecord(index=i, request_id=f"r-{i}", target="t", prompt_len=8, requested_output_len=4)
    rec.success = ok
    rec.chunk_times_s = [t / 1000.0 for t in chunks_ms]
    rec.server_timing = timing
    return rec


def _result(records: list[RequestRecord], **data: float) -> BenchResult:
    ok = sum(r.success for r in records)
    data = {"completed": ok, "failed": len(records) - ok, **data}
    return BenchResult(config=BenchConfig(url="http://127.0.0.1:9"), data=data, records=records)


def test_first_token_side_takes_the_second_tokens_gap_and_who_sent_token_one() -> None:
    records = [
        _record(0, [50.0, 150.0, 160.0], {"prefill": 48.0, "first_to_second": 99.0}),
        _record(1, [60.0, 260.0, 270.0], {"prefill": 58.0, "first_to_second": 199.0}),
        _record(2, [55.0, 155.0], {"prefill": 50.0}),  # P's reply not used: D's token went first
        _record(3, [5.0, 9000.0], {"first_to_second": 1.0}, ok=False),  # failed: counted nowhere
        _record(4, [70.0], {"first_to_second": 2.0}),  # one token only: no second gap
    ]
    side = demo.first_token_side("on", _result(
        records, median_ttft_ms=55.0, p99_ttft_ms=69.6, median_hop_first_to_second_ms=149.0,
        p99_hop_first_to_second_ms=198.0, median_hop_prefill_ms=50.0, median_e2el_ms=300.0))  # fmt: skip
    assert demo.second_token_gaps_ms(records) == pytest.approx([100.0, 200.0, 100.0])
    assert (side.completed, side.failed, side.from_prefill) == (4, 1, 3)
    assert side.second_p50 == pytest.approx(100.0)  # numpy's linear percentiles, as pd-bench's
    assert side.second_p99 == pytest.approx(198.0)
    assert (side.ttft_p50, side.ttft_p99, side.first_to_second_p50, side.first_to_second_p99) == (
        55.0, 69.6, 149.0, 198.0)  # fmt: skip
    assert (side.prefill_p50, side.e2e_p50) == (50.0, 300.0)


def test_first_token_text_puts_on_and_off_side_by_side() -> None:
    on = demo.FirstTokenSide("on", 12, 0, 12, 47.0, 90.25, 70.0, 120.0, 70.4, 118.0, 45.0, 860.0)
    off = demo.FirstTokenSide("off", 12, 0, 0, 321.1, 800.0, 18.1, 30.0, None, None, 70.5, 900.0)
    text = demo.first_token_text(on, off, 0.0)
    table = {" ".join(line.split()[:-2]): line.split()[-2:] for line in text.splitlines()[1:-2]}
    assert table == {
        "TTFT p50": ["47.0", "321.1"],
        "TTFT p99": ["90.2", "800.0"],
        "2nd-token gap p50": ["70.0", "18.1"],
        "2nd-token gap p99": ["120.0", "30.0"],
        "first_to_second p50": ["70.4", "-"],
        "first_to_second p99": ["118.0", "-"],
        "prefill hop p50": ["45.0", "70.5"],
        "E2E p50": ["860.0", "900.0"],
        "first token from P": ["12/12", "0/12"],
        "failed": ["0", "0"],
    }
    assert text.splitlines()[0].split()[:3] == ["(ms)", "on", "off"]
    assert "TTFT p50 on - off: -274.1 ms (on is 0.15x off)" in text
    assert text.splitlines()[-1].strip() == f"{demo.MISMATCH_COUNT} (on): 0"


def test_first_token_text_without_numbers_says_so() -> None:
    empty = demo.FirstTokenSide("on", 0, 3, 0, None, None, None, None, None, None, None, None)
    text = demo.first_token_text(empty, replace(empty, setting="off"), None)
    assert "on - off" not in text  # no gain line without both TTFTs
    assert text.splitlines()[-1].strip() == f"{demo.MISMATCH_COUNT} (on): -"
    assert all(line.split()[-2:] == ["-", "-"] for line in text.splitlines()[1:9])
