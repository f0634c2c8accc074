"""The hand-off's hop bodies, the check of P's params and the remote_host rewrite."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from kv_transfer.handoff import (
    PREFILL_REQUEST,
    RemoteHostRewrite,
    check_prefill_params,
    decode_body,
    prefill_body,
    release_body,
    remote_blocks,
)

KV = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[1, 2], [3]],
      "remote_engine_id": "e", "remote_host": "10.0.0.1", "remote_port": 5600}
CLIENT: dict[str, Any] = {
    "token_ids": [1, 2, 3], "stream": True, "stream_options": {"include_usage": True},
    "output_mode": "text", "request_id": "client",
    "sampling_params": {"max_tokens": 9, "min_tokens": 2, "stop": ["x"], "logprobs": 1,
                        "prompt_logprobs": 1, "n": 2},
}


def test_prefill_body_asks_for_one_token_and_the_kv_kept() -> None:
    before = copy.deepcopy(CLIENT)
    hop = prefill_body(CLIENT, "base", stream=True)
    assert before == CLIENT  # the client's request is left alone
    assert hop["request_id"] == "base" and hop["stream"] is False and "stream_options" not in hop
    assert hop["output_mode"] == "tokens"
    assert hop["kv_transfer_params"] == dict(PREFILL_REQUEST)
    assert hop["kv_transfer_params"] is not prefill_body(CLIENT, "b2", stream=True)["kv_transfer_params"]
    sp = hop["sampling_params"]
    assert sp["max_tokens"] == 1 and "min_tokens" not in sp
    assert "prompt_logprobs" not in sp  # vLLM drops them on streams
    assert sp["stop"] == ["x"]
    assert "stop" not in prefill_body(CLIENT, "b", stream=False, keep_stop=False)["sampling_params"]
    assert prefill_body(CLIENT, "b", stream=False)["sampling_params"]["prompt_logprobs"] == 1


def test_prefill_body_for_the_first_token_samples_it_as_the_client_would() -> None:
    hop = prefill_body(CLIENT, "base", stream=True, first_token=True)
    assert hop["output_mode"] == "text"  # P's text is the client's first chunk's
    sp = hop["sampling_params"]
    assert sp["max_tokens"] == 1 and sp["min_tokens"] == 1  # EOS / stop ids masked at token 1
    assert sp["stop"] == ["x"] and sp["logprobs"] == 1 and sp["n"] == 2
    none = {**CLIENT, "sampling_params": {**CLIENT["sampling_params"], "min_tokens": 0}}
    assert "min_tokens" not in prefill_body(none, "b", stream=True, first_token=True)["sampling_params"]
    tokens = {k: v for k, v in CLIENT.items() if k != "output_mode"}
    assert prefill_body(tokens, "b", stream=True, first_token=True)["output_mode"] == "tokens"


def test_decode_body_is_the_client_request_with_ps_params() -> None:
    hop = decode_body(CLIENT, "base", KV)
    assert hop["kv_transfer_params"] is KV and hop["request_id"] == "base"
    sent = CLIENT["sampling_params"]
    assert hop["sampling_params"] == {k: v for k, v in sent.items() if k != "prompt_logprobs"}
    assert hop["stream"] is True and hop["output_mode"] == "text"
    only = decode_body({**CLIENT, "kv_transfer_params": None}, "base", None)
    assert "kv_transfer_params" not in only  # decode-only: no params at all


def test_release_body_pulls_one_token_and_nothing_else() -> None:
    hop = release_body(CLIENT, "base", KV)
    assert hop["kv_transfer_params"] is KV and hop["stream"] is False and hop["output_mode"] == "tokens"
    assert hop["sampling_params"] == {"max_tokens": 1, "n": 1}


@pytest.mark.parametrize(("params", "why"), [
    (None, "null"),
    ([], "not an object"),
    ({k: v for k, v in KV.items() if k != "remote_port"}, "remote_port is missing"),
    ({**KV, "remote_port": True}, "remote_port has the wrong type"),
    ({**KV, "do_remote_prefill": False}, "do_remote_prefill is not true"),
    ({**KV, "remote_block_ids": [[1, "2"]]}, "not a list of lists of ints"),
])
def test_check_prefill_params_says_why(params: object, why: str) -> None:
    reason = check_prefill_params(params)
    assert reason is not None and why in reason


def test_remote_blocks_counts_every_group() -> None:
    assert check_prefill_params(KV) is None
    assert remote_blocks(KV) == 3


def test_remote_host_rewrite_for_a_routable_host() -> None:
    rewrite = RemoteHostRewrite()
    url = "http://10.1.2.3:8000"
    assert rewrite({**KV, "remote_host": "localhost"}, url)["remote_host"] == "10.1.2.3"
    assert rewrite({**KV, "remote_host": "::"}, url)["remote_host"] == "10.1.2.3"
    assert rewrite({**KV, "remote_host": "0.0.0.0"}, url)["remote_host"] == "10.1.2.3"
    assert rewrite({**KV, "remote_host": "10.9.9.9"}, url)["remote_host"] == "10.9.9.9"
    # each worker URL its own host (what is known of one is not another's)
    assert rewrite({**KV, "remote_host": "localhost"}, "http://10.4.5.6:8000")["remote_host"] == "10.4.5.6"
    assert rewrite({**KV, "remote_host": "::1"}, url)["remote_host"] == "10.1.2.3"
    # the proxy reached P on loopback too: one host, nothing to rewrite
    assert rewrite({**KV, "remote_host": "localhost"}, "http://127.0.0.1:8000")["remote_host"] == "localhost"
    params = {**KV, "remote_host": "localhost"}
    rewrite(params, url)
    assert params["remote_host"] == "localhost"  # a copy is rewritten, never P's reply
    off = RemoteHostRewrite(enabled=False)
    assert off({**KV, "remote_host": "localhost"}, url)["remote_host"] == "localhost"
