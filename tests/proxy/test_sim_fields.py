"""The generate fields (docs/vllm.md, section 1) through pd-proxy against pd-sim: identical to one
aggregated worker."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.fixtures_sim import SimFactory
from tests.proxy.conftest import PDFactory, req, sse_datas

CASES: dict[str, dict[str, Any]] = {
    "text": req(output_mode="text"),
    "text-stop": req(output_mode="text", sp={"max_tokens": 30, "stop": ["e", "a"]}),
    "text-stop-include": req(output_mode="text",
                             sp={"max_tokens": 30, "stop": ["e"], "include_stop_str_in_output": True}),
    "tokens-stop-token-ids": req(sp={"max_tokens": 30, "stop_token_ids": [300, 301, 302]}),
    "utf8-split": req(output_mode="text", sp={"max_tokens": 6, "allowed_token_ids": [130, 105]}),
    "utf8-split-3byte": req(output_mode="text", sp={"max_tokens": 6, "allowed_token_ids": [161, 227, 108]}),
    "logprobs-tokens": req(sp={"logprobs": 2}),
    "logprobs-text": req(output_mode="text", sp={"logprobs": 2}),
    "logprobs-zero": req(sp={"logprobs": 0}),
    "n2-sampled": req(sp={"n": 2, "temperature": 1.0, "seed": 7}),
    "seeded-sampling": req(sp={"temperature": 0.8, "top_p": 0.9, "top_k": 20, "seed": 3}),
    "min-tokens": req(sp={"max_tokens": 12, "min_tokens": 10}),
    "skip-special-false": req(output_mode="text", sp={"skip_special_tokens": False,
                                                       "allowed_token_ids": [0, 1, 2, 300]}),
    "return-token-ids": req(return_token_ids=True),
    "no-max-tokens": {"token_ids": [260, 262, 264], "sampling_params": {"temperature": 0}},
    "unknown-fields": {**req(sp={"future": 1}), "whatever": {"x": 1}},
}


def volatile(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: volatile(v) for k, v in obj.items() if k not in ("created",)}
    if isinstance(obj, list):
        return [volatile(v) for v in obj]
    return obj


async def reference(sim_factory: SimFactory, body: dict[str, Any], stream: bool,
                    extra: dict[str, Any]) -> Any:
    agg = await sim_factory(role="aggregated", zero_latency=True, **extra)
    r = await agg.session.post(agg.url + "/inference/v1/generate", json={**body, "stream": stream})
    raw = await r.read()
    return r.status, (sse_datas(raw) if stream and r.status == 200 else json.loads(raw))


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("name", list(CASES))
async def test_field_identical_to_aggregated(pd_factory: PDFactory, sim_factory: SimFactory, name: str,
                                             stream: bool) -> None:
    extra = {"max_model_len": 64} if name == "no-max-tokens" else {}
    pd = await pd_factory(prefill=extra, decode=extra)
    body = {**CASES[name], "request_id": f"f-{name}"}
    if stream:
        body["stream_options"] = {"include_usage": True}
        status, got, _ = await pd.stream(body)
    else:
        status, got, _ = await pd.gen(body)
    want_status, want = await reference(sim_factory, body, stream, extra)
    assert status == want_status == 200
    assert volatile(got) == volatile(want)
    await pd.quiet()


async def test_prompt_logprobs_come_from_prefill(pd_factory: PDFactory, sim_factory: SimFactory) -> None:
    pd = await pd_factory()
    body = req(request_id="plp", sp={"prompt_logprobs": 2})
    status, got, _ = await pd.gen(body)
    _, want = await reference(sim_factory, body, False, {})
    assert status == 200 and got["prompt_logprobs"] is not None
    assert volatile(got) == volatile(want)


async def test_prefix_cache_hits_reach_usage(pd_factory: PDFactory) -> None:
    pd = await pd_factory()
    body = req(token_ids=list(range(300, 340)))
    _, first, _ = await pd.gen(body)
    _, second, _ = await pd.gen(body)
    assert first["usage"]["prompt_tokens_details"] is None
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert 0 < cached < 40
    pd2 = await pd_factory(report_cached_tokens=False)
    await pd2.gen(body)
    _, again, _ = await pd2.gen(body)
    assert again["usage"]["prompt_tokens_details"] is None


async def test_stop_strings_with_a_tokens_only_prefill_pool(pd_factory: PDFactory,
                                                            sim_factory: SimFactory) -> None:
    body = req(request_id="tko", output_mode="text", sp={"max_tokens": 30, "stop": ["e"]})
    pd = await pd_factory(prefill={"tokens_only": True})
    status, _, _ = await pd.gen(body)
    assert status == 400  # P rejects stop strings: the proxy was not told
    pd2 = await pd_factory(prefill={"tokens_only": True}, prefill_tokens_only=True)
    status, got, _ = await pd2.gen(body)
    _, want = await reference(sim_factory, body, False, {})
    assert status == 200 and volatile(got) == volatile(want)
    await pd2.quiet()
