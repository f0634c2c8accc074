"""The bodies the proxy writes in vLLM's shapes (``proxy.wire.replies``): the error object and the
answers for an aborted request, keys in vLLM's order (clients see the bytes a vLLM server sends)."""

from __future__ import annotations

import json

from hypothesis import example, given, settings
from hypothesis import strategies as st

from proxy.wire.protocol import compact_json
from proxy.wire.replies import abort_full_response, abort_stream_chunk, error_body


def test_the_error_object() -> None:
    assert compact_json(error_body("m", "BadRequestError", 400, "token_ids")) == \
        b'{"error":{"message":"m","type":"BadRequestError","param":"token_ids","code":400}}'
    assert error_body("m", "InternalServerError", 500) == \
        {"error": {"message": "m", "type": "InternalServerError", "param": None, "code": 500}}


def test_an_aborted_streams_last_chunk() -> None:
    assert compact_json(abort_stream_chunk("generate-tokens-r", "tokens")) == (
        b'{"request_id":"generate-tokens-r","usage":null,"output_mode":"tokens","choices":[{"index":0,'
        b'"finish_reason":"abort","stop_reason":null,"token_ids":[],"routed_experts":null,'
        b'"sampling_mask":null,"weight_versions":null,"logprobs":null}]}')
    text = abort_stream_chunk("r", "text", index=2)["choices"][0]
    assert list(text)[-2:] == ["text", "logprobs"] and text["text"] == "" and text["index"] == 2


def test_an_aborted_full_response_has_n_empty_choices_and_the_prompt_counted() -> None:
    body = abort_full_response("generate-tokens-r", model="m", created=5, prompt_tokens=7,
                               output_mode="text", n=2)
    assert list(body) == ["request_id", "model", "created", "usage", "prompt_logprobs",
                          "prompt_token_id_logprobs", "prompt_token_ids", "mm_placeholders", "metrics",
                          "kv_transfer_params", "ec_transfer_params", "output_mode", "choices"]
    assert body["usage"] == {"prompt_tokens": 7, "total_tokens": 7, "completion_tokens": 0,
                             "prompt_tokens_details": None, "completion_tokens_details": None}
    assert [(c["index"], c["finish_reason"], c["text"], c["token_ids"]) for c in body["choices"]] == \
        [(0, "abort", "", []), (1, "abort", "", [])]
    assert json.loads(compact_json(body)) == body


@settings(deadline=None)
@given(st.dictionaries(st.text(st.characters(exclude_categories=["Cs"])),
                       st.integers(min_value=-2**200, max_value=2**200) | st.floats() | st.booleans(),
                       max_size=4))
@example({"cached_tokens": 3, "seconds": 1e-05})
@example({None: 1})  # a key that is not a string: json.dumps writes null as "null", pydantic-core "None"
def test_a_flat_object_is_written_as_json_dumps_writes_it(obj: dict[str, int | float | bool]) -> None:
    """One of integers is written by pydantic-core (faster): the bytes of ``json.dumps``, escapes
    included; one with a float, as ``json.dumps`` spells it (``1e-05``, not ``0.00001``)."""
    assert compact_json(obj) == json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()
