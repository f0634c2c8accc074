"""proxy.wire.ids: which request ids the proxy carries, namespacing, and the id put back for the client."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.wire.errors import BadRequest
from proxy.wire.ids import MAX_ID_CHARS, Rewrite, abortable_id, client_request_id, is_valid_id, upstream_id


def test_header_wins_and_empty_counts_as_none() -> None:
    assert client_request_id("h-1", "b-1") == "h-1"
    assert client_request_id(None, "b-1") == "b-1"
    assert client_request_id("", "b-1") == "b-1"
    assert client_request_id(None, "") is None
    assert client_request_id(None, None) is None


@pytest.mark.parametrize("bad", ["a b", "a\nb", "a\rb", "x" * (MAX_ID_CHARS + 1), "é", "a~b", 'a"b', "a\\b",
                                 "\udcff"])
def test_refused_ids_name_their_field(bad: str) -> None:
    with pytest.raises(BadRequest) as e:
        client_request_id(bad, None)
    assert e.value.param == "X-Request-Id"
    with pytest.raises(BadRequest) as e:
        client_request_id(None, bad)
    assert e.value.param == "request_id"


@given(st.text(max_size=200))
def test_a_valid_id_is_safe_everywhere(value: str) -> None:
    if is_valid_id(value):
        assert 1 <= len(value) <= MAX_ID_CHARS
        assert value.isascii() and value.isprintable() and " " not in value and '"' not in value
        assert "~" not in value  # never equal to a namespaced id


def test_namespacing_and_aborts() -> None:
    assert upstream_id("", "x") == "x"
    assert upstream_id("abc", "x") == "abc~x"
    assert abortable_id("generate-tokens-x") == "x"
    for other in ("x", "generate-tokens-", "generate-tokens-a b", "generate-tokens-t~x", "GENERATE-TOKENS-x"):
        assert abortable_id(other) is None, other


def test_rewrite_puts_the_clients_id_back() -> None:
    assert Rewrite.for_ids("x", "x") is None  # one tenant: nothing to rewrite
    rw = Rewrite.for_ids("t~x", "x")
    assert rw is not None
    chunk = b'data: {"request_id":"generate-tokens-t~x","choices":[{"token_ids":[1]}]}\n\n'
    assert rw.apply(chunk) == b'data: {"request_id":"generate-tokens-x","choices":[{"token_ids":[1]}]}\n\n'
    # An id that only starts the same is left alone (the closing quote is part of the match).
    other = b'{"request_id":"generate-tokens-t~xy"}'
    assert rw.apply(other) == other
