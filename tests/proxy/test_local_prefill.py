"""The local-prefill alarm (``proxy.observe.local_prefill``): its accounting of both signals (local
compute beyond the expectation, failed KV pulls), and pd-sim behind the proxy."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from proxy.cli import parse_args
from proxy.config.settings import ProxySettings
from proxy.http.app import METRICS, SERVING
from proxy.observe.local_prefill import (
    FAILED,
    WARN_EVERY,
    LocalPrefillAlarm,
    expected_local,
    parse_decode_counters,
)
from proxy.observe.metrics import ProxyMetrics
from proxy.pools import PoolSettings
from tests.proxy.conftest import PDFactory, ProxyFactory, req
from tests.traces import TRACE_DIR, load_trace

D = "http://127.0.0.1:9"


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def alarm() -> tuple[LocalPrefillAlarm, ProxyMetrics, Clock]:
    m = ProxyMetrics()
    clock = Clock()
    return LocalPrefillAlarm(m, [], clock), m, clock


def counted(m: ProxyMetrics, worker: str = D) -> float:
    v = m.registry.get_sample_value("pd_proxy_decode_local_prefill_tokens_total",
                                    {"pool": "decode", "worker": worker})
    return v or 0.0


def failed_counted(m: ProxyMetrics, worker: str = D) -> float:
    v = m.registry.get_sample_value("pd_proxy_decode_failed_pulls_total",
                                    {"pool": "decode", "worker": worker})
    return v or 0.0


def src(local: float = 0.0, hit: float = 0.0, ext: float = 0.0,
        failed: float | None = None) -> dict[str, float]:
    out = {"local_compute": local, "local_cache_hit": hit, "external_kv_transfer": ext}
    if failed is not None:
        out[FAILED] = failed
    return out


def test_expected_local_is_the_last_token_of_a_handoff_and_the_whole_prompt_without_kv() -> None:
    assert expected_local({"token_ids": list(range(300)), "kv_transfer_params": {"x": 1}}) == 1
    assert expected_local({"token_ids": list(range(300))}) == 300
    assert expected_local({"token_ids": [], "kv_transfer_params": {}}) == 0


def test_parses_the_real_decode_workers_counters() -> None:
    text = load_trace(TRACE_DIR / "metrics-pd-decode.txt").response("main").body.decode()
    assert parse_decode_counters(text) == src(local=0.0, hit=512.0, ext=2086.0, failed=1.0)
    assert parse_decode_counters("# TYPE vllm:num_requests_running gauge\n") is None
    two = ('vllm:prompt_tokens_by_source_total{engine="0",source="local_compute"} 3.0\n'
           'vllm:prompt_tokens_by_source_total{engine="1",source="local_compute"} 4.0\n'
           'vllm:prompt_tokens_by_source_created{engine="1",source="local_compute"} 1.7e9\n'
           'vllm:nixl_num_failed_transfers_total{engine="0"} 2.0\n'
           'vllm:nixl_num_failed_transfers_total{engine="1"} 1.0\n'
           'vllm:nixl_num_failed_transfers_created{engine="1"} 1.7e9\n'
           'vllm:nixl_num_failed_notifications_total{engine="1"} 5.0\n')
    assert parse_decode_counters(two) == {"local_compute": 7.0, FAILED: 3.0}


def test_healthy_handoffs_and_decode_only_requests_count_nothing() -> None:
    a, m, _ = alarm()
    assert a.observe(D, src(hit=512, ext=2086), 0) == 0  # the baseline
    for _ in range(10):  # ten hand-offs of 300 tokens: D pulled them, computed none
        a.sent(D, {"token_ids": list(range(300)), "kv_transfer_params": {}})
    a.sent(D, {"token_ids": list(range(50))})  # decode-only: D computes it all
    assert a.observe(D, src(local=50, hit=512, ext=2086 + 3000), a.expected_totals()[D]) == 0
    assert counted(m) == 0
    labels = {"pool": "decode", "worker": D}
    assert m.registry.get_sample_value("pd_proxy_decode_expected_local_tokens_total", labels) == 60
    assert m.registry.get_sample_value("pd_proxy_decode_prompt_tokens_total",
                                       {**labels, "source": "external_kv_transfer"}) == 3000


def test_a_pull_recomputed_locally_is_counted_beyond_the_expected_tail() -> None:
    a, m, _ = alarm()
    a.observe(D, src(), 0)
    a.sent(D, {"token_ids": list(range(300)), "kv_transfer_params": {}})
    assert a.observe(D, src(local=300), a.expected_totals()[D]) == 299
    assert counted(m) == 299


def test_expectation_covers_the_next_scrape_only() -> None:
    a, m, _ = alarm()
    a.observe(D, src(), 0)
    a.sent(D, {"token_ids": list(range(100))})  # sent before scrape 1, computed after it
    assert a.observe(D, src(), 100) == 0
    assert a.observe(D, src(local=100), 100) == 0
    # Expectation two scrapes old covers nothing.
    a.sent(D, {"token_ids": list(range(100))})
    assert a.observe(D, src(), 200) == 0
    assert a.observe(D, src(local=100), 200) == 0  # scrape 2's credit
    assert a.observe(D, src(local=200), 200) == 100  # nothing expected since
    assert counted(m) == 100


def test_a_restarted_worker_starts_from_its_new_counters() -> None:
    a, m, _ = alarm()
    a.observe(D, src(local=5000, ext=9000), 0)
    # D restarted: its counters start again; what they show now happened since.
    a.sent(D, {"token_ids": list(range(40))})
    assert a.observe(D, src(local=40, ext=128), 40) == 0
    assert a.observe(D, src(local=40, ext=128), 40) == 0
    assert counted(m) == 0
    assert a.observe(D, src(local=340, ext=128), 40) == 300


def test_one_warning_per_worker_per_minute(caplog: pytest.LogCaptureFixture) -> None:
    a, _, clock = alarm()
    a.observe(D, src(), 0)
    caplog.set_level(logging.WARNING, logger="pd_proxy")
    for i in range(1, 4):
        clock.t = i
        a.observe(D, src(local=100 * i), 0)
    assert len([r for r in caplog.records if D in r.getMessage()]) == 1
    clock.t = 3 + WARN_EVERY
    a.observe(D, src(local=400), 0)
    assert len([r for r in caplog.records if D in r.getMessage()]) == 2


# ------------------------------------------------------------------ pd-sim behind the proxy


def sample(pd: Any, name: str, **labels: str) -> float:
    registry = pd.app[METRICS].registry
    return float(registry.get_sample_value(name, {"pool": "decode", "worker": pd.d.url, **labels}) or 0.0)


async def wait_for(check: Any, what: str, limit: float = 20.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + limit
    while not check():
        if loop.time() > end:
            raise AssertionError(f"never saw {what}")
        await asyncio.sleep(0.05)


PROMPT = list(range(300, 340))  # 40 tokens: two and a half 16-token blocks


async def test_sim_healthy_traffic_leaves_both_at_zero_and_a_recomputed_pull_counts_as_failed(
        pd_factory: PDFactory) -> None:
    pd = await pd_factory(decode={"faults": {"recompute_failed_pulls": True}},
                          local_prefill_interval=0.05)
    for stream in (False, True, False):
        status, _, _ = await pd.gen(req(token_ids=PROMPT, stream=stream))
        assert status == 200
    await wait_for(lambda: sample(pd, "pd_proxy_decode_prompt_tokens_total",
                                  source="external_kv_transfer") + sample(
        pd, "pd_proxy_decode_prompt_tokens_total", source="local_cache_hit") >= 3 * len(PROMPT),
        "the three hand-offs scraped")
    await wait_for(lambda: sample(pd, "pd_proxy_decode_expected_local_tokens_total") == 3, "expectation")
    await asyncio.sleep(0.2)  # a few more scrapes
    assert sample(pd, "pd_proxy_decode_local_prefill_tokens_total") == 0
    assert sample(pd, "pd_proxy_decode_failed_pulls_total") == 0
    # The pull fails; D computes the prompt itself and answers 200 all the same. As in vLLM 0.32,
    # its prompt counters show the promised pull: only the failed transfers show it.
    await pd.p.set_faults(refuse_kv_pulls=True)
    status, body, _ = await pd.gen(req(token_ids=list(range(400, 440))))
    assert status == 200 and body["choices"][0]["token_ids"]
    await wait_for(lambda: sample(pd, "pd_proxy_decode_failed_pulls_total") >= 1, "the failed pull counted")
    await asyncio.sleep(0.2)
    assert sample(pd, "pd_proxy_decode_failed_pulls_total") == 1
    assert sample(pd, "pd_proxy_decode_local_prefill_tokens_total") == 0


async def test_sim_decode_worker_that_ignores_the_handoff_trips_the_local_prefill_count(
        sim_factory: Any, proxy_factory: ProxyFactory) -> None:
    """An aggregated worker (no KV connector) as the decode pool computes every prompt itself."""
    p = await sim_factory(role="prefill", zero_latency=True)
    d = await sim_factory(role="aggregated", zero_latency=True)
    client, app = await proxy_factory([p.url], [d.url], local_prefill_interval=0.05)
    registry = app[METRICS].registry

    def value(name: str) -> float:
        return float(registry.get_sample_value(name, {"pool": "decode", "worker": d.url}) or 0.0)

    await wait_for(lambda: value("pd_proxy_decode_failed_pulls_total") == 0
                   and app[SERVING].core.local_prefill.scraped(d.url), "the baseline scrape")
    r = await client.post("/inference/v1/generate", json=req(token_ids=PROMPT))
    assert r.status == 200 and "X-PD-Decode-Only" not in r.headers
    await wait_for(lambda: value("pd_proxy_decode_local_prefill_tokens_total") >= len(PROMPT) - 1,
                   "the ignored hand-off counted")
    assert value("pd_proxy_decode_failed_pulls_total") == 0


async def test_sim_decode_only_requests_never_trip_it(pd_factory: PDFactory) -> None:
    pd = await pd_factory(pools=PoolSettings.plain(bypass_prompt_tokens=1000), local_prefill_interval=0.05)
    for i in range(3):
        status, _, headers = await pd.gen(req(token_ids=[i + 300, *PROMPT]))
        assert status == 200 and headers["X-PD-Decode-Only"] == "short_prompt"
    await wait_for(lambda: sample(pd, "pd_proxy_decode_prompt_tokens_total", source="local_compute")
                   + sample(pd, "pd_proxy_decode_prompt_tokens_total", source="local_cache_hit")
                   >= 3 * (len(PROMPT) + 1), "the decode-only prompts scraped")
    await asyncio.sleep(0.2)
    assert sample(pd, "pd_proxy_decode_expected_local_tokens_total") == 3 * (len(PROMPT) + 1)
    assert sample(pd, "pd_proxy_decode_local_prefill_tokens_total") == 0


async def test_interval_zero_turns_the_alarm_off(pd_factory: PDFactory) -> None:
    pd = await pd_factory(decode={"faults": {"recompute_failed_pulls": True}},
                          local_prefill_interval=0)
    await pd.p.set_faults(refuse_kv_pulls=True)
    status, _, _ = await pd.gen(req(token_ids=PROMPT))
    assert status == 200
    await asyncio.sleep(0.3)
    assert not pd.serving.core.local_prefill.scraped(pd.d.url)  # never scraped
    for name in ("pd_proxy_decode_failed_pulls_total", "pd_proxy_decode_expected_local_tokens_total"):
        assert sample(pd, name) == 0


def test_the_interval_flag_defaults_to_15_seconds_and_refuses_a_negative_one() -> None:
    base = ["--prefill", "http://127.0.0.1:8100", "--decode", "http://127.0.0.1:8200"]
    assert parse_args(base).local_prefill_interval == 15.0
    assert parse_args([*base, "--local-prefill-interval", "0"]).local_prefill_interval == 0.0
    with pytest.raises(SystemExit):
        parse_args([*base, "--local-prefill-interval", "-1"])
    with pytest.raises(ValueError, match="local-prefill-interval"):
        ProxySettings(prefill_urls=("http://127.0.0.1:1",), decode_urls=("http://127.0.0.1:2",),
                      local_prefill_interval=float("nan"))


def test_a_hop_counted_while_the_first_page_was_fetched_is_not_in_the_baseline() -> None:
    a, m, _ = alarm()
    # The first page was made before the hop went out; the expectation read after it has the hop.
    assert a.observe(D, src(), 41, before=0) == 0
    assert a.observe(D, src(local=41), 41) == 0
    assert counted(m) == 0


def test_failed_pulls_are_counted_by_their_delta_and_from_zero_after_a_restart(
        caplog: pytest.LogCaptureFixture) -> None:
    a, m, clock = alarm()
    caplog.set_level(logging.WARNING, logger="pd_proxy")
    a.observe(D, src(ext=2000, failed=1), 0)  # the baseline: failures before it are not ours
    assert failed_counted(m) == 0
    a.observe(D, src(ext=2200, failed=1), 0)
    assert failed_counted(m) == 0
    # A pull failed and was recomputed: the prompt counters show the promised pull only.
    assert a.observe(D, src(ext=2400, failed=3), 0) == 0
    assert failed_counted(m) == 2
    clock.t = 1
    a.observe(D, src(ext=2400, failed=4), 0)
    assert failed_counted(m) == 3
    warnings = [r for r in caplog.records if D in r.getMessage() and "KV pulls" in r.getMessage()]
    assert len(warnings) == 1  # one per worker per minute
    # D restarted: its counters start again; what they show now happened since.
    a.observe(D, src(ext=200, failed=1), 0)
    assert failed_counted(m) == 4
    assert counted(m) == 0


def test_a_page_without_the_failed_transfers_counts_none_and_keeps_the_last_value() -> None:
    a, m, _ = alarm()
    a.observe(D, src(failed=2), 0)
    a.observe(D, src(), 0)  # this page lacks it (no NIXL connector, or a partial page)
    assert failed_counted(m) == 0
    a.observe(D, src(failed=2), 0)
    assert failed_counted(m) == 0
    a.observe(D, src(failed=5), 0)
    assert failed_counted(m) == 3


async def test_run_with_interval_zero_returns_without_scraping() -> None:
    a, _, _ = alarm()
    calls: list[str] = []

    async def fetch(w: Any) -> str:
        calls.append(w.url)
        return ""

    await asyncio.wait_for(a.run(fetch, 0), 5.0)
    assert calls == []
