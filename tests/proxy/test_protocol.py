"""proxy.wire.protocol against the referee: what vLLM's own code answers for each body."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_transfer.handoff import check_prefill_params
from proxy.wire.protocol import parse_generate_body, splice_null_key
from proxy.wire.replies import error_body
from proxy.wire.validation_errors import RequestValidationError, VLLMValidationError
from tests.traces import TRACE_DIR

CASES: list[dict[str, Any]] = json.loads(
    (pathlib.Path(__file__).parent / "data" / "validation_cases.json").read_text())
TRACES = TRACE_DIR


def answer(body: bytes, content_type: str) -> tuple[int, dict[str, Any]]:
    try:
        parse_generate_body(body, content_type)
    except RequestValidationError as e:
        return 400, error_body(e.message, "Bad Request", 400, e.param)
    except VLLMValidationError as e:
        return 400, error_body(str(e), "BadRequestError", 400, e.parameter)
    return 200, {"ok": True}


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_matches_vllm_referee(case: dict[str, Any]) -> None:
    assert answer(case["body"].encode(), case["content_type"]) == (case["status"], case["response"])


def _trace_pair(name: str) -> tuple[bytes, str, dict[str, Any]]:
    text = (TRACES / name).read_text()
    req_part = text.split(">>> REQUEST", 1)[1].split("<<< RESPONSE", 1)[0]
    headers, body = req_part.split("\n\n", 1)
    ctype = next(line.split(":", 1)[1].strip() for line in headers.splitlines()
                 if line.lower().startswith("content-type"))
    resp_part = text.split("<<< RESPONSE", 1)[1].split("<<< END", 1)[0]
    resp_body = resp_part.split("\n\n", 1)[1].strip()
    return body.strip().encode(), ctype, json.loads(resp_body)


@pytest.mark.parametrize("name", [
    "err-empty-token-ids.txt", "err-invalid-json.txt", "err-max-tokens-zero.txt",
    "err-min-tokens-gt-max-tokens.txt", "err-missing-sampling-params.txt", "err-missing-token-ids.txt",
    "err-n2-greedy.txt", "err-negative-token-id.txt", "err-output-mode-bogus.txt",
    "err-output-mode-bogus-stream.txt", "err-text-detokenize-false.txt", "err-token-ids-not-list.txt",
    "err-wrong-content-type.txt",
])
def test_matches_recorded_trace(name: str) -> None:
    body, ctype, expected = _trace_pair(name)
    assert answer(body, ctype) == (400, expected)


def test_valid_request_keeps_the_clients_object() -> None:
    body = {"token_ids": [1, 2], "sampling_params": {"max_tokens": 2, "future_knob": 1}, "x": {"y": 1}}
    req, data = parse_generate_body(json.dumps(body).encode(), "application/json; charset=utf-8")
    assert data == body
    assert req.sampling_params.get("max_tokens") == 2


GOOD_KV = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[1, 2]],
           "remote_engine_id": "e", "remote_request_id": "r", "remote_host": "localhost",
           "remote_port": 5600}


@pytest.mark.parametrize(("params", "reason"), [
    (None, "null"),
    ([], "not an object"),
    ({k: v for k, v in GOOD_KV.items() if k != "remote_engine_id"}, "remote_engine_id is missing"),
    ({**GOOD_KV, "remote_port": "5600"}, "remote_port has the wrong type"),
    ({**GOOD_KV, "remote_port": True}, "remote_port has the wrong type"),
    ({**GOOD_KV, "do_remote_prefill": False}, "do_remote_prefill is not true"),
    ({**GOOD_KV, "remote_block_ids": [1, 2]}, "not a list of lists"),
])
def test_prefill_kv_params_checks(params: object, reason: str) -> None:
    got = check_prefill_params(params)
    assert got is not None and reason in got


def test_prefill_kv_params_ok_even_with_no_blocks() -> None:
    assert check_prefill_params(GOOD_KV) is None
    assert check_prefill_params({**GOOD_KV, "remote_block_ids": []}) is None


_DECOY_KEYS = st.sampled_from(["prompt_tokens_details", "x", "usage", "é"]) | st.text(max_size=3)
_DECOYS = st.recursive(
    st.none() | st.integers() | st.text()
    | st.sampled_from(["prompt_tokens_details", '"prompt_tokens_details":null', "\\", "é"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_DECOY_KEYS, inner, max_size=3),
    max_leaves=8)


@settings(deadline=None)
@given(rest=st.dictionaries(_DECOY_KEYS.filter(lambda k: k != "usage"), _DECOYS, max_size=4),
       extra=st.dictionaries(_DECOY_KEYS.filter(lambda k: k != "prompt_tokens_details"), _DECOYS,
                             max_size=2),
       ascii_only=st.booleans(), spaced=st.booleans())
def test_a_spliced_null_is_the_usage_one_and_the_rest_is_unchanged(
        rest: dict[str, Any], extra: dict[str, Any], ascii_only: bool, spaced: bool) -> None:
    reply = {**rest, "usage": {"prompt_tokens": 3, "prompt_tokens_details": None, **extra}}
    separators = (", ", ": ") if spaced else (",", ":")
    raw = json.dumps(reply, separators=separators, ensure_ascii=ascii_only).encode()
    out = splice_null_key(raw, "prompt_tokens_details", {"cached_tokens": 7})
    if out is not None:
        reply["usage"]["prompt_tokens_details"] = {"cached_tokens": 7}
        assert json.loads(out) == reply


def test_a_null_is_spliced_in_a_plain_reply_and_refused_when_ambiguous() -> None:
    raw = b'{"usage":{"prompt_tokens_details":null},"choices":[{"text":"hi"}]}'
    assert splice_null_key(raw, "prompt_tokens_details", {"c": 1}) == \
        b'{"usage":{"prompt_tokens_details":{"c":1}},"choices":[{"text":"hi"}]}'
    twice = b'{"a":{"prompt_tokens_details":null},"usage":{"prompt_tokens_details":null}}'
    assert splice_null_key(twice, "prompt_tokens_details", 1) is None
    escaped = b'{"a":{"prompt_tokens_details":null},"usage":{"prompt_tokens\\u005fdetails":null}}'
    assert splice_null_key(escaped, "prompt_tokens_details", 1) is None
