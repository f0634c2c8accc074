"""Hop bodies: the prompt's token ids are encoded once and spliced into each hop's JSON."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from proxy.upstream import TokenIds, encode_body, ids_text

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


_KEYS = st.sampled_from(["token_ids", "stop", "x", "token_idsx", "\u00e9"]) | st.text(max_size=4)
_NESTED = st.recursive(
    st.none() | st.integers() | st.sampled_from(["token_ids", '"token_ids":[9]', "]", "\\"]) | st.text()
    | st.fixed_dictionaries({"token_ids": st.lists(st.integers(0, 9), max_size=2)}),  # a decoy key
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_KEYS, inner, max_size=3),
    max_leaves=8)


@given(ids=st.lists(st.integers(min_value=0, max_value=2**31)),
       rest=st.dictionaries(_KEYS.filter(lambda k: k != "token_ids"), _NESTED, max_size=4),
       first=st.booleans(), ascii_only=st.booleans(),
       separators=st.sampled_from([(",", ":"), (", ", ": "), (" ,\n", " :\t")]))
def test_the_ids_text_found_in_a_body_is_always_its_top_level_token_ids(
        ids: list[int], rest: dict[str, Any], first: bool, ascii_only: bool,
        separators: tuple[str, str]) -> None:
    obj = {"token_ids": ids, **rest} if first else {**rest, "token_ids": ids}
    body = json.dumps(obj, separators=separators, ensure_ascii=ascii_only).encode()
    text = ids_text(body)
    if text is not None:
        assert json.loads(text) == ids
        assert json.loads(encode_body({**obj, "token_ids": TokenIds(ids, text)})) == obj


def test_a_plain_body_forwards_the_clients_own_ids_text() -> None:
    body = b'{"token_ids": [5, 6,7], "sampling_params": {"stop": ["token_ids"]}}'
    assert ids_text(body) is None  # "token_ids" twice: not told apart, so encoded
    body = b'{"token_ids":[2],"token\\u005fids":[1]}'  # the escaped key is the one JSON keeps
    assert json.loads(body)["token_ids"] == [1] and ids_text(body) is None
    body = b'{"token_ids": [5, 6,7], "sampling_params": {"max_tokens": 4}}'
    ids = TokenIds([5, 6, 7], ids_text(body))
    assert encode_body({"token_ids": ids, "request_id": "a"}) == b'{"request_id":"a","token_ids":[5, 6,7]}'
