from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from proxy.cli import parse_args
from proxy.fleet.admin import admin_app
from proxy.fleet.membership import ConfigFileSource, Pools, load_config
from proxy.pools.breaker import BreakerConfig, CircuitState
from proxy.pools.policies import make_policy
from proxy.pools.pool import Pool
from proxy.pools.worker import Outcome

P1, P2, D1, D2 = (f"http://127.0.0.1:{p}" for p in (8101, 8102, 8201, 8202))


def make_pools() -> Pools:
    return Pools([Pool("prefill", [P1]), Pool("decode", [D1])], policy_factory=make_policy)


def urls(pools: Pools, name: str) -> list[str]:
    return sorted(w.url for w in pools[name])


def write(path: Path, text: str, bump: int) -> None:
    path.write_text(text)
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + bump * 1_000_000_000))


def test_config_file_reload_adds_removes_and_keeps_other_sources(tmp_path: Path) -> None:
    cfg = tmp_path / "workers.toml"
    pools = make_pools()
    src = ConfigFileSource(cfg, pools)
    assert src.check() is False  # no file yet: nothing changes
    write(cfg, f'[pools.prefill]\nworkers = ["{P1}", "{P2}/"]\npolicy = "prefix"\n'
               f'[pools.decode]\nworkers = ["{D2}"]\n', 1)
    assert src.check() is True
    assert urls(pools, "prefill") == [P1, P2] and urls(pools, "decode") == [D1, D2]
    assert pools["prefill"].policy.name == "prefix"
    assert pools["prefill"].get(P1).sources == {"static", "file"}  # type: ignore[union-attr]
    assert src.check() is False  # unchanged file: not re-applied
    write(cfg, f'[pools.prefill]\nworkers = ["{P2}"]\n', 2)
    assert src.check() is True
    assert urls(pools, "prefill") == [P1, P2]  # P1 stays: the command line declares it
    assert urls(pools, "decode") == [D1]       # D2 left with the file's decode list
    assert src.loads == 2


def test_a_reload_that_drops_and_restores_a_busy_worker_keeps_its_state(tmp_path: Path) -> None:
    """A workers-file edit removes a decode worker while a request runs on it, the next puts it
    back: the same worker, with that request still counted and its breaker as it was."""
    cfg = tmp_path / "workers.toml"
    pools = Pools([Pool("decode", breaker=BreakerConfig(failure_threshold=1))], policy_factory=make_policy)
    src = ConfigFileSource(cfg, pools)
    write(cfg, f'[pools.decode]\nworkers = ["{D1}", "{D2}"]\n', 1)
    assert src.check()
    w = pools["decode"].get(D2)
    assert w is not None
    w.begin()
    w.begin()
    pools["decode"].release(w, Outcome.FAILURE)
    write(cfg, f'[pools.decode]\nworkers = ["{D1}"]\n', 2)
    assert src.check() and urls(pools, "decode") == [D1]
    write(cfg, f'[pools.decode]\nworkers = ["{D1}", "{D2}"]\n', 3)
    assert src.check()
    back = pools["decode"].get(D2)
    assert back is w and back.inflight == 1 and back.circuit is CircuitState.OPEN


@pytest.mark.parametrize("text", [
    "[pools.prefill\nworkers = 1",
    '[pools.prefill]\nworkers = ["127.0.0.1:1"]',
    '[pools.prefill]\nworkers = []\npolicy = "random"',
    '[pools.prefill]\nworkerz = []',
    '[pools.gpu]\nworkers = []',
])
def test_bad_config_file_keeps_previous_membership(tmp_path: Path, text: str) -> None:
    cfg = tmp_path / "workers.toml"
    pools = make_pools()
    src = ConfigFileSource(cfg, pools)
    write(cfg, f'[pools.decode]\nworkers = ["{D2}"]\n', 1)
    assert src.check()
    write(cfg, text, 2)
    assert src.check() is False
    assert src.errors == 1 and src.last_error
    assert urls(pools, "decode") == [D1, D2]


@pytest.mark.parametrize(("url", "reason"), [("ftp://x", "http://"), ("http://x:99999", "invalid port"),
                                           ("https://:443", "host")])
def test_load_config_reports_reason(tmp_path: Path, url: str, reason: str) -> None:
    cfg = tmp_path / "w.toml"
    cfg.write_text(f'[pools.decode]\nworkers = ["{url}"]\n')
    with pytest.raises(ValueError, match=reason):
        load_config(cfg)


KEY = "admin-secret"
AUTH = {"Authorization": f"Bearer {KEY}"}


async def admin_client(aiohttp_client: Any, pools: Pools) -> Any:
    app = web.Application()
    app.add_subapp("/admin", admin_app(pools, KEY))
    return await aiohttp_client(app, server_kwargs={"host": "127.0.0.1"})


async def test_admin_requires_the_admin_key(aiohttp_client: Any) -> None:
    client = await admin_client(aiohttp_client, make_pools())
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEY}"},
                    {"Authorization": "Bearer "}):
        r = await client.get("/admin/workers", headers=headers)
        assert r.status == 401
        assert await r.json() == {"error": "Unauthorized"}
    r = await client.post("/admin/workers", json={"pool": "decode", "url": D2})
    assert r.status == 401
    with pytest.raises(ValueError):
        admin_app(make_pools(), "")


async def test_admin_add_list_drain_delete(aiohttp_client: Any) -> None:
    pools = make_pools()
    client = await admin_client(aiohttp_client, pools)
    r = await client.post("/admin/workers", json={"pool": "decode", "url": D2}, headers=AUTH)
    assert r.status == 201 and (await r.json())["worker"]["sources"] == ["admin"]
    r = await client.post("/admin/workers", json={"pool": "decode", "url": D2}, headers=AUTH)
    assert r.status == 200
    r = await client.get("/admin/workers", headers=AUTH)
    listed = (await r.json())["pools"]
    assert [w["url"] for w in listed["decode"]] == [D1, D2]
    assert listed["decode"][0]["circuit"] == "closed" and listed["decode"][0]["healthy"] is True

    r = await client.post("/admin/workers/drain", json={"pool": "decode", "url": D1}, headers=AUTH)
    assert r.status == 200 and (await r.json())["worker"]["draining"] is True
    assert [w.url for w in pools["decode"].candidates()] == [D2]
    r = await client.post("/admin/workers/drain", json={"pool": "decode", "url": D1, "drain": False},
                          headers=AUTH)
    assert (await r.json())["worker"]["draining"] is False

    r = await client.delete("/admin/workers", params={"pool": "decode", "url": D1}, headers=AUTH)
    assert r.status == 200
    assert urls(pools, "decode") == [D2]
    r = await client.delete("/admin/workers", json={"pool": "decode", "url": D1}, headers=AUTH)
    assert r.status == 404 and (await r.json())["error"]["type"] == "NotFoundError"


@pytest.mark.parametrize(("method", "path", "kw", "param"), [
    ("post", "/admin/workers", {"json": {"pool": "gpu", "url": D2}}, "pool"),
    ("post", "/admin/workers", {"json": {"pool": "decode", "url": "127.0.0.1:1"}}, "url"),
    ("post", "/admin/workers", {"json": {"pool": "decode", "url": "http://127.0.0.1:99999"}}, "url"),
    ("post", "/admin/workers", {"json": {"pool": "decode", "url": "http://:8000"}}, "url"),
    ("post", "/admin/workers", {"data": b"{not json", "headers": {"Content-Type": "application/json"}}, None),
    ("post", "/admin/workers", {"json": [1, 2]}, None),
    ("post", "/admin/workers/drain", {"json": {"pool": "decode", "url": D1, "drain": 3}}, "drain"),
])
async def test_admin_bad_requests(aiohttp_client: Any, method: str, path: str, kw: dict[str, Any],
                                  param: str | None) -> None:
    pools = make_pools()
    client = await admin_client(aiohttp_client, pools)
    headers = {**AUTH, **kw.pop("headers", {})}
    r = await getattr(client, method)(path, headers=headers, **kw)
    assert r.status == 400
    body = await r.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["param"] == param and body["error"]["code"] == 400
    assert urls(pools, "decode") == [D1] and not pools["decode"].workers[0].draining


@pytest.mark.parametrize("url", ["ftp://x", "http://127.0.0.1:99999", "http://:8000"])
def test_the_cli_refuses_a_bad_worker_url_with_a_usage_error(url: str,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        parse_args(["--prefill", "http://127.0.0.1:1", "--decode", url])
    assert e.value.code == 2 and "worker URL" in capsys.readouterr().err
