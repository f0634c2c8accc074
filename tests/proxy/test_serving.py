"""proxy.http.serving: the walk's own decisions, on ``Serving`` with a recording upstream. After the
prefill hop: a 4xx from P is the client's answer; a failure is named (``prefill_error``,
``prefill_timeout``, ``missing_kv_params``) and fails the request or runs it decode-only, as
``--prefill-failure`` says; a short prompt skips P. (The whole generate call against workers:
``test_generate.py``; its validation: ``test_generate.py``, ``test_bounds.py``.)"""

from __future__ import annotations

import json
from typing import Any, cast

import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from proxy.config.settings import ProxySettings
from proxy.fleet import BYPASS_HEADER
from proxy.http.serving import Serving
from proxy.observe.metrics import ProxyMetrics
from proxy.observe.state import Phase
from proxy.pools import PoolSettings
from proxy.upstream.client import Upstream
from proxy.wire.errors import UpstreamError, UpstreamProtocolError, UpstreamStatusError, UpstreamTimeout
from tests.proxy.parts import D_URLS, P_URLS, Call, FakeUpstream, count, make_flight
from tests.proxy.pools.helpers import FakeClock
from tests.proxy.scripted import KV_PARAMS, prefill_reply

REQUEST = make_mocked_request("POST", "/inference/v1/generate")


def serving(pools: dict[str, Any] | None = None, **settings: Any) -> tuple[Serving, FakeUpstream]:
    s = ProxySettings(prefill_urls=P_URLS[:1], decode_urls=D_URLS[:1], kv_block_size=4,
                      pools=PoolSettings.plain(**(pools or {})), **settings)
    srv = Serving(s, ProxyMetrics(), FakeClock())
    upstream = FakeUpstream()
    srv.attach(cast(Upstream, upstream))
    return srv, upstream


def no_params(call: Call) -> dict[str, Any]:
    return {**prefill_reply(call.body), "kv_transfer_params": None}


def bad_params(call: Call) -> dict[str, Any]:
    """Params there, but not what a decode worker can pull with (no block ids)."""
    params = {k: v for k, v in KV_PARAMS.items() if k != "remote_block_ids"}
    return {**prefill_reply(call.body), "kv_transfer_params": params}


async def test_a_4xx_from_p_is_the_clients_answer() -> None:
    srv, up = serving(prefill_failure_policy="decode-only")
    f = make_flight(srv.core)
    refused = UpstreamStatusError("prefill", P_URLS[0], 422, b'{"error":"too long"}', "application/json")
    up.script("prefill", refused)
    with pytest.raises(UpstreamStatusError) as raised:
        await srv._walk(REQUEST, f)
    assert raised.value is refused and up.to("decode") == []  # not decode-only, whatever the policy
    assert f.timing.prefill_end is not None and BYPASS_HEADER not in f.headers


@pytest.mark.parametrize(("answer", "failure", "error"), [
    (UpstreamStatusError("prefill", P_URLS[0], 503, b"{}", "application/json"), "prefill_error",
     UpstreamStatusError),
    (UpstreamTimeout("prefill", P_URLS[0], "timed out"), "prefill_timeout", UpstreamTimeout),
    (no_params, "missing_kv_params", UpstreamProtocolError),
    (bad_params, "missing_kv_params", UpstreamProtocolError),  # asked of the same params thrice
])
async def test_a_failed_prefill_is_named(answer: Any, failure: str, error: type[UpstreamError]) -> None:
    srv, up = serving()
    f = make_flight(srv.core)
    up.script("prefill", answer)
    params, named, raised = await srv._prefill(f)
    assert params is None and named == failure and isinstance(raised, error)


@pytest.mark.parametrize("failure", ["error", "missing"])
async def test_a_failed_prefill_fails_the_request_by_default(failure: str) -> None:
    srv, up = serving()
    f = make_flight(srv.core)
    up.script("prefill", no_params if failure == "missing" else
              UpstreamStatusError("prefill", P_URLS[0], 500, b"{}", "application/json"))
    with pytest.raises(UpstreamError):
        await srv._walk(REQUEST, f)
    assert up.to("decode") == [] and srv.core.leases.open_count == 0


async def test_a_failed_prefill_runs_decode_only_when_asked() -> None:
    srv, up = serving(prefill_failure_policy="decode-only")
    f = make_flight(srv.core)
    up.script("prefill", no_params)
    resp = await srv._walk(REQUEST, f)
    assert resp.status == 200 and f.headers[BYPASS_HEADER] == "missing_kv_params"
    (decode,) = [c for c in up.calls if c.hop == "decode"]
    assert "kv_transfer_params" not in decode.body
    assert count(srv.metrics.decode_only, reason="missing_kv_params") == 1


async def test_a_prompt_shorter_than_the_bypass_skips_p() -> None:
    srv, up = serving(pools={"bypass_prompt_tokens": 100})
    f = make_flight(srv.core)
    resp = await srv._walk(REQUEST, f)
    assert resp.status == 200 and up.to("prefill") == [] and f.headers[BYPASS_HEADER] == "short_prompt"
    assert f.record.phase is Phase.DONE


async def test_the_walk_hands_ps_kv_to_d_and_the_lease_ends_pulled() -> None:
    srv, up = serving()
    f = make_flight(srv.core)
    resp = await srv._walk(REQUEST, f)
    assert isinstance(resp, web.Response) and isinstance(resp.body, bytes)
    assert json.loads(resp.body)["choices"][0]["token_ids"] == [7]
    assert [c.hop for c in up.calls] == ["prefill", "decode"]
    assert up.calls[1].body["kv_transfer_params"] == KV_PARAMS
    assert f.record.lease is not None and f.record.lease.reason == "pulled"
    timing = f.timing
    assert None not in (timing.prefill_start, timing.prefill_end, timing.decode_start, timing.first_token)


async def test_an_abort_between_the_hops_releases_ps_kv_and_answers_aborted() -> None:
    srv, up = serving()
    f = make_flight(srv.core)

    def aborted_after_prefill(call: Call) -> dict[str, Any]:
        srv.core.note_abort(f, "client_call")
        return prefill_reply(call.body)

    up.script("prefill", aborted_after_prefill)
    resp = await srv._walk(REQUEST, f)
    assert isinstance(resp, web.Response) and isinstance(resp.body, bytes)
    assert json.loads(resp.body)["choices"][0]["finish_reason"] == "abort"
    assert [c.is_release for c in up.calls if c.hop == "decode"] == [True]
    assert f.record.lease is not None and f.record.lease.reason == "aborted"
