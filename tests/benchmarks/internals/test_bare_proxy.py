"""The bare two-hop proxy (the Python floor of ``compare_routers``) does the two hops for real: the
prefill worker prefills, the decode worker pulls the KV it names, and the client gets the decode
worker's answer, streamed or not, as pd-proxy would give it."""

from __future__ import annotations

import json
from typing import Any

import aiohttp

from benchmarks.internals.bare_proxy import start
from tests.fixtures_sim import SimFactory


def _body(stream: bool) -> dict[str, Any]:
    return {"request_id": f"bare-{stream}", "token_ids": list(range(1, 40)), "stream": stream,
            "sampling_params": {"max_tokens": 5, "temperature": 0.0, "ignore_eos": True}}


async def test_both_hops_are_made_and_the_answer_is_the_decode_workers(sim_factory: SimFactory) -> None:
    prefill = await sim_factory(role="prefill", zero_latency=True)
    decode = await sim_factory(role="decode", zero_latency=True)
    aggregated = await sim_factory(role="aggregated", zero_latency=True)
    server = await start(0, prefill.url, decode.url)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        async with aiohttp.ClientSession() as session:
            for stream in (False, True):
                before = await decode.pulled_bytes()
                async with session.post(f"{url}/inference/v1/generate", json=_body(stream)) as r:
                    assert r.status == 200
                    raw = await r.read()
                async with session.post(f"{aggregated.url}/inference/v1/generate", json=_body(stream)) as r:
                    reference = await r.read()
                if stream:
                    events = [line[6:] for line in raw.decode().split("\n\n") if line.startswith("data: ")]
                    ref = [line[6:] for line in reference.decode().split("\n\n") if line.startswith("data: ")]
                    assert events[-1] == "[DONE]" and len(events) == len(ref)
                    ids = [i for e in events[:-1] for c in json.loads(e)["choices"] for i in c["token_ids"]]
                    ref_ids = [i for e in ref[:-1] for c in json.loads(e)["choices"] for i in c["token_ids"]]
                else:
                    ids = json.loads(raw)["choices"][0]["token_ids"]
                    ref_ids = json.loads(reference)["choices"][0]["token_ids"]
                assert ids == ref_ids and len(ids) == 5  # the same tokens as one aggregated worker
                assert await decode.pulled_bytes() > before  # D pulled P's KV
    finally:
        server.close()
        await server.wait_closed()
