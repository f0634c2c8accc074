"""The call-count yardstick, run for a few requests against real pd-sim processes on 127.0.0.1."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import proxy
from benchmarks.internals.call_counts import _key, measure, print_diff

TREE = os.path.dirname(os.path.dirname(os.path.realpath(proxy.__file__)))


@pytest.mark.parametrize("stream", [False, True])
async def test_only_the_measured_requests_are_counted_each_once(stream: bool) -> None:
    report = await measure(4, stream, TREE)
    calls = report["calls_per_request"]
    assert report["requests"] == 4 and report["stream"] is stream
    assert calls["proxy/walk/core.py:set_done"] == 1.0  # each request ends once, and only the measured ones
    assert report["tasks_per_request"] >= 1.0  # at least aiohttp's handler task per request
    assert sum(calls.values()) > 100
    # the loop's counts: each hop waits on a future; the prefill hop arms its abort timer
    assert report["futures_per_request"] >= 2.0 and report["timers_per_request"] >= 1.0
    assert report["handles_per_request"] >= 1.0
    assert report["objects_per_request"] is None or report["objects_per_request"] > 100  # None: no cc
    assert report["sources_per_request"]["create_future"]


def test_diff_prints_the_totals_and_the_largest_changes(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # a: a run written before the loop counts existed (no timers key, no sources)
    a = {"tasks_per_request": 3.0, "calls_per_request": {"m.py:f": 10.0, "m.py:g": 2.0}}
    b = {"tasks_per_request": 3.0, "timers_per_request": 1.0,
         "sources_per_request": {"call_at": {"proxy/upstream/hop_wire.py:wait": 1.0}},
         "calls_per_request": {"m.py:f": 4.0, "m.py:h": 1.0}}
    (tmp_path / "a.json").write_text(json.dumps(a))
    (tmp_path / "b.json").write_text(json.dumps(b))
    print_diff(str(tmp_path / "a.json"), str(tmp_path / "b.json"), top=10)
    out = capsys.readouterr().out.splitlines()
    assert out[:6] == ["calls per request: 12.0 -> 5.0", "tasks per request: 3.00 -> 3.00",
                       "futures per request: - -> -", "timers per request: - -> 1.00",
                       "handles per request: - -> -", "objects per request: - -> -"]
    assert out[6].split() == ["call_at:", "+1.00", "0.00", "->", "1.00", "proxy/upstream/hop_wire.py:wait"]
    assert out[7].split() == ["-6.00", "10.00", "->", "4.00", "m.py:f"]
    assert {line.split()[-1] for line in out[8:]} == {"m.py:g", "m.py:h"}


def test_a_venv_inside_the_tree_is_named_as_site_packages_not_as_the_tree() -> None:
    venv = "/t/.venv/lib/python3.11/site-packages/aiohttp/web.py"
    assert _key(venv, "f", "/t") == "aiohttp/web.py:f"
    assert _key("/t/proxy/walk/core.py", "call", "/t") == "proxy/walk/core.py:call"
    assert _key("~", "<built-in method len>", "/t") == "~:<built-in method len>"
