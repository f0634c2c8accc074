"""The agreed metric names, per-app registries, and the timing contract pd-bench relies on."""

from __future__ import annotations

import re

from prometheus_client.parser import text_string_to_metric_families

from proxy.metrics import ProxyMetrics
from tests.proxy.conftest import PDFactory, req

AGREED = [
    "pd_proxy_requests", "pd_proxy_ttft_seconds", "pd_proxy_itl_seconds", "pd_proxy_tpot_seconds",
    "pd_proxy_e2e_seconds", "pd_proxy_stage_seconds", "pd_proxy_upstream_requests",
    "pd_proxy_upstream_errors", "pd_proxy_inflight_requests", "pd_proxy_worker_healthy", "pd_proxy_aborts",
    "pd_proxy_abort_fanout", "pd_proxy_kv_leases_open", "pd_proxy_kv_lease_duration_seconds",
    "pd_proxy_kv_leases_closed", "pd_proxy_prefill_missing_kv_params", "pd_proxy_decode_only",
    "pd_proxy_build_info",
]
TIMING = re.compile(r"^queue;dur=[0-9.]+, prefill;dur=[0-9.]+, handoff;dur=[0-9.]+, "
                    r"decode_ttft;dur=[0-9.]+, total;dur=[0-9.]+$")


async def test_metrics_after_traffic(pd_factory: PDFactory) -> None:
    pd = await pd_factory()
    status, _, headers = await pd.gen(req())
    assert status == 200 and TIMING.match(headers["Server-Timing"])
    await pd.stream(req())
    text = await (await pd.client.get("/metrics")).text()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in AGREED:
        assert name in families, name
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in families.values() for s in f.samples}
    assert samples[("pd_proxy_requests_total", (("outcome", "ok"),))] == 2
    assert samples[("pd_proxy_kv_leases_closed_total", (("reason", "pulled"),))] == 2
    assert samples[("pd_proxy_kv_leases_open", ())] == 0
    assert samples[("pd_proxy_ttft_seconds_count", ())] == 2
    assert samples[("pd_proxy_stage_seconds_count", (("stage", "prefill"),))] == 2


def test_registries_are_per_app() -> None:
    a, b = ProxyMetrics(), ProxyMetrics()
    a.requests.labels(outcome="ok").inc()
    assert b'pd_proxy_requests_total{outcome="ok"} 1.0' in a.render()
    assert b'pd_proxy_requests_total{outcome="ok"} 0.0' in b.render()
