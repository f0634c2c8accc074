"""The admin API's hardening (issue 17, point 9) and its journal (point 8): the key compared as
digests, worker URLs with credentials/query/fragment refused everywhere without echoing them, a
removed worker's metric series gone, the API on its own listener, and changes taken by one app
applied by another through the shared journal (the journal itself: ``test_journal.py``)."""

from __future__ import annotations

import hmac
import logging
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from proxy.cli import parse_args
from proxy.config.settings import ProxySettings
from proxy.fleet.admin import admin_app
from proxy.fleet.membership import ConfigFileSource, Pools
from proxy.http.app import ADMIN_LISTENER, build_app
from proxy.observe.metrics import ProxyMetrics
from proxy.pools import PoolSettings
from proxy.pools.policies import make_policy
from proxy.pools.pool import Pool, normalize_url, redact_url
from tests.proxy.conftest import req
from tests.proxy.pools import test_serving_sim
from tests.proxy.pools.test_serving_sim import StackFactory, eventually

P1, D1, D2 = "http://127.0.0.1:8101", "http://127.0.0.1:8201", "http://127.0.0.1:8202"
KEY = "admin-key-Rv73"
AUTH = {"Authorization": f"Bearer {KEY}"}
SECRET = "pw-Hx19"
stack = test_serving_sim.stack  # the fixture: the proxy app in front of pd-sim pools

BAD_URLS = [
    (f"http://user:{SECRET}@127.0.0.1:8300", "user info"),
    (f"http://{SECRET}@127.0.0.1:8300", "user info"),
    (f"http://127.0.0.1:8300/?token={SECRET}", "query"),
    (f"http://127.0.0.1:8300/#{SECRET}", "fragment"),
    (f"http://evil\\{SECRET}@127.0.0.1:8300", "user info"),
    ("http://127.0.0.1:8300/a b", "spaces"),
]


def make_pools() -> Pools:
    return Pools([Pool("prefill", [P1]), Pool("decode", [D1])], policy_factory=make_policy)


def urls(pools: Pools, name: str) -> list[str]:
    return sorted(w.url for w in pools[name])


async def admin_client(aiohttp_client: Any, pools: Pools, journal: Any = None) -> Any:
    app = web.Application()
    app.add_subapp("/admin", admin_app(pools, KEY, journal))
    return await aiohttp_client(app, server_kwargs={"host": "127.0.0.1"})


# ------------------------------------------------------------------ the key


async def test_the_admin_key_is_compared_as_digests_of_equal_length(
        aiohttp_client: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """``hmac.compare_digest`` on raw keys returns at once when the lengths differ: the time tells
    the key's length. Every comparison must be of two SHA-256 digests, never of the key itself."""
    seen: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: Any, b: Any) -> bool:
        seen.append((a, b))
        return real(a, b)

    client = await admin_client(aiohttp_client, make_pools())
    monkeypatch.setattr(hmac, "compare_digest", spy)
    for token, want in ((None, 401), ("x", 401), (KEY[:-1], 401), (KEY + "x", 401), ("y" * 500, 401),
                        (KEY, 200)):
        headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
        r = await client.get("/admin/workers", headers=headers)
        assert r.status == want, token
    assert len(seen) == 6  # one comparison per call, a missing header included
    for a, b in seen:
        assert len(a) == len(b) == 32
        assert KEY.encode() not in (a, b)


def test_the_admin_app_keeps_only_the_digest() -> None:
    app = admin_app(make_pools(), KEY)
    assert all(KEY not in repr(v) and KEY.encode() != v for v in app._state.values())


# ------------------------------------------------------------------ worker URLs


@pytest.mark.parametrize(("url", "why"), BAD_URLS)
def test_normalize_url_refuses_credentials_query_fragment_without_echoing_them(url: str, why: str) -> None:
    with pytest.raises(ValueError, match=why) as e:
        normalize_url(url)
    assert SECRET not in str(e.value)
    assert SECRET not in redact_url(url)


def test_redact_url_keeps_what_locates_the_worker() -> None:
    assert redact_url(f"https://u:{SECRET}@w.example:8443/base?k={SECRET}#f") == \
        "https://***@w.example:8443/base?***#***"
    assert redact_url(D1) == D1
    assert normalize_url("http://[::1]:8000/base/") == "http://[::1]:8000/base"


@pytest.mark.parametrize(("url", "why"), BAD_URLS)
async def test_admin_refuses_such_urls_with_a_400_in_vllm_shape(aiohttp_client: Any, url: str,
                                                                why: str) -> None:
    pools = make_pools()
    client = await admin_client(aiohttp_client, pools)
    for method, path, body in (("post", "/admin/workers", {"pool": "decode", "url": url}),
                               ("delete", "/admin/workers", {"pool": "decode", "url": url}),
                               ("post", "/admin/workers/drain", {"pool": "decode", "url": url})):
        r = await getattr(client, method)(path, json=body, headers=AUTH)
        assert r.status == 400
        doc = await r.json()
        assert set(doc["error"]) == {"message", "type", "param", "code"}
        assert doc["error"]["param"] == "url" and doc["error"]["code"] == 400
        assert why in doc["error"]["message"] and SECRET not in doc["error"]["message"]
    assert urls(pools, "decode") == [D1]


@pytest.mark.parametrize(("url", "why"), BAD_URLS[:4])
def test_the_cli_refuses_such_urls_without_echoing_them(url: str, why: str,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        parse_args(["--prefill", P1, "--decode", url])
    err = capsys.readouterr().err
    assert e.value.code == 2 and why in err and SECRET not in err


def test_a_workers_file_with_such_a_url_is_not_applied_and_not_echoed(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cfg = tmp_path / "w.toml"
    cfg.write_text(f'[pools.decode]\nworkers = ["{D2}", "http://u:{SECRET}@127.0.0.1:8300"]\n')
    pools = make_pools()
    src = ConfigFileSource(cfg, pools)
    with caplog.at_level(logging.DEBUG):
        assert src.check() is False
    assert urls(pools, "decode") == [D1]
    assert src.last_error is not None and "user info" in src.last_error
    assert SECRET not in src.last_error and SECRET not in caplog.text


# ------------------------------------------------------------------ metric series of removed workers


def series(text: str, worker: str) -> list[str]:
    return [f"{s.name}{s.labels}" for f in text_string_to_metric_families(text) for s in f.samples
            if s.labels.get("worker") == worker]


def test_forget_worker_removes_every_worker_series_and_late_counts_stay_gone() -> None:
    m = ProxyMetrics()
    pools = make_pools()
    pools.forget_workers_in(m)
    pools["decode"].add(D2, "admin")
    m.child(m.upstream_requests, "decode", D2).inc()
    m.child(m.upstream_errors, "decode", D2, "timeout").inc()
    m.child(m.upstream_requests, "decode", D1).inc()
    assert series(m.render().decode(), D2)
    assert pools["decode"].remove(D2)
    assert series(m.render().decode(), D2) == []
    # a request that was still running on it ends after it left: counted nowhere
    m.child(m.upstream_errors, "decode", D2, "connect").inc()
    assert series(m.render().decode(), D2) == []
    assert series(m.render().decode(), D1)  # the other worker untouched
    # it joins again: counted afresh
    pools["decode"].add(D2, "admin")
    m.child(m.upstream_requests, "decode", D2).inc()
    assert {x.split("{")[0] for x in series(m.render().decode(), D2)} == {
        "pd_proxy_upstream_requests_total", "pd_proxy_upstream_requests_created"}


def requests_of(text: str, worker: str) -> list[float]:
    return [s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == "pd_proxy_upstream_requests_total" and s.labels.get("worker") == worker]


def test_a_workers_call_series_are_made_once_and_go_with_the_worker() -> None:
    m = ProxyMetrics()
    pools = make_pools()
    pools.forget_workers_in(m)
    pools["decode"].add(D2, "admin")
    calls = m.calls("decode", D2)
    assert m.calls("decode", D2) is calls  # made once, kept
    calls.requests.inc()
    calls.inflight.inc()
    assert requests_of(m.render().decode(), D2) == [1.0]
    assert pools["decode"].remove(D2)
    # a call that ends after the worker left lowers its pool's in-flight count as it raised it
    calls.inflight.dec()
    assert 'pd_proxy_inflight_requests{pool="decode"} 0.0' in m.render().decode()
    # a call to it after it left counts nowhere, and nothing is kept for it
    late = m.calls("decode", D2)
    late.requests.inc()
    assert series(m.render().decode(), D2) == []
    assert m.calls("decode", D2) is not late
    # it joins again: counted afresh, on new series
    pools["decode"].add(D2, "admin")
    again = m.calls("decode", D2)
    assert again is not calls
    again.requests.inc()
    assert requests_of(m.render().decode(), D2) == [1.0]


async def test_deleting_a_worker_removes_its_series_from_metrics(stack: StackFactory) -> None:
    st = await stack(n_prefill=1, n_decode=2, pools={"admin_key": KEY, "decode_policy": "round_robin"})
    gone = st.decode[1].url
    for _ in range(4):
        assert (await st.gen(req()))[0] == 200
    text = await (await st.client.get("/metrics")).text()
    names = {s.split("{")[0] for s in series(text, gone)}
    assert {"pd_proxy_upstream_requests_total", "pd_proxy_circuit_state"} <= names
    r = await st.client.delete("/admin/workers", json={"pool": "decode", "url": gone}, headers=AUTH)
    assert r.status == 200
    for _ in range(2):
        assert (await st.gen(req()))[0] == 200
    text = await (await st.client.get("/metrics")).text()
    assert series(text, gone) == []
    assert series(text, st.decode[0].url)


# ------------------------------------------------------------------ the admin API on its own listener


async def test_admin_api_on_its_own_listener(stack: StackFactory, sim_factory: Any) -> None:
    st = await stack(n_prefill=1, n_decode=1, pools={"admin_key": KEY, "admin_port": 0})
    listener = st.app[ADMIN_LISTENER]
    assert listener.address is not None
    admin = f"http://127.0.0.1:{listener.address[1]}"
    extra = await sim_factory(role="decode", zero_latency=True)
    # the main port has no admin API at all (vLLM's 404 for an unknown path, key or not)
    for headers in ({}, AUTH):
        r = await st.client.get("/admin/workers", headers=headers)
        assert r.status == 404
        assert await r.json() == {"detail": "Not Found"}
    r = await st.client.post("/admin/workers", json={"pool": "decode", "url": extra.url}, headers=AUTH)
    assert r.status == 404
    assert [w.url for w in st.serving.decode_pool] == [st.decode[0].url]
    async with aiohttp.ClientSession() as s:
        async with s.get(admin + "/admin/workers") as r:
            assert r.status == 401
        async with s.post(admin + "/admin/workers", json={"pool": "decode", "url": extra.url},
                          headers=AUTH) as r:
            assert r.status == 201
        async with s.post(admin + "/inference/v1/generate", json=req(), headers=AUTH) as r:
            assert r.status == 404  # only the admin API there
            assert await r.json() == {"detail": "Not Found"}
    assert sorted(w.url for w in st.serving.decode_pool) == sorted([st.decode[0].url, extra.url])
    assert (await st.gen(req()))[0] == 200


async def test_the_admin_listener_closes_with_the_app() -> None:
    s = ProxySettings(prefill_urls=(P1,), decode_urls=(D1,),
                      pools=PoolSettings.plain(admin_key=KEY, admin_port=0))
    app = build_app(s)
    runner = web.AppRunner(app, handle_signals=False)
    await runner.setup()
    listener = app[ADMIN_LISTENER]
    assert listener.address is not None
    port = listener.address[1]
    async with aiohttp.ClientSession() as session:
        async with session.get(f"http://127.0.0.1:{port}/admin/workers", headers=AUTH) as r:
            assert r.status == 200
        await runner.cleanup()
        with pytest.raises(aiohttp.ClientConnectionError):
            async with session.get(f"http://127.0.0.1:{port}/admin/workers", headers=AUTH):
                pass


# ------------------------------------------------------------------ the journal between two apps


async def test_admin_change_reaches_another_app_through_the_journal(
        stack: StackFactory, sim_factory: Any, tmp_path: Path) -> None:
    """Two apps sharing a journal, as two processes of ``--workers 2`` do: a change taken by one
    is applied by the other's polling."""
    journal = tmp_path / "journal.jsonl"
    pools = {"admin_key": KEY, "admin_journal": journal}
    one = await stack(n_prefill=1, n_decode=1, pools=pools)
    two = await stack(n_prefill=1, n_decode=1, pools=pools)
    extra = await sim_factory(role="decode", zero_latency=True)
    r = await one.client.post("/admin/workers", json={"pool": "decode", "url": extra.url}, headers=AUTH)
    assert r.status == 201
    r = await one.client.post("/admin/workers/drain", json={"pool": "decode", "url": one.decode[0].url},
                              headers=AUTH)
    assert r.status == 200

    async def applied() -> bool:
        w = two.serving.decode_pool.get(extra.url)
        return w is not None and w.sources == {"admin"}

    await eventually(applied, 10.0)
    # two's own decode worker is not one's: draining a worker it does not have changes nothing there
    assert not two.serving.decode_pool.get(two.decode[0].url).draining  # type: ignore[union-attr]
    assert one.serving.decode_pool.get(one.decode[0].url).draining  # type: ignore[union-attr]
    r = await two.client.delete("/admin/workers", json={"pool": "decode", "url": extra.url}, headers=AUTH)
    assert r.status == 200

    async def removed() -> bool:
        return one.serving.decode_pool.get(extra.url) is None

    await eventually(removed, 10.0)
