"""A prefill hop whose reused keep-alive connection is closed after the request went out, before
any response byte, is sent again on a new connection to the same worker, also with a single
prefill worker, but only after the worker answered an abort of the request's id (it may have
read the request: any copy it runs is ended), and the resend is counted
(``pd_proxy_upstream_resends_total``). ``Upstream.open`` does it over ``proxy.upstream.hop``. The worker
most likely closed an idle connection: not its failure, so no retry, no upstream error, nothing
toward its circuit."""

from __future__ import annotations

from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from proxy.config.settings import ProxySettings
from proxy.http.app import SERVING, build_app
from proxy.pools import PoolSettings
from tests.proxy.pools.helpers import CutRelay

PROMPT = [260 + (i * 7) % 200 for i in range(40)]


async def test_reused_connection_closed_before_the_answer_is_retried_on_the_one_worker(
        sim_factory: Any, aiohttp_client: Any) -> None:
    p = await sim_factory(role="prefill", zero_latency=True)
    d = await sim_factory(role="decode", zero_latency=True)
    relay = CutRelay(p.url, cut_on=2)
    url = await relay.start()
    try:
        # block size and model length given: no read of the workers' own crosses the relay
        settings = ProxySettings(prefill_urls=(url,), decode_urls=(d.url,), kv_block_size=16,
                                 max_model_len=512,
                                 pools=PoolSettings(active_health=False, retry_base_delay=0.0))
        app = build_app(settings)
        client = await aiohttp_client(app, server_kwargs={"handler_cancellation": True})
        body = {"token_ids": PROMPT, "sampling_params": {"temperature": 0, "max_tokens": 4}}
        answers = []
        for _ in range(2):  # the second request reuses the first one's pooled connection
            r = await client.post("/inference/v1/generate", json=body)
            answers.append((r.status, (await r.json())["choices"][0]["token_ids"]))
        assert answers[0] == answers[1] and answers[0][0] == 200
        assert relay.cuts == 1 and relay.connections == 3
        generate = b"POST /inference/v1/generate HTTP/1.1"
        abort = b"POST /inference/v1/abort_requests HTTP/1.1"
        # connection 0 carries the first request and the cut one; the abort goes first, then the resend
        assert relay.requests == [(0, generate), (0, generate), (1, abort), (2, generate)]
        text = await (await client.get("/metrics")).text()
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for f in text_string_to_metric_families(text) for s in f.samples}
        assert samples.get(("pd_proxy_retries_total", (("hop", "prefill"),)), 0) == 0
        labels = (("error", "connect"), ("pool", "prefill"), ("worker", url))
        assert samples.get(("pd_proxy_upstream_errors_total", labels), 0) == 0
        assert samples[("pd_proxy_requests_total", (("outcome", "ok"),))] == 2
        assert samples[("pd_proxy_upstream_resends_total", (("hop", "prefill"), ("result", "resent")))] == 1
        assert app[SERVING].leases.open_count == 0
    finally:
        await relay.close()
