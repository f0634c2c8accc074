"""EndpointSlice membership against a fake Kubernetes API server (aiohttp on loopback)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from kubernetes_asyncio import client

from proxy.fleet.k8s import EndpointSliceSource, SliceSelector, slice_urls
from proxy.fleet.membership import Pools
from proxy.fleet.retry import RetryPolicy
from proxy.pools.pool import Pool

DATA = json.loads((Path(__file__).parent / "data" / "endpointslices.json").read_text())
SELECTOR = "kubernetes.io/service-name=vllm-decode"
STATIC = "http://127.0.0.1:8200"


@dataclass
class FakeAPI:
    watch_events: list[list[dict[str, Any]]] = field(default_factory=list)
    queries: list[dict[str, str]] = field(default_factory=list)
    listed: asyncio.Event = field(default_factory=asyncio.Event)
    lists: int = 0
    extra_items: list[dict[str, Any]] = field(default_factory=list)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        assert request.match_info["ns"] == "serving"
        self.queries.append(dict(request.query))
        if request.query.get("labelSelector") != SELECTOR:
            return web.json_response({**DATA["list"], "items": []})
        if request.query.get("watch") in ("true", "True", "1"):
            resp = web.StreamResponse(headers={"Content-Type": "application/json"})
            await resp.prepare(request)
            events = self.watch_events.pop(0) if self.watch_events else []
            for event in events:
                await resp.write(json.dumps(event).encode() + b"\n")
            await resp.write_eof()  # as when timeoutSeconds passes
            return resp
        self.lists += 1
        if self.lists >= 2:
            self.listed.set()
        return web.json_response({**DATA["list"], "items": [*DATA["list"]["items"], *self.extra_items]})


@pytest.fixture
async def api(aiohttp_server: Any) -> AsyncIterator[tuple[FakeAPI, client.ApiClient]]:
    fake = FakeAPI()
    app = web.Application()
    app.router.add_get("/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices", fake.handle)
    server = await aiohttp_server(app, host="127.0.0.1")
    configuration = client.Configuration(host=f"http://127.0.0.1:{server.port}")
    async with client.ApiClient(configuration) as api_client:
        yield fake, api_client


def make_source(api_client: client.ApiClient, port: str | int = "http") -> tuple[Pools, EndpointSliceSource]:
    pools = Pools([Pool("prefill"), Pool("decode", [STATIC])])
    source = EndpointSliceSource(pools, SliceSelector("decode", "serving", SELECTOR, port), api_client,
                                 watch_seconds=5, request_timeout=5,
                                 backoff=RetryPolicy(attempts=1, base_delay=0.0, max_delay=0.0))
    return pools, source


def urls(pools: Pools) -> list[str]:
    return sorted(w.url for w in pools["decode"])


async def test_list_takes_ready_endpoints_on_the_named_port(api: tuple[FakeAPI, client.ApiClient]) -> None:
    fake, api_client = api
    pools, source = make_source(api_client)
    rv = await source.sync()
    assert rv == "1001"
    assert urls(pools) == ["http://10.1.0.11:8000", "http://10.1.0.12:8000", STATIC,
                           "http://[fd00::21]:8000"]
    assert pools["decode"].get("http://10.1.0.11:8000").sources == {  # type: ignore[union-attr]
        "k8s:serving/kubernetes.io/service-name=vllm-decode"}
    assert fake.queries[0]["labelSelector"] == SELECTOR
    assert list(pools["prefill"]) == []


async def test_watch_applies_modified_deleted_added(api: tuple[FakeAPI, client.ApiClient]) -> None:
    fake, api_client = api
    pools, source = make_source(api_client)
    fake.watch_events.append(DATA["watch"])
    rv = await source.sync()
    rv = await source.watch_once(rv)
    assert urls(pools) == ["http://10.1.0.12:8000", "http://10.1.0.13:8000", "http://10.1.0.31:8000",
                           STATIC]
    assert rv == "1005" and source.events == 3
    watch_query = fake.queries[1]
    assert watch_query["resourceVersion"] == "1001" and watch_query["timeoutSeconds"] == "5"


async def test_gone_watch_lists_again(api: tuple[FakeAPI, client.ApiClient]) -> None:
    fake, api_client = api
    pools, source = make_source(api_client)
    fake.watch_events.append([DATA["gone"], DATA["gone"]])  # 410 (the library retries once), then 410
    task = asyncio.create_task(source.run())
    try:
        await asyncio.wait_for(fake.listed.wait(), 10)
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert source.lists >= 2
    assert "http://10.1.0.11:8000" in urls(pools)


async def test_slice_urls_numbered_port_missing_port_and_unknown_pool() -> None:
    raw = DATA["list"]["items"][0]
    assert slice_urls(raw, 9000, "https") == {"https://10.1.0.11:9000", "https://10.1.0.12:9000"}
    assert slice_urls(raw, "grpc") == set()
    async with client.ApiClient(client.Configuration(host="http://127.0.0.1:1")) as api_client:
        with pytest.raises(ValueError):
            EndpointSliceSource(Pools([Pool("decode")]), SliceSelector("gpu", "ns", "a=b", 80), api_client)


def foreign_slice(name: str, address: str, managed_by: str | None) -> dict[str, Any]:
    """A slice that carries the Service's label but was not made by the EndpointSlice controller: anyone
    allowed to create EndpointSlices in the namespace could make it to steer traffic to ``address``."""
    labels = {"kubernetes.io/service-name": "vllm-decode"}
    if managed_by is not None:
        labels["endpointslice.kubernetes.io/managed-by"] = managed_by
    return {"kind": "EndpointSlice", "apiVersion": "discovery.k8s.io/v1",
            "metadata": {"name": name, "namespace": "serving", "resourceVersion": "1000", "labels": labels},
            "addressType": "IPv4",
            "endpoints": [{"addresses": [address], "conditions": {"ready": True}}],
            "ports": [{"name": "http", "port": 8000, "protocol": "TCP"}]}


CONTROLLER_URLS = ["http://10.1.0.11:8000", "http://10.1.0.12:8000", STATIC, "http://[fd00::21]:8000"]


@pytest.mark.parametrize("managed_by", [None, "someone-else.example.com", ""])
async def test_list_ignores_slices_not_made_by_the_endpointslice_controller(
        api: tuple[FakeAPI, client.ApiClient], managed_by: str | None) -> None:
    fake, api_client = api
    fake.extra_items.append(foreign_slice("vllm-decode-rogue", "10.9.9.9", managed_by))
    pools, source = make_source(api_client)
    await source.sync()
    assert urls(pools) == CONTROLLER_URLS
    assert source.ignored == {"vllm-decode-rogue"}


async def test_watch_ignores_foreign_slices_and_drops_a_slice_that_loses_the_label(
        api: tuple[FakeAPI, client.ApiClient]) -> None:
    fake, api_client = api
    pools, source = make_source(api_client)
    relabelled = foreign_slice("vllm-decode-abc12", "10.1.0.11", "someone-else.example.com")
    fake.watch_events.append([
        {"type": "ADDED", "object": foreign_slice("vllm-decode-rogue", "10.9.9.9", None)},
        {"type": "MODIFIED", "object": relabelled},  # the controller's slice, relabelled by someone else
    ])
    rv = await source.sync()
    assert urls(pools) == CONTROLLER_URLS
    await source.watch_once(rv)
    # Neither the rogue slice's address nor the relabelled slice's addresses are workers.
    assert urls(pools) == [STATIC, "http://[fd00::21]:8000"]
    assert source.ignored == {"vllm-decode-rogue", "vllm-decode-abc12"}
