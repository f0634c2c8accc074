"""``pd-proxy --k8s-endpointslices``: the CLI flag turns on EndpointSlice discovery in the app; the
pools fill from a fake Kubernetes API server (loopback) whose slices name two pd-sim workers, and a
request then goes through them. No --prefill/--decode at all."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from aiohttp import web

from proxy.cli import parse_args
from proxy.http.app import SERVING, build_app

PROMPT = [260 + (i * 7) % 200 for i in range(40)]


def endpoint_slice(name: str, pool: str, port: int) -> dict[str, Any]:
    return {
        "kind": "EndpointSlice", "apiVersion": "discovery.k8s.io/v1",
        "metadata": {"name": name, "namespace": "serving", "resourceVersion": "7",
                     "labels": {"pd-proxy.io/pool": pool,  # made by the controller: pd-proxy uses it
                                "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io"}},
        "addressType": "IPv4",
        "endpoints": [{"addresses": ["127.0.0.1"], "conditions": {"ready": True}}],
        "ports": [{"name": "http", "port": port, "protocol": "TCP"}],
    }


async def test_cli_flag_fills_the_pools_from_endpointslices(sim_factory: Any, aiohttp_client: Any,
                                                            aiohttp_server: Any, tmp_path: Path) -> None:
    p = await sim_factory(role="prefill", zero_latency=True)
    d = await sim_factory(role="decode", zero_latency=True)
    slices = {"pd-proxy.io/pool=prefill": endpoint_slice("pd-prefill-x1", "prefill", p.port),
              "pd-proxy.io/pool=decode": endpoint_slice("pd-decode-y2", "decode", d.port)}
    selectors: list[str] = []
    stop = asyncio.Event()

    async def handle(request: web.Request) -> web.StreamResponse:
        assert request.match_info["ns"] == "serving"
        selector = request.query.get("labelSelector", "")
        selectors.append(selector)
        if request.query.get("watch") in ("true", "True", "1"):
            resp = web.StreamResponse(headers={"Content-Type": "application/json"})
            await resp.prepare(request)
            await asyncio.wait_for(stop.wait(), 30)  # nothing changes until the test ends
            return resp
        items = [slices[selector]] if selector in slices else []
        return web.json_response({"kind": "EndpointSliceList", "apiVersion": "discovery.k8s.io/v1",
                                  "metadata": {"resourceVersion": "7"}, "items": items})

    api = web.Application()
    api.router.add_get("/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices", handle)
    server = await aiohttp_server(api, host="127.0.0.1")
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\n"
        f"clusters: [{{name: fake, cluster: {{server: 'http://127.0.0.1:{server.port}'}}}}]\n"
        "users: [{name: tester, user: {}}]\n"
        "contexts: [{name: fake, context: {cluster: fake, user: tester}}]\n"
        "current-context: fake\n")
    settings = parse_args([
        "--k8s-endpointslices", "prefill:serving:pd-proxy.io/pool=prefill:http",
        "--k8s-endpointslices", f"decode:serving:pd-proxy.io/pool=decode:{d.port}",
        "--kubeconfig", str(kubeconfig), "--kv-block-size", "16", "--no-active-health"])
    assert settings.prefill_urls == () and settings.decode_urls == ()
    app = build_app(settings)
    client = await aiohttp_client(app, server_kwargs={"handler_cancellation": True})
    try:
        serving = app[SERVING]
        loop = asyncio.get_running_loop()
        end = loop.time() + 10
        while not (list(serving.prefill_pool) and list(serving.decode_pool)):
            assert loop.time() < end, "the pools never filled from the EndpointSlices"
            await asyncio.sleep(0.02)
        assert [w.url for w in serving.prefill_pool] == [p.url]
        assert [w.url for w in serving.decode_pool] == [d.url]
        body = {"token_ids": PROMPT, "sampling_params": {"temperature": 0, "max_tokens": 4}}
        r = await client.post("/inference/v1/generate", json=body)
        assert r.status == 200 and "X-PD-Decode-Only" not in r.headers
        assert len((await r.json())["choices"][0]["token_ids"]) == 4
        assert {"pd-proxy.io/pool=prefill", "pd-proxy.io/pool=decode"} <= set(selectors)
    finally:
        stop.set()
