"""Hop bodies: the prompt's token ids are encoded once and spliced into each hop's JSON."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from proxy.upstream import TokenIds, encode_body

_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
    max_leaves=8)


@given(ids=st.lists(st.integers(min_value=0, max_value=2**31)),
       rest=st.dictionaries(st.text().filter(lambda k: k != "token_ids"), _VALUES, max_size=5))
def test_a_body_with_token_ids_encodes_to_the_same_json_value(ids: list[int], rest: dict[str, Any]) -> None:
    body = {**rest, "token_ids": TokenIds(ids)}
    assert json.loads(encode_body(body)) == {**rest, "token_ids": ids}


def test_the_ids_are_encoded_once_for_every_hop_body() -> None:
    ids = TokenIds([5, 6, 7])
    prefill = encode_body({"token_ids": ids, "stream": False, "request_id": "a"})
    cached = ids.json()
    decode = encode_body({"token_ids": ids, "stream": True, "kv_transfer_params": {"x": 1}})
    assert ids.json() is cached
    assert b'"token_ids":[5,6,7]' in prefill and b'"token_ids":[5,6,7]' in decode
    assert json.loads(decode)["kv_transfer_params"] == {"x": 1}
