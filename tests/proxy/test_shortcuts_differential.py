"""Every shortcut in front of a body check decides what the full check decides.

The shortcuts: the encoding check (``protocol.utf8_json``: a body is searched as UTF-8 bytes only
once it is), the nesting/surrogate scan before the walk (``protocol.loads_bounded``), and the large-
body slicer (``proxy.wire.large_body``). Each is compared with a reference that has none of them:
``json.loads`` of the body, the full walk for nesting and lone surrogates, pydantic's model, a walk
for transfer keys at every depth, and the server checks. Generated bodies: valid generate requests
and near misses, in UTF-8 (with or without a BOM), UTF-16 and UTF-32 (LE/BE, with or without a BOM),
with ``\\u`` escapes in any key, repeated keys, any whitespace, transfer keys at every depth,
numbers in every JSON form and lone surrogates. Same answer (status, message, param) or the same
request (model, parse, and the hop body: strict UTF-8 carrying the same JSON).
"""

from __future__ import annotations

import asyncio
import functools
import json
from typing import Any
from unittest import mock

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, TypeAdapter, ValidationError

from kv_transfer.params import TRANSFER_KEYS
from proxy.config.settings import ProxySettings
from proxy.upstream.client import encode_body
from proxy.walk import validation as validation_module
from proxy.walk.validation import Validation
from proxy.wire.errors import BadRequest, ClientError, InvalidRequest
from proxy.wire.large_body import PackedTokenIds, parse_large_generate_body
from proxy.wire.protocol import MAX_JSON_DEPTH, GenerateRequest, JSONBodyError, _check_nesting_and_text
from proxy.wire.sampling import SamplingParams
from proxy.wire.validation_errors import RequestValidationError, VLLMValidationError, format_validation_errors

JSON = "application/json"
HYPO = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
HYPO_SLOW = settings(HYPO, max_examples=100)
ENCODINGS = ["utf-8", "utf-8", "utf-8-sig", "utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-32-le",
             "utf-32-be"]
_LIST_INT: TypeAdapter[list[int]] = TypeAdapter(list[int])


def _settings(max_prompt_tokens: int) -> ProxySettings:
    return ProxySettings(prefill_urls=("http://127.0.0.1:1",), decode_urls=("http://127.0.0.1:2",),
                         max_prompt_tokens=max_prompt_tokens)


# ------------------------------------------------------------------ the reference


def _json_invalid(e: JSONBodyError) -> RequestValidationError:
    return format_validation_errors([{"type": "json_invalid", "loc": ("body", e.pos),
                                      "msg": "JSON decode error", "input": {}, "ctx": {"error": e.reason}}])


def _reference_loads(body: bytes) -> Any:
    """``json.loads``, then the whole walk for nesting and lone surrogates, on every body."""
    try:
        data = json.loads(body)
    except json.JSONDecodeError as e:
        raise JSONBodyError(e.msg, e.pos) from None
    except UnicodeDecodeError:
        raise JSONBodyError("invalid UTF-8") from None
    except RecursionError:
        raise JSONBodyError(f"nested deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as e:
        raise JSONBodyError(str(e).split(":", 1)[0]) from None
    _check_nesting_and_text(data)
    return data


def _transfer_path(data: dict[str, Any]) -> str | None:
    """The first transfer key anywhere (a top-level null names nothing), by a plain walk."""
    for key in TRANSFER_KEYS:
        if data.get(key) is not None:
            return key

    def walk(value: Any, path: str) -> str | None:
        if isinstance(value, dict):
            for k, inner in value.items():
                if k in TRANSFER_KEYS:
                    return f"{path}.{k}"
                found = walk(inner, f"{path}.{k}")
                if found is not None:
                    return found
        elif isinstance(value, list):
            for i, inner in enumerate(value):
                found = walk(inner, f"{path}[{i}]")
                if found is not None:
                    return found
        return None

    for key, value in data.items():
        found = walk(value, key)
        if found is not None:
            return found
    return None


def reference(body: bytes, content_type: str, s: ProxySettings) -> tuple[GenerateRequest, dict[str, Any]]:
    """What the proxy must decide for ``body``, with no shortcut at all."""
    try:
        if content_type.lower().split(";", 1)[0].strip() != JSON:
            raise format_validation_errors(["Unsupported Media Type: Only 'application/json' is allowed"])
        if not body:
            raise format_validation_errors([{"type": "missing", "loc": ("body",), "msg": "Field required",
                                             "input": None}])
        try:
            data = _reference_loads(body)
        except JSONBodyError as e:
            raise _json_invalid(e) from None
        if not isinstance(data, dict):
            raise format_validation_errors([{"type": "model_attributes_type", "loc": ("body",),
                                             "msg": "Input should be a valid dictionary or object to extract "
                                                    "fields from", "input": data}])
        try:
            req = GenerateRequest.model_validate(data)
        except ValidationError as e:
            raise format_validation_errors([{**err, "loc": ("body", *err["loc"])}
                                            for err in e.errors(include_url=False)]) from None
    except RequestValidationError as e:
        raise InvalidRequest.from_protocol(e) from None
    except VLLMValidationError as e:
        raise BadRequest.from_protocol(e) from None
    checks = Validation(s)
    checks._prompt_fits(req)
    where = _transfer_path(data)
    if where is not None:
        raise BadRequest(f"{where} is set by the proxy for each hop and cannot come from a client: "
                         "remove it from the request.", param=where)
    return checks._server_checks(req, data)


# ------------------------------------------------------------------ outcomes


def _plain(obj: Any) -> Any:
    if isinstance(obj, BaseModel):
        return {name: getattr(obj, name) for name in type(obj).model_fields}
    if isinstance(obj, SamplingParams):
        return obj.values
    if isinstance(obj, PackedTokenIds):
        return list(obj)
    raise TypeError(type(obj))


def _canon(obj: Any) -> str:
    """Types and order kept (``1`` is not ``1.0``, NaN is NaN)."""
    return json.dumps(obj, default=_plain, allow_nan=True)


def outcome(run: Any) -> tuple[Any, ...]:
    try:
        req, data = run()
    except ClientError as e:
        return ("error", e.status, type(e).__name__, e.message, e.param)
    hop = encode_body(data)
    sent = json.loads(hop.decode("utf-8"))  # strict UTF-8
    sent_ids = _LIST_INT.validate_python(sent.pop("token_ids"))  # what the worker's model reads
    forwarded = {k: v for k, v in data.items() if k != "token_ids"}
    assert _canon(sent) == _canon(forwarded)
    assert sent_ids == list(req.token_ids) == _LIST_INT.validate_python(list(data["token_ids"]))
    return ("ok", _canon(req), _canon({**data, "token_ids": sent_ids}))


# ------------------------------------------------------------------ generated bodies

_WS = st.sampled_from(["", "", " ", "\n", "\t", "\r\n  "])
_NUMBER = (st.integers(-(10**30), 10**30).map(str)
           | st.sampled_from(["0", "-0", "1", "7", "1.0", "1e2", "1E+2", "2e-1", "-1", "-1.5", "3.25",
                              "1e400", "9223372036854775807", "9223372036854775808", "0.5e1", "10E0"])
           | st.floats(allow_nan=False).map(json.dumps))
_TEXT = st.text(max_size=6) | st.text(st.characters(categories=["Cs"]) | st.characters(codec="utf-8"),
                                      max_size=3)
_KEYS = st.sampled_from(["token_ids", "request_id", "sampling_params", "extra_args", "model", "x", "a",
                         "kv_transfer_params", "ec_transfer_params", "transfer_params", "max_tokens"])


@st.composite
def json_string(draw: st.DrawFn, text: str | None = None) -> str:
    """``text`` (or any) as a JSON string, any of its characters possibly a ``\\u`` escape, or a
    lone surrogate escape put in."""
    if text is None:
        text = draw(_TEXT)
    how = draw(st.sampled_from(["plain", "plain", "plain", "some", "all", "surrogate"]))
    out = []
    for ch in text:
        escape = how == "all" or (how == "some" and draw(st.booleans()))
        if escape and ord(ch) < 0x10000:
            out.append(f"\\u{ord(ch):04x}" if draw(st.booleans()) else f"\\u{ord(ch):04X}")
        else:
            out.append(json.dumps(ch, ensure_ascii=False)[1:-1])
    if how == "surrogate":
        out.insert(draw(st.integers(0, len(out))), draw(st.sampled_from(["\\ud800", "\\uDFFF", "\\udc00"])))
    return '"' + "".join(out) + '"'


def _obj(items: list[tuple[str, str, str]]) -> str:
    return "{" + ",".join(f"{w}{k}{w}:{w}{v}" for w, k, v in items) + "}"


def _arr(items: list[tuple[str, str]]) -> str:
    return "[" + ",".join(f"{w}{v}{w}" for w, v in items) + "]"


_SCALAR = st.sampled_from(["null", "true", "false"]) | _NUMBER | json_string()
_VALUE = st.recursive(_SCALAR, lambda inner: (
    st.lists(st.tuples(_WS, inner), max_size=3).map(_arr)
    | st.lists(st.tuples(_WS, _KEYS.flatmap(json_string), inner), max_size=3).map(_obj)), max_leaves=8)


@st.composite
def nested_transfer(draw: st.DrawFn) -> str:
    """A transfer key (any spelling) at some depth, in dicts and lists."""
    value = _obj([("", draw(st.sampled_from(TRANSFER_KEYS).flatmap(json_string)),
                   draw(st.sampled_from(["null", "{}", '{"remote_host":"10.0.0.1"}', "1"])))])
    for _ in range(draw(st.integers(0, 6))):
        if draw(st.booleans()):
            value = _arr([("", v) for v in draw(st.permutations([value, "1"]))])
        else:
            value = _obj([("", draw(_KEYS.flatmap(json_string)), value)])
    return value


@st.composite
def ids_text(draw: st.DrawFn) -> str:
    items = draw(st.lists(st.integers(0, 300_000).map(str) | st.sampled_from(["1", "7"]),
                          min_size=1, max_size=6))
    if draw(st.integers(0, 4)) == 0:  # a near miss, or another spelling vLLM's model reads
        items.append(draw(st.sampled_from(["-1", "1.0", "1e2", '"4"', "[1]", "true", "1.5", "null",
                                           "99999999999999999999", "{}"])))
    w = draw(_WS)
    return "[" + ",".join(f"{w}{x}" for x in items) + "]"


def _nested(depth: int) -> str:
    return "[" * depth + "1" + "]" * depth


@st.composite
def entries(draw: st.DrawFn) -> list[tuple[str, str, str]]:
    """A generate body's top-level entries: (whitespace, key text, value text)."""
    sp: list[tuple[str, str, str]] = []
    for name, value in [("max_tokens", _NUMBER | st.just("4")), ("temperature", _NUMBER | st.just("0")),
                        ("n", st.sampled_from(["1", "2", "1.0", "0"])),
                        ("extra_args", _VALUE | nested_transfer()),
                        ("stop", st.sampled_from(['"x"', "[]", "null"])),
                        ("detokenize", st.sampled_from(["true", "false"]))]:
        if draw(st.integers(0, 2)) == 0:
            sp.append((draw(_WS), draw(json_string(name)), draw(value)))
    out = [(draw(_WS), draw(json_string("token_ids")), draw(ids_text())),
           (draw(_WS), draw(json_string("sampling_params")), _obj(sp))]
    optional = [("request_id", json_string() | st.sampled_from(['"r-1"', '"abc"', "null", "1"])),
                ("model", _SCALAR), ("stream", st.sampled_from(["true", "false", "null", "1"])),
                ("output_mode", st.sampled_from(['"tokens"', '"text"', '"x"'])),
                ("cache_salt", json_string() | st.just('"salt"')),
                ("kv_transfer_params", st.sampled_from(["null", "{}", '{"port":1}']) | nested_transfer()),
                ("ec_transfer_params", st.sampled_from(["null", "{}"]) | nested_transfer()),
                ("x", _VALUE | nested_transfer()),
                ("deep", st.integers(MAX_JSON_DEPTH - 3, MAX_JSON_DEPTH + 2).map(_nested))]
    for name, value in optional:
        if draw(st.integers(0, 3)) == 0:
            out.append((draw(_WS), draw(json_string(name)), draw(value)))
    for _ in range(draw(st.integers(0, 2))):  # a key written twice: the last one counts
        w, k, _v = draw(st.sampled_from(out))
        out.insert(draw(st.integers(0, len(out))), (w, k, draw(_VALUE)))
    return draw(st.permutations(out))


@st.composite
def damaged(draw: st.DrawFn, text: str) -> str:
    """Mostly ``text``; sometimes cut, or a character put in."""
    how = draw(st.sampled_from(["none"] * 8 + ["cut", "insert"]))
    at = draw(st.integers(0, len(text)))
    if how == "cut":
        return text[:at]
    if how == "insert":
        junk = draw(st.sampled_from(["\ufeff", "\x00", "\ud800", ",", "]", "}", '"', "\\", "x"]))
        return text[:at] + junk + text[at:]
    return text


def render(items: list[tuple[str, str, str]], outer: str) -> str:
    return outer + _obj(items) + outer


def encode(text: str, encoding: str) -> bytes:
    return text.encode(encoding, "surrogatepass")


body_text = st.tuples(entries(), _WS).map(lambda t: render(*t)).flatmap(damaged)


# ------------------------------------------------------------------ properties


@HYPO
@given(text=body_text, encoding=st.sampled_from(ENCODINGS),
       content_type=st.sampled_from([JSON, JSON, JSON, "application/json; charset=utf-8", "text/plain"]),
       limit=st.sampled_from([0, 0, 4]))
def test_validate_decides_what_the_reference_decides(text: str, encoding: str, content_type: str,
                                                    limit: int) -> None:
    body, s = encode(text, encoding), _settings(limit)
    want = outcome(lambda: reference(body, content_type, s))
    assert outcome(lambda: Validation(s).validate(body, content_type)) == want, body[:300]


@st.composite
def large_text(draw: st.DrawFn) -> str:
    """A generate body for the large-body path: any of ``body_text``, or one where the ids are
    read early or another array could pass for them: ids that vLLM's model reads from strings or
    of 2**63 and more, a long or nested array with another error elsewhere, a ``"token_ids": [...]``
    nested deeper or under a key whose name ends in ``"token_ids`` (the largest array), then
    perhaps a JSON error after it."""
    if draw(st.integers(0, 2)) == 0:
        return draw(body_text)
    ids = draw(st.lists(st.integers(0, 500).map(str), min_size=1, max_size=8))
    if draw(st.integers(0, 2)) == 0:
        ids.insert(draw(st.integers(0, len(ids))), draw(st.sampled_from(
            ['"4"', '"0"', "9223372036854775808", "9223372036854775807", "18446744073709551616",
             "[3]", "{}", "-1", "1.0", "true"])))
    decoy = "[" + ",".join(["7"] * draw(st.integers(1, 12))) + "]"
    items = [("", '"token_ids"', "[" + ",".join(ids) + "]"), ("", '"sampling_params"', draw(st.sampled_from(
        ['{}', '{}', '{"max_tokens":4}', '{"temperature":5}', '{"n":0}', '{"detokenize":false}'])))]
    extra = draw(st.sampled_from(["", "nested", "key", "key-escaped", "list"]))
    if extra == "nested":
        items.append(("", '"x"', '{"token_ids":' + decoy + "}"))
    elif extra == "key":
        items.append(("", '"x\\"token_ids"', decoy))
    elif extra == "key-escaped":
        items.append(("", '"\\u0078\\"token_ids"', decoy))
    elif extra == "list":
        items.append(("", '"x"', '[{"token_ids" : ' + decoy + "}]"))
    if draw(st.integers(0, 3)) == 0:
        items.append(("", '"output_mode"', '"text"'))
    items = draw(st.permutations(items))
    text = _obj(items)
    if draw(st.integers(0, 2)) == 0:  # a JSON error after every array
        text = text[:-1] + draw(st.sampled_from([',"y":}', ",}", "}x", ' "y":1}', ',"y":1}}']))
    return text


@HYPO
@given(text=large_text(), encoding=st.sampled_from(ENCODINGS), limit=st.sampled_from([0, 0, 4]),
       slice_bytes=st.sampled_from([1, 2, 5, 64]))
@example(text='{"token_ids":[1,2,3,"4"],"sampling_params":{}}', encoding="utf-8", limit=0, slice_bytes=1)
@example(text='{"token_ids":[1,2,9223372036854775808],"sampling_params":{}}', encoding="utf-8", limit=0,
         slice_bytes=1)
@example(text='{"token_ids":[1,2,3,4,5,6],"sampling_params":{},"x":}', encoding="utf-8", limit=4,
         slice_bytes=1)
@example(text='{"token_ids":[1,2,[3]],"sampling_params":{"temperature":5}}', encoding="utf-8", limit=0,
         slice_bytes=1)
@example(text='{"token_ids":[1,2,3,4,5,6],"sampling_params":{"n":0}}', encoding="utf-8", limit=4,
         slice_bytes=1)
@example(text='{"token_ids":[1],"sampling_params":{},"x":{"token_ids":[7,7,7,7,7,7]},"y":}', encoding="utf-8",
         limit=4, slice_bytes=1)
@example(text='{"x\\"token_ids":[7,7,7,7,7,7],"token_ids":[1],"sampling_params":{},"y":}', encoding="utf-8",
         limit=4, slice_bytes=1)
@example(text='{"token_ids":[1,2,3,4,5,6],"sampling_params":{}}', encoding="utf-8", limit=4, slice_bytes=1)
def test_the_large_body_path_decides_what_the_reference_decides(text: str, encoding: str, limit: int,
                                                                slice_bytes: int) -> None:
    """``validate_large`` with slices of a few bytes, so that every body's ids are sliced: the
    same answer as the reference, accept or refuse, in every case."""
    body, s = encode(text, encoding), _settings(limit)
    want = outcome(lambda: reference(body, JSON, s))
    sliced = functools.partial(parse_large_generate_body, slice_bytes=slice_bytes)
    with mock.patch.object(validation_module, "parse_large_generate_body", sliced):
        got = outcome(lambda: asyncio.run(Validation(s).validate_large(body, JSON)))
    assert got == want, body[:300]
