"""``loads_bounded``: pydantic-core's parser first, ``json.loads`` for whatever it refuses. On
every body the value (types all the way down, float bits, key order) or the ``JSONBodyError``
(reason, position, detail) is the one ``json.loads`` alone gives (``_loads_bounded_stdlib``, the
function as it was before the fast path)."""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.wire import protocol
from proxy.wire.protocol import MAX_JSON_DEPTH, JSONBodyError, loads_bounded, parse_generate_body


def same(a: Any, b: Any) -> bool:
    """Equal with the same types all the way down: ``1`` is not ``1.0``, ``-0.0`` is not
    ``0.0``, NaN is NaN, and a dict's keys come in the same order."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return repr(a) == repr(b) or (math.isnan(a) and math.isnan(b))
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return (list(a) == list(b) and all(type(k) is str for k in a)
                and all(same(a[k], b[k]) for k in a))
    return bool(a == b)


def outcome(parse: Any, body: bytes) -> tuple[str, Any]:
    try:
        return "value", parse(body)
    except JSONBodyError as e:
        return "error", (e.reason, e.pos, e.detail)


def assert_as_before(body: bytes) -> None:
    new, old = outcome(loads_bounded, body), outcome(protocol._loads_bounded_stdlib, body)
    assert new[0] == old[0], (body[:200], new, old)
    if new[0] == "error":
        assert new == old, body[:200]
    else:
        assert same(new[1], old[1]), (body[:200], new[1], old[1])
        assert same(new[1], json.loads(body))


# JSON texts written many ways: the spellings json.dumps uses and those it never does.
_WS = st.sampled_from(["", " ", "\n", "\t", "\r\n  "])
_INT_TEXT = (
    st.integers().map(str)
    | st.integers(min_value=-(10**400), max_value=10**400).map(str)
    | st.sampled_from(["0", "-0", "9223372036854775807", "9223372036854775808", "-9223372036854775809",
                       "18446744073709551616", "9007199254740993", "9" * 4300, "-" + "9" * 4301]))
_FLOAT_TEXT = (
    st.floats().map(json.dumps)  # repr, NaN, Infinity, -Infinity
    | st.tuples(st.floats(allow_nan=False, allow_infinity=False),
                st.sampled_from([".17e", ".25e", ".30g", ".3E", "f"])).map(lambda t: format(*t))
    | st.from_regex(r"-?(0|[1-9][0-9]{0,30})(\.[0-9]{1,30})?([eE][-+]?[0-9]{1,4})?", fullmatch=True)
    | st.sampled_from(["-0.0", "0e0", "-0E-0", "1e308", "1.7976931348623157e308",
                       "1.7976931348623159e308", "5e-324", "2.4703282292062328e-324",
                       "2.4703282292062327e-324", "2.2250738585072011e-308", "1e400", "-1e400",
                       "1E400", "1e-400", "NaN", "Infinity", "-Infinity", "1" * 400 + ".5"]))
_STR = st.text() | st.text(st.characters(codec="utf-8") | st.characters(categories=["Cs"]))
_STRING_TEXT = (
    st.tuples(_STR, st.booleans()).map(lambda t: json.dumps(t[0], ensure_ascii=t[1]))
    | st.sampled_from(['"\\ud800"', '"a\\udfff"', '"\\ud83d\\ude00"', '"\\uD834\\uDD1E"', '"\\ud83dx"',
                       '"\\udc00\\ud800"', '"\\u0000\\/\\b\\f\\n\\r\\t\\"\\\\"', '"\\u00e9\u00e9"',
                       '"\U0001f600"']))
_KEY_TEXT = _STRING_TEXT | st.sampled_from(['"a"', '"b"', '"\\u0061"', '"token_ids"'])  # repeated keys


def _array(items: list[tuple[str, str]]) -> str:
    return "[" + ",".join(f"{w}{v}{w}" for w, v in items) + "]"


def _object(items: list[tuple[str, str, str]]) -> str:
    return "{" + ",".join(f"{w}{k}{w}:{w}{v}" for w, k, v in items) + "}"


_TEXT = st.recursive(
    st.sampled_from(["null", "true", "false"]) | _INT_TEXT | _FLOAT_TEXT | _STRING_TEXT,
    lambda inner: (st.lists(st.tuples(_WS, inner), max_size=5).map(_array)
                   | st.lists(st.tuples(_WS, _KEY_TEXT, inner), max_size=5).map(_object)),
    max_leaves=20)
_VALID_BODY = st.tuples(_WS, _TEXT, _WS).map(lambda t: "".join(t).encode("utf-8", "surrogatepass"))

_JUNK = [b"\xff", b"\x00", b"\xed\xa0\x80", b"\xc0\xaf", b"\xe9", b",", b"]", b"}", b'"', b"\\", b"x",
         b" ", b"\x0c", b"-", b"e", b"."]


@st.composite
def _invalid_body(draw: st.DrawFn) -> bytes:
    """A body broken (or re-encoded) one way: truncated, a byte put in or taken out, trailing
    garbage, a byte-order mark, UTF-16/32, nesting about ``MAX_JSON_DEPTH`` deep or deeper than
    the parser's recursion."""
    body = draw(_VALID_BODY)
    at = draw(st.integers(min_value=0, max_value=len(body)))
    how = draw(st.sampled_from(["cut", "insert", "delete", "trail", "bom", "utf16", "utf32", "deep"]))
    if how == "cut":
        return body[:at]
    if how == "insert":
        return body[:at] + draw(st.sampled_from(_JUNK)) + body[at:]
    if how == "delete":
        return body[:at] + body[at + 1:]
    if how == "trail":
        return body + draw(st.sampled_from(_JUNK))
    if how == "bom":
        return b"\xef\xbb\xbf" + body
    if how in ("utf16", "utf32"):
        return body.decode("utf-8", "surrogatepass").encode(
            "utf-" + how[3:] + draw(st.sampled_from(["-le", "-be", ""])), "surrogatepass")
    depth = draw(st.integers(min_value=MAX_JSON_DEPTH - 3, max_value=MAX_JSON_DEPTH + 3)
                 | st.sampled_from([250, 5000]))
    return b"[" * depth + body + b"]" * depth


@settings(max_examples=400, deadline=None)
@given(body=_VALID_BODY)
def test_a_json_text_gives_json_loads_value_or_error(body: bytes) -> None:
    assert_as_before(body)


@settings(max_examples=300, deadline=None)
@given(body=_invalid_body())
def test_a_broken_or_reencoded_body_gives_the_same_value_or_error(body: bytes) -> None:
    assert_as_before(body)


@pytest.mark.parametrize("body", [
    b"1e400", b"-1e400", b"1e-400", b"NaN", b"Infinity", b"-Infinity", b"[NaN,Infinity,-Infinity]",
    b"-NaN", b"+Infinity", b"nan", b"inf", b"-0", b"-0.0", b"0e0", b"1E+2", b"01", b"1.", b".5", b"+1",
    b'"\\ud800"', b'"\\udc00\\ud800"', b'"\\ud83d\\ude00"', b'"\\ud83dA"', b'"\xed\xa0\x80"', b'"\xff"',
    b'"\xc0\xaf"', b'"\xf4\x90\x80\x80"', b'"a\tb"', b'"a\x00b"', b'"a\x7fb"', b"\x0c1", b"1\x0c",
    b"\xef\xbb\xbf{}", b"\x00\x00\x001", b"1\x00", b"\xff\xfe1\x00", '{"a":1}'.encode("utf-16-le"),
    b'{"a":1,"b":2,"a":3}', b'{"a":1,"\\u0061":{"x":1},"b":2}', b"[1,]", b'{"a":1,}', b"1 2", b"",
    b" ", b'"\\x"', b'"\\u00zz"', b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH,
    b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1), b"[" * 300 + b"]" * 300,
    b"[" * 100_000, b"1" * 4300, b"-" + b"1" * 4300, b"1" * 4301, b"1" * 5000 + b".0",
    b"0." + b"1" * 5000, b"9007199254740993", b"1.7976931348623159e308", b"2.4703282292062328e-324",
    b"1e99999999999999999999999",
    b'{"token_ids":[1,2,3],"sampling_params":{"max_tokens":8,"temperature":0.0,"seed":-0},'
    b'"stream":true,"output_mode":"tokens"}',
], ids=repr)
def test_edge_cases_give_the_same_value_or_error(body: bytes) -> None:
    assert_as_before(body)


@contextmanager
def int_digit_limit(limit: int) -> Iterator[None]:
    before = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(limit)
    try:
        yield
    finally:
        sys.set_int_max_str_digits(before)


@pytest.mark.parametrize("limit", [0, 640, 1000, 10_000])
def test_integers_at_the_digit_limit_in_force_give_the_same_value_or_error(limit: int) -> None:
    with int_digit_limit(limit):
        for digits in (639, 640, 641, 999, 1000, 1001, 4300, 4301, 9_999, 10_000, 10_001):
            for sign in (b"", b"-"):
                assert_as_before(sign + b"7" * digits)
                assert_as_before(b'{"n":[' + sign + b"7" * digits + b"]}")


def test_a_generate_body_is_parsed_without_json_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fast path is taken for what clients send (not only correct when it is not)."""
    def refuse(body: bytes) -> Any:
        raise AssertionError("json.loads path taken")
    monkeypatch.setattr(protocol, "_loads_bounded_stdlib", refuse)
    params = {"max_tokens": 64, "temperature": 0.7, "stop": ["\u00e9\U0001f600"]}
    body = json.dumps({"token_ids": list(range(256)), "stream": True, "output_mode": "tokens",
                       "sampling_params": params})
    for raw in (body.encode(), json.dumps(json.loads(body), indent=2, ensure_ascii=False).encode()):
        req, data = parse_generate_body(raw, "application/json")
        assert same(data, json.loads(raw)) and req.token_ids == list(range(256))
