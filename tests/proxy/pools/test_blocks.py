"""Each worker's KV block size, learned from its ``/metrics`` (``vllm:cache_config_info``): GPU vLLM's
block is 16 tokens, the CPU build's 128, and the old single default (128) made every 16-127-token
prompt skip the prefill hop on GPU pools (``short_prompt``) without a word. ``--kv-block-size`` is an
override; the bypass threshold is that of the prefill worker chosen."""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest
import yarl
from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy
from prometheus_client import generate_latest

from proxy.config.settings import ProxySettings
from proxy.fleet import PoolRuntime
from proxy.fleet.health import http_fetch
from proxy.fleet.preflight import handoff_check
from proxy.http.app import SERVING, build_app
from proxy.pools import PoolSettings
from proxy.pools.blocks import (
    FALLBACK_BLOCK_SIZE,
    BlockSizeLearner,
    BlockSizes,
    ModelLenLearner,
    ModelLens,
    parse_block_size,
    parse_max_model_len,
)
from proxy.pools.policies import PickContext, PrefixAware
from proxy.pools.pool import Pool
from proxy.pools.worker import Worker
from proxy.upstream.capped import AnswerTooLarge
from tests.proxy.conftest import ProxyFactory
from tests.proxy.pools.test_serving_sim import BYPASS, Stack, eventually, upstream_counts
from tests.proxy.scripted import KV_PARAMS, Scripted, ScriptedFactory, prefill_reply
from tests.proxy.test_metrics import _decode_reply
from tests.traces import TRACE_DIR, load_trace
from workers.sim.metrics import SimMetrics


def prompt(n: int) -> list[int]:
    return [260 + (i * 7) % 200 for i in range(n)]


def req(n: int) -> dict[str, Any]:
    return {"token_ids": prompt(n), "sampling_params": {"temperature": 0, "max_tokens": 4}}


# ----------------------------------------------------------------------------- reading /metrics


@pytest.mark.parametrize("name", ["metrics-pd-prefill", "metrics-pd-decode", "metrics-scaleout"])
def test_block_size_of_a_recorded_vllm_scrape(name: str) -> None:
    page = [b for b in load_trace(TRACE_DIR / f"{name}.txt").blocks if b.kind == "response"][-1]
    assert parse_block_size(page.body.decode()) == 128  # the CPU build's block


@pytest.mark.parametrize("size", [16, 128, 32])
def test_pd_sim_exposes_its_block_size_as_vllm_does(size: int) -> None:
    text = generate_latest(SimMetrics("tiny-llama", block_size=size).registry).decode()
    assert parse_block_size(text) == size


def test_a_page_without_cache_config_has_no_block_size() -> None:
    text = "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{engine=\"0\"} 0.0\n" \
           "# TYPE vllm:cache_config_info gauge\nvllm:cache_config_info{user_specified_block_size=\"8\"," \
           "mamba_block_size=\"4\",engine=\"0\"} 1.0\n"
    assert parse_block_size(text) is None  # other *_block_size labels are not block_size
    quoted = 'vllm:cache_config_info{note="a,block_size=\\"9\\"",engine="0"} 1.0\n'
    assert parse_block_size(quoted) is None  # inside a label value (its quotes escaped)
    assert parse_block_size(quoted.replace("engine", "block_size").replace('"0"', '"48"')) == 48


def test_engines_that_disagree_give_the_largest() -> None:
    text = "# TYPE vllm:cache_config_info gauge\n" \
           'vllm:cache_config_info{block_size="16",engine="0"} 1.0\n' \
           'vllm:cache_config_info{block_size="32",engine="1"} 1.0\n'
    assert parse_block_size(text) == 32


def test_override_fallback_and_pairs() -> None:
    p, d = Worker("http://127.0.0.1:1", "prefill"), Worker("http://127.0.0.1:2", "decode")
    learned = BlockSizes()
    assert learned.learning and learned.of(p) == FALLBACK_BLOCK_SIZE == 16
    p.block_size, d.block_size = 16, 128
    assert learned.of(p) == 16 and learned.pair(p, d) == 128 and learned.smallest([p, d]) == 16
    fixed = BlockSizes(64)
    assert not fixed.learning and fixed.of(p) == fixed.pair(p, d) == 64
    with pytest.raises(ValueError):
        BlockSizes(0)


async def test_learner_reads_once_forgets_and_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    pool = Pool("prefill", ["http://127.0.0.1:1", "http://127.0.0.1:2", "http://127.0.0.1:3"])
    a, b, c = pool.workers
    pages = {a.url: "# TYPE vllm:cache_config_info gauge\nvllm:cache_config_info{block_size=\"16\"} 1.0\n",
             b.url: "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 0.0\n"}
    fetched: list[str] = []

    async def fetch(w: Worker) -> str:
        fetched.append(w.url)
        if w.url not in pages:
            raise OSError("connection refused")
        return pages[w.url]

    learner = BlockSizeLearner([pool], fetch)
    with caplog.at_level(logging.WARNING, logger="proxy.pools.blocks"):
        await learner.learn_once()
        await learner.learn_once()
    assert (a.block_size, b.block_size, c.block_size) == (16, None, None)
    # a is known, b has no cache config (warned once, not asked again), c is down (asked again)
    assert sorted(fetched) == sorted([a.url, b.url, c.url, c.url])
    assert [r.getMessage() for r in caplog.records].count(
        f"prefill worker {b.url}: no vllm:cache_config_info on its /metrics; its KV block size counts "
        f"as 16 (set --kv-block-size to override)") == 1
    pages[a.url] = pages[a.url].replace('"16"', '"32"')  # a restarted with another configuration
    learner.forget(a)
    fetched.clear()
    await learner.learn_once()
    assert a.block_size == 32 and a.url in fetched


def test_prefix_key_follows_the_candidates_block() -> None:
    policy = PrefixAware(block_size=None, prefix_blocks=2)
    w1, w2 = Worker("http://127.0.0.1:1", "prefill"), Worker("http://127.0.0.1:2", "prefill")
    tokens = prompt(300)
    assert policy.key_block_size([w1, w2]) == FALLBACK_BLOCK_SIZE
    w1.block_size = w2.block_size = 128
    assert policy.key_block_size([w1, w2]) == 128
    assert policy.prefix_key(tokens, 128) == ",".join(map(str, tokens[:256])).encode()
    chosen = policy.choose([w1, w2], PickContext(token_ids=tokens), lambda w: 0.0)
    assert chosen is policy.choose([w2, w1], PickContext(token_ids=[*tokens[:256], 1, 2]), lambda w: 0.0)


async def test_preflight_prompt_is_one_block_of_the_pair_and_a_token() -> None:
    sent: list[int] = []

    class Upstream:
        async def post_generate(self, hop: str, worker: str, body: dict[str, Any], *, request_id: str,
                                total: float) -> dict[str, Any]:
            sent.append(len(body["token_ids"]))
            if hop == "prefill":
                return {"kv_transfer_params": {"remote_block_ids": [[1]], "remote_engine_id": "e",
                                               "remote_host": "h", "remote_port": 1,
                                               "remote_request_id": "r", "do_remote_prefill": True}}
            return {"choices": [{"token_ids": [5], "finish_reason": "length"}]}

    blocks = BlockSizes()
    check = handoff_check(Upstream(), block_size=blocks.pair, timeout=1.0)
    p, d = Worker("http://127.0.0.1:1", "prefill"), Worker("http://127.0.0.1:2", "decode")
    p.block_size, d.block_size = 16, 128
    await check(p, d)
    assert sent == [129, 129]


# ----------------------------------------------------------------------------- in the proxy


async def learned(st: Stack, sizes: list[int]) -> None:
    workers = [*st.serving.prefill_pool.workers, *st.serving.decode_pool.workers]

    async def known() -> bool:
        return [getattr(w, "block_size", None) for w in workers] == sizes

    await eventually(known)


LearnedStack = Callable[..., Awaitable[Stack]]


@pytest.fixture
def learning(sim_factory: Any, aiohttp_client: Any) -> LearnedStack:
    """pd-proxy in front of pd-sim workers, without --kv-block-size (the default) unless given."""

    async def make(*, n_prefill: int = 1, n_decode: int = 1, prefill: dict[str, Any] | None = None,
                   decode: dict[str, Any] | None = None, pools: dict[str, Any] | None = None,
                   **settings: Any) -> Stack:
        pkw, dkw = {"zero_latency": True, **(prefill or {})}, {"zero_latency": True, **(decode or {})}
        ps = [await sim_factory(role="prefill", **pkw) for _ in range(n_prefill)]
        ds = [await sim_factory(role="decode", **dkw) for _ in range(n_decode)]
        s = ProxySettings(prefill_urls=tuple(w.url for w in ps), decode_urls=tuple(w.url for w in ds),
                          pools=PoolSettings(**{"active_health": False, **(pools or {})}), **settings)
        app = build_app(s)
        client = await aiohttp_client(app, server_kwargs={"handler_cancellation": True})
        return Stack(client, app, ps, ds)

    return make


async def test_gpu_sized_blocks_are_learned_and_short_prompts_still_prefill(learning: LearnedStack) -> None:
    """pd-sim's block is 16, as GPU vLLM's: a 40-token prompt fills two blocks and must go through the
    prefill hop (the old default of 128 sent every prompt under 128 tokens decode-only)."""
    st = await learning(n_prefill=1, n_decode=1)
    await learned(st, [16, 16])
    status, _, headers = await st.gen(req(40))
    assert status == 200 and BYPASS not in headers
    assert await st.metric("pd_proxy_upstream_requests_total", pool="prefill", worker=st.p.url) == 1
    status, _, headers = await st.gen(req(15))
    assert status == 200 and headers[BYPASS] == "short_prompt"


async def test_cpu_sized_blocks_are_learned(learning: LearnedStack) -> None:
    st = await learning(n_prefill=1, n_decode=1, prefill={"block_size": 128}, decode={"block_size": 128})
    await learned(st, [128, 128])
    status, _, headers = await st.gen(req(100))
    assert status == 200 and headers[BYPASS] == "short_prompt"
    status, _, headers = await st.gen(req(130))
    assert status == 200 and BYPASS not in headers


async def test_the_flag_overrides_what_workers_say(learning: LearnedStack) -> None:
    st = await learning(kv_block_size=128)
    assert st.serving.pools.learner is None  # nothing is read
    status, _, headers = await st.gen(req(40))
    assert status == 200 and headers[BYPASS] == "short_prompt"


async def test_the_threshold_is_that_of_the_prefill_worker_chosen(learning: LearnedStack,
                                                                 sim_factory: Any) -> None:
    """Two prefill workers, blocks of 16 and 128: a 40-token prompt fills a block of the first only, so
    it always goes there, never decode-only and never to the other; a 200-token one may go to either."""
    st = await learning(n_prefill=1, n_decode=1, pools={"prefill_policy": "round_robin"})
    big = await sim_factory(role="prefill", zero_latency=True, block_size=128)
    st.prefill.append(big)
    st.serving.prefill_pool.add(big.url, "static")
    await learned(st, [16, 128, 16])
    for _ in range(4):
        status, _, headers = await st.gen(req(40))
        assert status == 200 and BYPASS not in headers
    assert await upstream_counts(st, "prefill") == {st.p.url: 4, big.url: 0}
    for _ in range(4):
        assert (await st.gen(req(200)))[0] == 200
    assert await upstream_counts(st, "prefill") == {st.p.url: 6, big.url: 2}


@pytest.mark.parametrize(("sizes", "counted"), [((16, 16), [1, 2]), ((16, 128), [0, 1])])
async def test_suspect_counter_counts_in_the_pairs_block(
        scripted_factory: ScriptedFactory, proxy_factory: ProxyFactory, sizes: tuple[int, int],
        counted: list[int]) -> None:
    """A prompt of at least one block of the pair (the larger of P's and D's) whose prefill advertised
    no KV is suspect: 40 tokens are 2.5 GPU blocks (the old fixed 128 ignored every such prompt)."""
    kv = {**KV_PARAMS, "remote_block_ids": [[]]}
    p: Scripted = await scripted_factory(lambda b, r: prefill_reply(b, kv))
    d: Scripted = await scripted_factory(lambda b, r: _decode_reply(b, None))
    client, app = await proxy_factory([p.url], [d.url])
    serving = app[SERVING]
    serving.prefill_pool.workers[0].block_size, serving.decode_pool.workers[0].block_size = sizes
    for n, expected in zip((40, 130), counted, strict=True):
        r = await client.post("/inference/v1/generate", json=req(n))
        assert r.status == 200
        text = await (await client.get("/metrics")).text()
        assert f"pd_proxy_suspect_no_transfer_total {float(expected)}" in text, n  # cumulative


async def test_a_worker_that_turns_unhealthy_is_read_again(learning: LearnedStack) -> None:
    st = await learning(n_prefill=1, n_decode=1)
    await learned(st, [16, 16])
    (d,) = st.serving.decode_pool.workers
    st.serving.pools._health_changed(d)  # still healthy: nothing forgotten
    assert d.block_size == 16
    d.healthy = False
    st.serving.pools._health_changed(d)
    assert d.block_size is None  # it may come back with another configuration: read again

    async def relearned() -> bool:
        return d.block_size == 16

    await eventually(relearned)


def test_prefix_key_block_comes_from_the_membership_not_the_candidates() -> None:
    """Two replicas with the same workers key a prompt alike even when one of them cannot use a worker
    right now (draining, saturated): the key's block is the smallest any worker reported."""
    urls = ["http://127.0.0.1:8101", "http://127.0.0.1:8102", "http://127.0.0.1:8103"]
    replicas = [PoolRuntime(PoolSettings(prefill_policy="prefix", prefix_blocks=2), urls, ["http://127.0.0.1:9"])
                for _ in range(2)]
    for rt in replicas:
        for w, size in zip(rt.prefill.workers, (16, 128, 128), strict=True):
            w.block_size = size
    a, b = replicas
    a.prefill.workers[0].draining = True  # the only 16-token worker, out on replica a only
    assert a.key_block_size() == b.key_block_size() == 16
    compared = 0
    for family in range(24):
        tokens = [3 + family, *prompt(300)]
        pick_a = a.prefill.pick(PickContext(token_ids=tokens))
        pick_b = b.prefill.pick(PickContext(token_ids=tokens))
        if pick_b is not b.prefill.workers[0]:  # a worker both replicas may use
            assert pick_a.url == pick_b.url, family
            compared += 1
    assert compared >= 8


# ----------------------------------------------------------------------------- the model length


def test_max_model_len_is_read_from_the_models_card() -> None:
    card = {"id": "m", "object": "model", "max_model_len": 2048}
    assert parse_max_model_len(json.dumps({"object": "list", "data": [card]})) == 2048
    two = [card, {**card, "id": "alias", "max_model_len": 4096}]
    assert parse_max_model_len(json.dumps({"data": two})) == 4096  # the largest: nothing ends early
    pages: list[object] = [{"data": []}, {"data": [{"id": "m"}]}, {"data": [{"max_model_len": True}]},
                           {"data": [{"max_model_len": "9"}]}, {"data": [{"max_model_len": 0}]}, [],
                           {"data": {}}]
    for page in pages:
        assert parse_max_model_len(json.dumps(page)) is None
    with pytest.raises(ValueError):
        parse_max_model_len("<html>")


def test_one_token_left_needs_every_decode_workers_length() -> None:
    a, b = Worker("http://127.0.0.1:1", "decode"), Worker("http://127.0.0.1:2", "decode")
    lens = ModelLens()
    assert not lens.one_token_left(19, [a, b]) and not lens.one_token_left(19, [])
    a.max_model_len = 20
    assert not lens.one_token_left(19, [a, b])  # b's is unknown: it may go on past token 1
    b.max_model_len = 21
    assert not lens.one_token_left(19, [a, b]) and lens.one_token_left(20, [a, b])
    assert lens.one_token_left(18, [a]) is False and lens.one_token_left(19, [a])
    assert ModelLens(20).one_token_left(19, [b]) and not ModelLens(20).one_token_left(18, [a])
    with pytest.raises(ValueError):
        ModelLens(0)


async def test_model_len_learner_logs_a_refusal_once_and_retries_the_unreachable(
        caplog: pytest.LogCaptureFixture) -> None:
    pool = Pool("decode", [f"http://127.0.0.1:{i}" for i in (1, 2, 3, 4)])
    ok, refused, down, broken = pool.workers
    fetched: list[str] = []

    async def fetch(w: Worker) -> str:
        fetched.append(w.url)
        if w is refused:
            raise aiohttp.ClientResponseError(aiohttp.RequestInfo(yarl.URL(w.url), "GET", CIMultiDictProxy(
                CIMultiDict()), yarl.URL(w.url)), (), status=401)
        if w is down:
            raise aiohttp.ClientConnectionError("refused")
        if w is broken:
            return "not json"
        return json.dumps({"data": [{"max_model_len": 20}]})

    learner = ModelLenLearner([pool], fetch)
    with caplog.at_level(logging.WARNING, logger="proxy.pools.blocks"):
        await learner.learn_once()
        await learner.learn_once()
    assert [w.max_model_len for w in pool.workers] == [20, None, None, None]
    assert sorted(fetched) == sorted([ok.url, refused.url, down.url, broken.url, down.url])
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 2 and sum(refused.url in m and "401" in m for m in warned) == 1
    learner.forget(ok)
    assert ok.max_model_len is None
    await learner.learn_once()
    assert ok.max_model_len == 20


async def test_the_models_fetch_sends_the_key_and_is_bounded(aiohttp_server: Any) -> None:
    seen: list[str | None] = []

    async def models(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Authorization"))
        return web.json_response({"data": [{"max_model_len": 20}], "pad": "x" * int(request.query["n"])})

    app = web.Application()
    app.router.add_get("/v1/models", models)
    server = await aiohttp_server(app, host="127.0.0.1")
    async with aiohttp.ClientSession() as session:
        w = Worker(str(server.make_url("")).rstrip("/"), "decode")
        small = http_fetch(session, 5.0, "/v1/models?n=10", headers={"Authorization": "Bearer k"},
                           limit=1000)
        assert parse_max_model_len(await small(w)) == 20 and seen == ["Bearer k"]
        large = http_fetch(session, 5.0, "/v1/models?n=100000", limit=1000)
        with pytest.raises(AnswerTooLarge, match="more than 1000 bytes"):
            await large(w)


@pytest.mark.parametrize("settings", [{}, {"kv_block_size": 16}], ids=["learning-blocks", "block-flag"])
async def test_model_lengths_are_learned_with_the_workers_key(learning: LearnedStack,
                                                              settings: dict[str, Any]) -> None:
    """The proxy reads each worker's ``GET /v1/models`` with the key it sends the workers, with or
    without ``--kv-block-size``; ``--max-model-len`` overrides (nothing read)."""
    sims = {"max_model_len": 300, "api_key": "up"}
    st = await learning(prefill=sims, decode=sims, upstream_api_key="up", **settings)
    workers = [*st.serving.prefill_pool.workers, *st.serving.decode_pool.workers]

    async def known() -> bool:
        return [w.max_model_len for w in workers] == [300, 300]

    await eventually(known)
    assert st.serving.pools.one_token_left(299) and not st.serving.pools.one_token_left(298)
    flag = await learning(max_model_len=100, **settings)
    assert not any(isinstance(x, ModelLenLearner) for x in flag.serving.pools.learners)
    assert flag.serving.pools.one_token_left(99)
