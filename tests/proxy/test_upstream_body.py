"""Hop bodies: the prompt's token ids are encoded once and spliced into each hop's JSON; the
JSON written for and read from the workers carries the same values as ``json``'s."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.wire.protocol import hop_json, parse_worker_json
from proxy.wire.token_ids import TokenIds, encode_body, ids_text

_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
    max_leaves=8)


@settings(deadline=None)
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


@settings(deadline=None)
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


_WIRE_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12)


def same(a: Any, b: Any) -> bool:
    """Equal JSON values, NaN equal to NaN, bool never equal to int."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a):
        return math.isnan(b)
    if type(a) is not type(b):
        return False
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return bool(a == b)


@settings(deadline=None)
@given(value=_WIRE_VALUES)
def test_a_hop_body_is_read_back_by_json_loads_as_the_same_value(value: Any) -> None:
    # NaN and Infinity too: json.loads (a client's body) accepts them, so a hop must carry them.
    raw = hop_json(value)
    assert same(json.loads(raw), value)
    assert raw == raw.strip() and b"\n" not in raw


@settings(deadline=None)
@given(value=_WIRE_VALUES, separators=st.sampled_from([(",", ":"), (", ", ": ")]))
def test_a_workers_json_parses_as_json_loads_parses_it(value: Any, separators: tuple[str, str]) -> None:
    raw = json.dumps(value, separators=separators, ensure_ascii=False).encode()
    assert same(parse_worker_json(raw), json.loads(raw))


def test_a_worker_body_that_is_not_json_is_a_value_error() -> None:
    for raw in (b'{"choices": [', b"", b"<html>502</html>", b'{"a": 1} x', b"\xff"):
        with pytest.raises(ValueError):
            parse_worker_json(raw)
