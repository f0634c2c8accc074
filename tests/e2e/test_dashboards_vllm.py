"""The dashboards against live real vLLM workers (the live half of tests/deploy/test_dashboards.py).

It lives here, with the other tests on the session's vLLM cluster, so that the cluster starts after
tests/deploy/: tests/deploy/test_local_stack.py starts a real prefill + decode pair of its own, and
five vLLM workers at once do not fit on a 2-core machine (they were not healthy after 300 s)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.deploy import metric_catalog as cat
from tests.deploy.live_scrape import traffic_and_scrape
from tests.deploy.test_dashboards import all_problems, worker_names_used
from tests.e2e.proxy_stack import run_proxy


@pytest.mark.vllm
async def test_every_dashboard_metric_is_exposed_by_a_live_real_vllm_worker(vllm_cluster: Any) -> None:
    """The end-to-end run: pd-proxy in front of real vLLM prefill and decode workers, one request
    whose KV crosses, then the proxy's and both workers' live scrapes (no recorded fallback)."""
    workers = [*vllm_cluster.prefill_urls, *vllm_cluster.decode_urls]
    async with run_proxy(vllm_cluster) as (url, _app):
        scrapes = await traffic_and_scrape(url, workers)
    known = cat.live_catalog(scrapes.proxy, scrapes.workers)
    assert all_problems(known) == []
    real: set[str] = set()
    for text in scrapes.workers:
        real |= set(cat.exposed(text))
    assert worker_names_used() - real == set()
