"""``benchmarks/internals/front_head.py``: its head is one the front serves itself, and the run
prints a row per length (the timings themselves are read by hand; numbers in the notes)."""

from __future__ import annotations

import pytest

from benchmarks.internals import front_head
from proxy.front import Head, parse_head


def test_the_benchmarks_head_is_parsed_by_the_front_with_its_blank_run_inside_the_value() -> None:
    parsed = parse_head(front_head.head(300), front_head.ROUTES, 1 << 20)
    assert isinstance(parsed, Head) and parsed.headers["X-Pad"] == "a" + " " * 300 + "b"


def test_a_run_prints_one_row_per_length(capsys: pytest.CaptureFixture[str]) -> None:
    front_head.main(["--lengths", "10,20", "--reps", "1"])
    rows = capsys.readouterr().out.splitlines()
    assert rows[0].split() == ["blanks", "parse", "(ms)"]
    assert [r.split()[0] for r in rows[1:]] == ["10", "20"]
