"""The head-to-head on one P/D pair: its plan (pairing, rotation, fresh prompts), its arithmetic
(per-request figures, per-pair ratios, the median's interval, the workers' histograms), its options,
and the tool end to end against pd-sim workers it starts itself. No timing assertions."""

from __future__ import annotations

import json
import math
import os
import subprocess
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies

from benchmarks import real_routers as rr
from benchmarks.cancel_bench import find_router
from benchmarks.real_routers import PD_PROXY, PD_PROXY_OFF, TARGETS, VLLM_ROUTER, Sample
from benchmarks.records import FAIL_HTTP_STATUS, RequestRecord

TRACES = Path(__file__).resolve().parent.parent / "data" / "traces" / "vllm-0.32.0-cpu"


def _live_children() -> list[str]:
    """This test process's children that are still running (zombies excluded)."""
    out = subprocess.run(["ps", "-o", "pid=,stat=,args=", "--ppid", str(os.getpid())],
                         check=False, capture_output=True, text=True)  # fmt: skip
    return [line for line in out.stdout.splitlines() if line.split()[1][0] != "Z" and " ps " not in line]


# --------------------------------------------------------------------------------------------
# The plan.


def test_every_target_takes_every_position_equally_often_in_each_lane() -> None:
    for lane in range(4):
        counts: Counter[tuple[str, int]] = Counter()
        for rnd in range(6):  # two full rotations
            order = rr.round_order(TARGETS, lane, rnd)
            assert sorted(order) == sorted(TARGETS)  # a round is a triple: each target once
            counts.update((t, pos) for pos, t in enumerate(order))
        assert counts == {(t, pos): 2 for t in TARGETS for pos in range(3)}


def test_lanes_side_by_side_start_with_different_targets() -> None:
    assert [rr.round_order(TARGETS, lane, 0)[0] for lane in range(3)] == [PD_PROXY, PD_PROXY_OFF, VLLM_ROUTER]
    assert rr.round_order([], 0, 0) == []


def test_prompts_are_fresh_per_request_and_per_seed() -> None:
    a = list(rr.prompts(7, 50, 448))
    assert a == list(rr.prompts(7, 50, 448))  # the seed (recorded) replays the run
    assert all(len(p) == 448 and all(rr.TOKEN_LOW <= t < rr.TOKEN_HIGH for t in p) for p in a)
    # no two share even their first 16 tokens (a prefix-cache block of pd-sim; vLLM's CPU block is 128)
    assert len({tuple(p[:16]) for p in a}) == 50
    b = list(rr.prompts(8, 50, 448))
    assert not {tuple(p[:16]) for p in a} & {tuple(p[:16]) for p in b}


# --------------------------------------------------------------------------------------------
# Arithmetic.


def _record(chunk_times: list[float], e2e: float, ok: bool = True) -> RequestRecord:
    r = RequestRecord(0, "r", "t", 8, len(chunk_times))
    r.chunk_times_s = chunk_times
    r.chunk_tokens = [1] * len(chunk_times)
    r.output_tokens = len(chunk_times)
    r.ttft_s = chunk_times[0] if chunk_times else None
    r.e2e_s = e2e
    r.success = ok
    if not ok:
        r.failure, r.http_status, r.error = FAIL_HTTP_STATUS, 502, "HTTP 502: bad gateway"
    return r


WHERE = Sample(target=PD_PROXY, concurrency=1, lane=0, round=0, position=0, ok=False)


def test_a_request_gives_ttft_the_hand_off_gap_itl_tpot_and_e2e() -> None:
    # first token (from P) at 50 ms, the second after the KV pull at 200, then 10 ms apart
    s = rr.sample_of(_record([0.05, 0.20, 0.21, 0.22], 0.23), WHERE)
    assert s.ok and s.target == PD_PROXY
    assert s.ttft == pytest.approx(50.0)
    assert s.second_token_gap == pytest.approx(150.0)
    assert s.itls == pytest.approx((150.0, 10.0, 10.0))
    assert s.itl == pytest.approx(170.0 / 3)
    assert s.itl_after_second == pytest.approx(10.0)  # the hand-off is not in it
    assert s.tpot == pytest.approx((230.0 - 50.0) / 3)
    assert s.e2e == pytest.approx(230.0)


def test_a_failed_request_says_why_and_has_no_figures() -> None:
    s = rr.sample_of(_record([0.05], 0.06, ok=False), WHERE)
    assert not s.ok and s.error is not None and "502" in s.error
    assert (s.ttft, s.e2e, s.itls) == (None, None, ())


@pytest.mark.parametrize(
    ("n", "expected"),
    [
        (5, None),  # even (x_1, x_5) covers only 1 - 2/32 = 0.9375
        (6, (1, 6, 1 - 2 / 64)),
        (10, (2, 9, 1 - 2 * 11 / 1024)),
        (20, (6, 15, 1 - 2 * 21700 / 2**20)),  # the textbook ranks for n = 20
    ],
)
def test_median_ranks_are_the_binomial_order_statistics(
    n: int, expected: tuple[int, int, float] | None
) -> None:
    got = rr.median_ranks(n)
    if expected is None:
        assert got is None
    else:
        assert got is not None
        assert got[:2] == expected[:2] and got[2] == pytest.approx(expected[2])


@settings(max_examples=60, deadline=None)
@given(strategies.integers(min_value=1, max_value=300))
def test_median_ranks_cover_at_least_95_percent_and_are_the_narrowest(n: int) -> None:
    def coverage(j: int) -> float:  # P(j <= B <= n - j), B ~ binomial(n, 1/2)
        return float(sum(math.comb(n, i) for i in range(j, n - j + 1)) / 2**n)

    got = rr.median_ranks(n)
    if got is None:
        assert coverage(1) < 0.95
        return
    j, k, cov = got
    assert k == n - j + 1 and cov == pytest.approx(coverage(j)) and cov >= 0.95
    assert j == n // 2 or coverage(j + 1) < 0.95  # one step narrower misses 95%


def test_median_interval_takes_the_ranked_values() -> None:
    values = [1.3, 0.9, 1.1, 1.0, 1.2, 0.8, 1.4, 0.7, 1.5, 0.6]  # 0.6 .. 1.5
    doc = rr.median_interval(values)
    assert doc["median"] == pytest.approx(1.05)
    assert (doc["low"], doc["high"]) == (pytest.approx(0.7), pytest.approx(1.4))  # x_(2), x_(9)
    assert doc["n"] == 10 and doc["method"] == "binomial order statistics"
    few = rr.median_interval([1.0, 2.0])
    assert few["median"] == pytest.approx(1.5) and few["low"] is None and few["high"] is None


def test_ratios_pair_the_requests_of_one_round_and_skip_failures() -> None:
    def s(target: str, lane: int, rnd: int, ttft: float | None, ok: bool = True) -> Sample:
        return Sample(target=target, concurrency=4, lane=lane, round=rnd, position=0, ok=ok, ttft=ttft)

    samples = [
        s(PD_PROXY, 0, 0, 80.0), s(VLLM_ROUTER, 0, 0, 100.0),
        s(PD_PROXY, 1, 0, 60.0), s(VLLM_ROUTER, 1, 0, 50.0),
        s(PD_PROXY, 0, 1, 70.0), s(VLLM_ROUTER, 0, 1, None, ok=False),  # no pair: the baseline failed
        s(PD_PROXY, 1, 1, None, ok=False), s(VLLM_ROUTER, 1, 1, 40.0),  # no pair: the target failed
        s(PD_PROXY_OFF, 0, 0, 120.0),
    ]  # fmt: skip
    assert sorted(rr.pair_ratios(samples, PD_PROXY, VLLM_ROUTER, "ttft")) == pytest.approx([0.8, 1.2])
    assert rr.pair_ratios(samples, PD_PROXY_OFF, VLLM_ROUTER, "ttft") == pytest.approx([1.2])
    ratios = rr.level_ratios(samples, [PD_PROXY, PD_PROXY_OFF, VLLM_ROUTER], VLLM_ROUTER, 4)
    assert set(ratios) == {PD_PROXY, PD_PROXY_OFF} and set(ratios[PD_PROXY]) == set(rr.RATIO_METRICS)
    assert ratios[PD_PROXY]["ttft"]["median"] == pytest.approx(1.0)  # round 0's median of 0.8 and 1.2
    assert ratios[PD_PROXY]["ttft"]["n"] == 1 and ratios[PD_PROXY]["ttft"]["unit"] == "round"


def _correlated_level(lanes: int, rounds: int) -> list[Sample]:
    """Lanes that move together within a round: every round has its own ratio (set by what the
    workers were doing then), and its lanes scatter only a little around it."""
    round_ratio = [0.93, 1.02, 1.04, 1.05, 1.06, 1.08, 1.10, 1.20]
    out = []
    for rnd in range(rounds):
        for lane in range(lanes):
            ratio = round_ratio[rnd % len(round_ratio)] + 0.001 * (lane - lanes / 2)
            for target, e2e in ((PD_PROXY, 500.0 * ratio), (VLLM_ROUTER, 500.0)):
                out.append(Sample(target=target, concurrency=lanes, lane=lane, round=rnd, position=0,
                                  ok=True, e2e=e2e))
    return out


def test_above_one_lane_the_interval_is_over_rounds_not_over_correlated_pairs() -> None:
    samples = _correlated_level(4, 8)
    per_pair = rr.median_interval(rr.pair_ratios(samples, PD_PROXY, VLLM_ROUTER, "e2e"))
    assert per_pair["n"] == 32 and per_pair["low"] > 1.0  # 32 "independent" pairs: 1.0 excluded
    per_round = rr.round_ratios(samples, PD_PROXY, VLLM_ROUTER, "e2e")
    assert len(per_round) == 8
    assert per_round[0] == pytest.approx(0.93 - 0.0005)  # the median of round 0's four lanes
    doc = rr.level_ratios(samples, [PD_PROXY, VLLM_ROUTER], VLLM_ROUTER, 4)[PD_PROXY]["e2e"]
    assert doc["unit"] == "round" and doc["n"] == 8
    assert doc["low"] < 1.0 < doc["high"]  # eight rounds do not show a difference
    # one lane: each round is one pair, and the interval is the per-pair one
    one = rr.level_ratios(_correlated_level(1, 8), [PD_PROXY, VLLM_ROUTER], VLLM_ROUTER, 1)[PD_PROXY]["e2e"]
    assert one["unit"] == "pair" and one["n"] == 8


def test_the_report_says_which_unit_the_interval_is_over() -> None:
    result = {
        "meta": {"input_len": 8, "output_len": 4, "seed": 1, "baseline": VLLM_ROUTER,
                 "interval": "the run's interval rule"},
        "levels": [
            {"concurrency": c, "rounds": 8, "targets": {}, "workers": {},
             "ratios": rr.level_ratios(_correlated_level(c, 8), [PD_PROXY, VLLM_ROUTER], VLLM_ROUTER, c)}
            for c in (1, 4)
        ],
    }  # fmt: skip
    table = rr.format_table(result)
    one, four = table.split("## concurrency 4")
    assert "the run's interval rule" in one.split("## concurrency 1")[0]  # the report's header
    assert "Per-pair ratios" in one and "(pairs)" in one
    assert "per round" in four and "(rounds)" in four and "Per-pair" not in four


def test_target_summary_has_p50_p99_and_little_s_law_requests_per_s() -> None:
    samples = [
        Sample(target=PD_PROXY, concurrency=4, lane=i, round=0, position=0, ok=True, ttft=float(10 * i + 10),
               e2e=500.0, itls=(5.0, 7.0))
        for i in range(4)
    ] + [Sample(target=PD_PROXY, concurrency=4, lane=0, round=1, position=0, ok=False, error="timeout")]
    doc = rr.target_summary(samples, 4)
    assert (doc["requests"], doc["ok"], doc["errors"]) == (5, 4, 1)
    assert doc["ttft_p50_ms"] == pytest.approx(25.0)
    assert doc["itl_token_p50_ms"] == pytest.approx(6.0)
    assert doc["requests_per_s"] == pytest.approx(4 / 0.5)  # four clients, half a second each
    assert doc["tpot_p50_ms"] is None  # nothing measured, nothing made up


def test_worker_view_takes_the_histogram_means_between_two_scrapes() -> None:
    trace = (TRACES / "metrics-pd-decode.txt").read_text()  # a wire trace: the answer's body
    text = trace.split("<<< RESPONSE", 1)[1].split("\n\n", 1)[1].split("<<< END", 1)[0]
    totals = rr.scrape_totals(text)
    for h in rr.WORKER_HISTOGRAMS:  # the names vLLM 0.32 really exposes
        assert f"{h}_sum" in totals and f"{h}_count" in totals, h
    assert any(k.startswith(rr.PROMPT_SOURCES) for k in totals)
    after = dict(totals)
    after["vllm:request_prefill_time_seconds_sum"] += 0.6
    after["vllm:request_prefill_time_seconds_count"] += 3
    key = f"{rr.PROMPT_SOURCES}{{local_compute}}"
    after[key] = totals.get(key, 0.0) + 7
    view = rr.worker_view(totals, after)
    assert view["request_prefill_time_mean_ms"] == pytest.approx(200.0)
    assert view["request_prefill_time_count"] == 3
    assert view["request_queue_time_mean_ms"] is None  # no request in between
    assert view["prompt_tokens_by_source"]["local_compute"] == pytest.approx(7.0)


# --------------------------------------------------------------------------------------------
# Options.


def test_the_workers_are_given_exactly_one_way(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        rr.parse_args([])
    with pytest.raises(SystemExit):
        rr.parse_args(["--prefill", "http://127.0.0.1:1"])
    with pytest.raises(SystemExit):
        rr.parse_args(["--start-workers", "sim", "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"])
    state = tmp_path / "pd-workers.json"
    state.write_text(json.dumps({"version": 1, "prefill": ["http://127.0.0.1:8100"],
                                 "decode": ["http://127.0.0.1:8200"]}))  # fmt: skip
    cfg = rr.parse_args(["--workers-state", str(state)])
    assert (cfg.prefill, cfg.decode) == ("http://127.0.0.1:8100", "http://127.0.0.1:8200")
    assert cfg.start_workers is None
    state.write_text("{}")
    with pytest.raises(SystemExit):
        rr.parse_args(["--workers-state", str(state)])


def test_defaults_are_the_issue_s_run_and_rounds_follow_the_concurrencies() -> None:
    cfg = rr.parse_args(["--start-workers", "sim"])
    assert (cfg.input_len, cfg.output_len, cfg.concurrencies, cfg.rounds) == (448, 32, (1, 4), (30, 15))
    assert cfg.targets == TARGETS
    assert cfg.seed != rr.parse_args(["--start-workers", "sim"]).seed or cfg.seed == 0  # fresh per run
    one = rr.parse_args(["--start-workers", "sim", "--concurrency", "1,2,8", "--rounds", "5"])
    assert one.rounds == (5, 5, 5) and one.rounds_at(8) == 5
    for bad in (["--rounds", "1,2,3"], ["--concurrency", "0"], ["--targets", "pd-proxy,nginx"],
                ["--output-len", "1"]):  # fmt: skip
        with pytest.raises(SystemExit):
            rr.parse_args(["--start-workers", "sim", *bad])


def test_the_baseline_is_vllm_router_else_the_proxy_with_the_feature_off() -> None:
    assert rr.baseline_of(list(TARGETS)) == VLLM_ROUTER
    assert rr.baseline_of([PD_PROXY, PD_PROXY_OFF]) == PD_PROXY_OFF
    assert rr.baseline_of([PD_PROXY]) is None


def test_the_commands_are_pd_proxy_on_and_off_and_vllm_router_in_p_d_mode(tmp_path: Path) -> None:
    cfg = rr.parse_args(["--start-workers", "sim", "--pd-proxy-arg=--workers=1"])
    stack = rr.Stack(tmp_path, [])
    stack.prefill, stack.decode = "http://127.0.0.1:1", "http://127.0.0.1:2"
    on = rr.target_argv(cfg, PD_PROXY, 9, stack, None)
    off = rr.target_argv(cfg, PD_PROXY_OFF, 9, stack, None)
    assert on[on.index("--first-token-from-prefill") + 1] == "on" and on[-1] == "--workers=1"
    assert off[off.index("--first-token-from-prefill") + 1] == "off"
    router = rr.target_argv(cfg, VLLM_ROUTER, 9, stack, "/x/vllm-router")
    assert router[0] == "/x/vllm-router" and "--vllm-pd-disaggregation" in router
    assert router[router.index("--policy") + 1] == "round_robin"
    assert router[router.index("--prefill") + 1] == "http://127.0.0.1:1"


# --------------------------------------------------------------------------------------------
# End to end against pd-sim.


def test_end_to_end_on_pd_sim_pairs_every_request_and_stops_everything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """pd-sim workers started by the tool; vllm-router joins when it is installed, else it is left
    out with a message and the ratios are taken against pd-proxy-off."""
    router = find_router(None)
    out = tmp_path / "out"
    argv = ["--start-workers", "sim", "--concurrency", "1,2", "--rounds", "3,2", "--input-len", "64",
            "--output-len", "6", "--seed", "11", "--out", str(out)]  # fmt: skip
    code = rr.main(argv if router else [*argv, "--router-bin", str(tmp_path / "no-router")])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    result = json.loads((out / "result.json").read_text())
    names = list(TARGETS) if router else [PD_PROXY, PD_PROXY_OFF]
    assert result["meta"]["run_targets"] == names
    if not router:
        assert "vllm-router not installed" in captured.err and "router_env.sh" in captured.err
        assert VLLM_ROUTER in result["meta"]["skipped_targets"]
        assert result["meta"]["baseline"] == PD_PROXY_OFF
    assert [lv["concurrency"] for lv in result["levels"]] == [1, 2]
    for level, rounds in zip(result["levels"], (3, 2), strict=True):
        c = level["concurrency"]
        reqs = level["requests"]
        assert len(reqs) == c * rounds * len(names) and all(r["ok"] for r in reqs)
        # every (lane, round) is one request to each target, in the rotated order
        by_pair: dict[tuple[int, int], list[tuple[int, str]]] = {}
        for r in reqs:
            by_pair.setdefault((r["lane"], r["round"]), []).append((r["position"], r["target"]))
        for (lane, rnd), got in by_pair.items():
            assert [t for _, t in sorted(got)] == rr.round_order(names, lane, rnd)
        for doc in level["targets"].values():
            assert doc["ok"] == c * rounds and doc["errors"] == 0
            assert doc["ttft_p50_ms"] > 0 and doc["second_token_gap_p99_ms"] > 0 and doc["requests_per_s"] > 0
        ratios = level["ratios"][PD_PROXY]
        assert ratios["ttft"]["n"] == (rounds if c > 1 else c * rounds) and ratios["e2e"]["median"] > 0
        assert ratios["ttft"]["unit"] == ("round" if c > 1 else "pair")
        # the workers' own view: every counted request went through P and D once
        for role in ("prefill", "decode"):
            assert level["workers"][role]["e2e_request_latency_count"] == c * rounds * len(names)
        assert level["workers"]["decode"]["prompt_tokens_by_source"]["local_compute"] == 0
    lines = (out / "requests.jsonl").read_text().splitlines()
    assert len(lines) == sum(len(lv["requests"]) for lv in result["levels"])
    assert (out / "cdf-c1.png").is_file() and (out / "cdf-c2.png").is_file()
    table = (out / "table.md").read_text()
    assert "## concurrency 2" in table and "2nd-token gap" in table and "95% interval" in table
    assert table in captured.out
    assert _live_children() == []


def test_a_target_that_cannot_start_is_left_out_and_nothing_is_left_running(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    code = rr.main(["--start-workers", "sim", "--targets", "pd-proxy,pd-proxy-off", "--concurrency", "1",
                    "--rounds", "1", "--output-len", "4", "--pd-proxy-arg=--no-such-option",
                    "--out", str(out)])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 1  # nothing ran
    result = json.loads((out / "result.json").read_text())
    assert set(result["meta"]["skipped_targets"]) == {PD_PROXY, PD_PROXY_OFF}
    assert result["levels"] == []
    assert "pd-proxy: " in err and "left out" in err
    assert (out / "pd-proxy.log").is_file()
    assert _live_children() == []



def test_workers_that_do_not_start_end_the_run_with_a_message_and_nothing_running(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = rr.main(["--start-workers", "sim", "--sim-cmd", "{python} -c 'raise SystemExit(3)' {port} {role}",
                    "--out", str(tmp_path / "out")])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 1
    assert "exited with code 3 before it was ready" in err and "Traceback" not in err
    assert _live_children() == []
