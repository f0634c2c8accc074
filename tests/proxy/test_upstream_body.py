"""Hop bodies: the JSON written for and read from the workers carries the same values as ``json``'s."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.wire.protocol import hop_json, parse_worker_json

_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
    max_leaves=8)


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
