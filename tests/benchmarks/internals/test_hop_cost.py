"""The hop-cost benchmark, run for a few calls against a real pd-sim process on 127.0.0.1."""

from __future__ import annotations

import pytest
from aiohttp import web

from benchmarks.internals.hop_cost import MinimalClient, main, measure, request_body


@pytest.mark.parametrize("stream", [False, True])
async def test_the_three_clients_make_real_calls_and_report_cpu_per_call(stream: bool) -> None:
    report = await measure(calls=5, rounds=1, prompt_len=16, max_tokens=4, stream=stream)
    assert report["stream"] is stream
    for client in ("upstream", "aiohttp", "minimal"):
        assert len(report[f"{client}_us_per_call"]) == 1 and report[f"{client}_us_per_call"][0] > 0


@pytest.mark.parametrize("chunked", [False, True])
async def test_the_minimal_client_reads_both_body_framings(aiohttp_server: object, chunked: bool) -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        got = await request.json()
        data = b'{"n":%d}' % len(got["token_ids"])
        if not chunked:
            return web.Response(body=data, content_type="application/json")
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        for i in range(0, len(data), 3):
            await resp.write(data[i:i + 3])
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/inference/v1/generate", handler)
    server = await aiohttp_server(app)  # type: ignore[operator]
    client = await MinimalClient.connect("127.0.0.1", server.port)
    try:
        for _ in range(2):  # the connection is kept alive between calls
            status, parsed, raw = await client.post_json("/inference/v1/generate", request_body(7, 1))
            assert (status, parsed, raw) == (200, {"n": 7}, b'{"n":7}')
    finally:
        await client.close()


def test_calls_are_bounded() -> None:
    with pytest.raises(SystemExit):
        main(["--calls", "0"])
    with pytest.raises(SystemExit):
        main(["--calls", "100001"])
