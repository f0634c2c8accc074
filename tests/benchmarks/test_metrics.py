"""The metric arithmetic against hand-computed values."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies

from benchmarks.metrics import (
    GoodputSpecError,
    chunk_itls,
    compute_metrics,
    parse_goodput,
    second_token_gaps,
    stats,
    token_itls,
    tpot,
    ttft_unattributed,
)
from benchmarks.records import FAIL_HTTP_STATUS, RequestRecord
from benchmarks.report import summary_table


def rec(
    i: int,
    prompt_len: int,
    chunk_times: list[float],
    chunk_tokens: list[int],
    e2e: float,
    ok: bool = True,
    timing: dict[str, float] | None = None,
) -> RequestRecord:
    r = RequestRecord(i, f"r{i}", "t", prompt_len, sum(chunk_tokens) or 1)
    r.chunk_times_s = chunk_times
    r.chunk_tokens = chunk_tokens
    r.output_tokens = sum(chunk_tokens)
    r.ttft_s = chunk_times[0] if chunk_times else None
    r.e2e_s = e2e
    r.success = ok
    r.server_timing = timing
    if not ok:
        r.failure = FAIL_HTTP_STATUS
    return r


TIMING_A = {"queue": 1.0, "prefill": 60.0, "handoff": 10.0, "decode_ttft": 25.0, "total": 250.0}
# A: 5 tokens in chunks of 1,1,2,1; B: 3 tokens in chunks of 2,1; C failed; D: one token.
A = rec(0, 10, [0.10, 0.13, 0.19, 0.25], [1, 1, 2, 1], 0.26, timing=TIMING_A)
B = rec(1, 20, [0.20, 0.22], [2, 1], 0.30)
C = rec(2, 7, [0.05], [1], 0.5, ok=False)
D = rec(3, 5, [0.05], [1], 0.06)
RECORDS = [A, B, C, D]


def test_per_request_definitions() -> None:
    assert chunk_itls(A.chunk_times_s) == pytest.approx([0.03, 0.06, 0.06])
    # the third chunk's 60 ms gap is spread over its two tokens
    assert token_itls(A.chunk_times_s, A.chunk_tokens) == pytest.approx([0.03, 0.03, 0.03, 0.06])
    assert tpot(0.26, 0.10, 5) == pytest.approx(0.04)
    assert tpot(0.06, 0.05, 1) is None
    assert tpot(0.06, None, 3) is None
    # tokens of the first chunk contribute no per-token ITL
    assert token_itls(B.chunk_times_s, B.chunk_tokens) == pytest.approx([0.02])
    with pytest.raises(ValueError):
        token_itls([0.1, 0.2], [1])


def test_stats_match_hand_computation() -> None:
    st = stats([0.1, 0.2, 0.05], (50.0, 90.0, 99.0))
    assert st is not None
    assert st.mean == pytest.approx(0.116667, abs=1e-6)
    assert st.median == pytest.approx(0.1)
    assert st.std == pytest.approx(math.sqrt(((-1 / 60) ** 2 + (1 / 12) ** 2 + (1 / 15) ** 2) / 3))
    assert st.percentiles[90.0] == pytest.approx(0.18)  # linear between 100 and 200 ms
    assert st.percentiles[99.0] == pytest.approx(0.198)
    assert stats([]) is None
    single = stats([3.0], (99.0,))
    assert single is not None and single.percentiles[99.0] == 3.0


@settings(deadline=None)  # no timing in tests: a busy machine must not fail them
@given(strategies.lists(strategies.floats(min_value=0, max_value=1e6, allow_nan=False), min_size=2))
def test_percentiles_match_numpy_linear(values: list[float]) -> None:
    qs = (0.0, 1.0, 50.0, 90.0, 99.0, 99.5, 100.0)
    got = stats(values, qs)
    assert got is not None
    for q in qs:
        assert got.percentiles[q] == pytest.approx(float(np.percentile(values, q)), rel=1e-9, abs=1e-9)


def test_aggregate_result() -> None:
    m = compute_metrics(RECORDS, duration_s=2.0, percentiles=(50.0, 90.0, 99.0))
    assert m["completed"] == 3
    assert m["failed"] == 1
    assert m["failures"][FAIL_HTTP_STATUS] == 1
    assert sum(m["failures"].values()) == 1
    assert m["total_input_tokens"] == 35  # the failed request's prompt does not count
    assert m["total_output_tokens"] == 9
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["output_throughput"] == pytest.approx(4.5)
    assert m["total_token_throughput"] == pytest.approx(22.0)
    assert m["mean_ttft_ms"] == pytest.approx(116.6667, abs=1e-3)
    assert m["median_ttft_ms"] == pytest.approx(100.0)
    assert m["p90_ttft_ms"] == pytest.approx(180.0)
    assert m["std_ttft_ms"] == pytest.approx(62.3610, abs=1e-3)
    assert m["mean_itl_ms"] == pytest.approx(42.5)  # 30, 60, 60, 20
    assert m["median_itl_ms"] == pytest.approx(45.0)
    assert m["mean_itl_token_ms"] == pytest.approx(34.0)  # 30, 30, 30, 60, 20
    assert m["median_itl_token_ms"] == pytest.approx(30.0)
    assert m["mean_tpot_ms"] == pytest.approx(45.0)  # 40 and 50; D has one token
    assert m["p90_tpot_ms"] == pytest.approx(49.0)
    assert m["mean_e2el_ms"] == pytest.approx(206.6667, abs=1e-3)
    assert m["median_e2el_ms"] == pytest.approx(260.0)
    assert m["request_goodput"] is None
    # only A carries pd-proxy timings: 100 ms TTFT - (1 + 60 + 10 + 25) = 4 ms unattributed
    assert m["hops"] == ["queue", "prefill", "handoff", "decode_ttft", "total"]
    assert m["mean_hop_prefill_ms"] == pytest.approx(60.0)
    assert m["mean_ttft_unattributed_ms"] == pytest.approx(4.0)
    assert m["server_timing_requests"] == 1


def test_goodput() -> None:
    m = compute_metrics(RECORDS, 2.0, goodput_ms={"ttft": 150.0})
    assert m["request_goodput"] == pytest.approx(1.0)  # A (100 ms) and D (50 ms); B is 200 ms
    m = compute_metrics(RECORDS, 2.0, goodput_ms={"ttft": 150.0, "tpot": 35.0})
    assert m["request_goodput"] == pytest.approx(0.5)  # A's TPOT is 40 ms; D's counts as 0
    assert m["goodput_fraction"] == pytest.approx(0.25)  # 1 of 4 sent
    m = compute_metrics(RECORDS, 2.0, goodput_ms={"e2el": 300.0})
    assert m["request_goodput"] == pytest.approx(1.5)


def test_empty_metrics_are_null_not_zero() -> None:
    m = compute_metrics([C], 1.0)
    assert m["completed"] == 0
    assert m["mean_ttft_ms"] is None
    assert m["p99_itl_ms"] is None
    assert m["request_throughput"] == 0.0


def test_parse_goodput() -> None:
    assert parse_goodput("ttft:500,tpot:50,e2el:2000") == {"ttft": 500.0, "tpot": 50.0, "e2el": 2000.0}
    assert parse_goodput(None) == {}
    for bad in ("ttft", "itl:5", "ttft:x", "ttft:-1", "ttft:0"):
        with pytest.raises(GoodputSpecError):
            parse_goodput(bad)


# --first-token-from-prefill on: the client's first token is P's (TTFT ends after queue + prefill),
# and pd-proxy adds first_to_second (P's token to the next write), before "total".
TIMING_P_FIRST = {
    "queue": 1.0, "prefill": 50.0, "handoff": 5.0, "decode_ttft": 140.0,
    "first_to_second": 148.0, "total": 400.0,
}  # fmt: skip
P_FIRST = rec(4, 10, [0.055, 0.205, 0.235], [1, 1, 1], 0.24, timing=TIMING_P_FIRST)


def test_first_to_second_is_a_known_hop_and_ttft_ends_at_the_prefill_token() -> None:
    m = compute_metrics([A, P_FIRST], 1.0)
    assert m["hops"] == ["queue", "prefill", "handoff", "decode_ttft", "first_to_second", "total"]
    assert m["mean_hop_first_to_second_ms"] == pytest.approx(148.0)
    assert m["median_hop_first_to_second_ms"] == pytest.approx(148.0)
    # A: 100 - (1 + 60 + 10 + 25) = 4 ms; P_FIRST: 55 - (1 + 50) = 4 ms (not 55 - 196 < 0)
    assert ttft_unattributed(P_FIRST) == pytest.approx(0.004)
    assert m["mean_ttft_unattributed_ms"] == pytest.approx(4.0)
    text = summary_table({**m, "percentiles": [50.0, 99.0]})
    assert "hop first_to_second" in text
    assert text.index("hop first_to_second") < text.index("hop total")
    rows = [line for line in text.splitlines() if line.startswith(("(ms)", "TTFT ", "  hop "))]
    # the columns stay aligned: every row's first number ends where the "mean" header ends
    mean_end = rows[0].index("mean") + len("mean")
    assert all(line[mean_end - 1] != " " and line[mean_end] == " " for line in rows[1:]), rows


def test_the_second_tokens_gap_is_the_hand_off_the_client_waits_for() -> None:
    # A: first chunk at 100 ms, second at 130; B: 200 -> 220; C failed and D has one chunk: no gap
    assert second_token_gaps(RECORDS) == pytest.approx([0.03, 0.02])
    m = compute_metrics([*RECORDS, P_FIRST], 1.0)
    # P_FIRST: P's token at 55 ms, D's next at 205 ms: the TTFT win is paid in this gap
    assert m["median_second_token_gap_ms"] == pytest.approx(30.0)
    assert m["p99_second_token_gap_ms"] == pytest.approx(np.percentile([30.0, 20.0, 150.0], 99))
    assert m["mean_second_token_gap_ms"] == pytest.approx((30.0 + 20.0 + 150.0) / 3)


def test_the_summary_prints_the_second_tokens_gap_beside_ttft() -> None:
    m = compute_metrics([A, B, P_FIRST], 1.0)
    text = summary_table({**m, "percentiles": [50.0, 99.0]})
    lines = text.splitlines()
    ttft = next(i for i, line in enumerate(lines) if line.startswith("TTFT "))
    gap = lines[ttft + 1].split()
    assert gap[:2] == ["2nd-token", "gap"]
    mean, median, _std, p50, p99 = (float(v) for v in gap[2:])
    assert median == pytest.approx(30.0) and p50 == pytest.approx(30.0)
    assert p99 == pytest.approx(np.percentile([30.0, 20.0, 150.0], 99), abs=0.01)
    assert mean == pytest.approx(200.0 / 3, abs=0.01)
    # the columns stay aligned with the header's
    mean_end = lines[ttft - 1].index("mean") + len("mean")
    assert lines[ttft + 1][mean_end - 1] != " " and lines[ttft + 1][mean_end] == " "


def test_without_a_second_token_the_summary_has_no_gap_row() -> None:
    m = compute_metrics([D], 1.0)  # one chunk only (a non-stream answer looks the same)
    assert m["median_second_token_gap_ms"] is None
    assert "2nd-token gap" not in summary_table({**m, "percentiles": [50.0, 99.0]})
