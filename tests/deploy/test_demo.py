"""``make demo``'s entry point, run against pd-sim workers (the real-vLLM path is the same code)."""

from __future__ import annotations

import io
import os
import subprocess
from pathlib import Path

import pytest

from deploy import demo


def _live_children() -> list[str]:
    """This test process's children that are still running (zombies excluded)."""
    out = subprocess.run(["ps", "-o", "pid=,stat=,args=", "--ppid", str(os.getpid())],
                         check=False, capture_output=True, text=True)  # fmt: skip
    return [line for line in out.stdout.splitlines() if line.split()[1][0] != "Z" and " ps " not in line]


def test_demo_sends_one_request_benchmarks_and_stops_everything(tmp_path: Path) -> None:
    out = io.StringIO()
    args = demo.parse_args(
        ["--workers", "sim", "--requests", "4", "--run-dir", str(tmp_path / "run"),
         "--result-dir", str(tmp_path / "results")]
    )  # fmt: skip
    assert demo.run(args, out) == 0
    text = out.getvalue()
    assert "KV crossed P->D over NIXL: yes" in text
    assert "Successful requests:                      4" in text
    assert "Failed requests:                          0" in text
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
    assert "nothing left running" in text
    assert _live_children() == []


def test_demo_fails_when_the_kv_did_not_cross(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(demo, "metric_sum", lambda url, sample: 0.0)
    out = io.StringIO()
    args = demo.parse_args(
        ["--workers", "sim", "--requests", "2", "--run-dir", str(tmp_path / "run"),
         "--result-dir", str(tmp_path / "results")]
    )  # fmt: skip
    assert demo.run(args, out) == 1
    assert "KV crossed P->D over NIXL: NO" in out.getvalue()
