"""Wire models of vLLM's tokens-in/tokens-out API (``/inference/v1/generate``).

A leaf of the proxy with the modules it uses (``sampling``, ``validation_errors``): they import
nothing else of the project. It reproduces what vLLM 0.32 does *before* a request reaches the
engine:

* the pydantic request model (``GenerateRequest``) with vLLM's field types and validators,
* vLLM's ``SamplingParams`` checks (``proxy.wire.sampling``; ``VLLMValidationError``: a 400
  ``BadRequestError``),
* FastAPI's body handling (content type, JSON decode errors) and vLLM's formatting of
  validation errors into ``{"error": {"message", "type", "param", "code"}}``
  (``proxy.wire.validation_errors``).

It also holds the JSON helpers of the proxy's hot paths (client-facing compact JSON, hop bodies,
workers' answers, splicing a key's null without a parse). The proxy validates with these models
only; what it forwards is the client's own JSON object (unknown keys included), so validation can
never silently change a request. The referee is ``tests/proxy/data/validation_cases.json``,
generated from vLLM's own code.
"""

from __future__ import annotations

import json
import re
import sys
from typing import Any, Literal, overload

import pydantic_core
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from proxy.wire.sampling import SamplingParams
from proxy.wire.validation_errors import RequestValidationError, VLLMValidationError, format_validation_errors

OutputMode = Literal["tokens", "text"]
GENERATE_PREFIX = "generate-tokens-"
_CACHE_SALT_FORBIDDEN_CHARS = frozenset("@/\\\x00")
_MAX_CACHE_SALT_LENGTH = 128


# --------------------------------------------------------------------------------------------
# Request models


class StreamOptions(BaseModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class GenerateRequest(BaseModel):
    """vLLM's ``GenerateRequest`` (the fields that can fail validation; others pass through)."""

    model_config = ConfigDict(extra="ignore", arbitrary_types_allowed=True)

    request_id: str | None = None
    token_ids: list[int] = Field(min_length=1)
    token_offsets: list[tuple[int, int]] | None = None
    features: dict[str, Any] | None = None
    content_parts: list[dict[str, Any]] | None = None
    sampling_params: SamplingParams
    model: str | None = None
    reasoning_ended: bool | None = None
    reasoning_parser_kwargs: dict[str, Any] | None = None
    return_token_ids: bool | None = None
    output_mode: OutputMode = "tokens"
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024)
    priority: int = Field(default=0, ge=-(2**63), le=2**63 - 1)
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None

    @field_validator("token_ids")
    @classmethod
    def _validate_token_ids(cls, v: list[int]) -> list[int]:
        if v and min(v) < 0:  # min runs in C: half of ``any`` over a generator at 4k ids
            raise ValueError("token_ids must not contain negative values")
        return v

    @model_validator(mode="before")
    @classmethod
    def _validate_cache_salt(cls, data: Any) -> Any:
        if isinstance(data, dict):
            salt = data.get("cache_salt")
            if salt is not None:
                if not isinstance(salt, str) or not salt:
                    raise VLLMValidationError(
                        "Parameter 'cache_salt' must be a non-empty string if provided.",
                        parameter="cache_salt",
                    )
                if len(salt) > _MAX_CACHE_SALT_LENGTH or any(
                    c in _CACHE_SALT_FORBIDDEN_CHARS for c in salt
                ):
                    raise VLLMValidationError(
                        "Parameter 'cache_salt' must be at most 128 characters and must "
                        "not contain '@', '/', '\\\\', or NUL.",
                        parameter="cache_salt",
                    )
        return data

    @model_validator(mode="after")
    def _check_output_mode_detokenizes(self) -> GenerateRequest:
        if self.output_mode != "tokens" and not self.sampling_params.detokenize:
            raise ValueError(
                f"output_mode={self.output_mode!r} requires sampling_params.detokenize to be true"
            )
        return self

    @property
    def is_stream(self) -> bool:
        return bool(self.stream)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


MAX_JSON_DEPTH = 64
"""Deepest nesting of arrays/objects accepted in a request body (vLLM's own fields need 3)."""
# A surrogate written as a ``\u`` escape, or as raw bytes (UTF-8 forbids them; ``json.loads``
# decodes bytes with "surrogatepass" and lets them through): either leaves a lone surrogate in a
# string, which no later encode can carry (it was a 500 when the hop body was encoded).
_SURROGATE_ESCAPE_RE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}|\xed[\xa0-\xbf]")


class JSONBodyError(ValueError):
    """A request body that is not JSON the proxy can handle (and forward as UTF-8)."""

    def __init__(self, reason: str, pos: int = 0, detail: str | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.pos = pos
        self.detail = detail if detail is not None else reason
        """The reason with its position, as ``str(json.JSONDecodeError)`` words it."""


def _check_nesting_and_text(obj: Any) -> None:
    """Walk ``obj`` without recursion: too deep, or a string UTF-8 cannot carry (a lone
    surrogate written as a ``\\u`` escape) raises ``JSONBodyError``."""
    stack: list[tuple[Any, int]] = [(obj, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict):
            items: Any = [*value.keys(), *value.values()]
        elif isinstance(value, list):
            items = value
        elif isinstance(value, str):
            try:
                value.encode()
            except UnicodeEncodeError:
                raise JSONBodyError("lone surrogate in a string (not valid UTF-8)") from None
            continue
        else:
            continue
        if depth > MAX_JSON_DEPTH:
            raise JSONBodyError(f"nested deeper than {MAX_JSON_DEPTH} levels")
        stack.extend((item, depth + 1) for item in items if isinstance(item, dict | list | str))


def _jiter_int_digits() -> int:
    """The most digits pydantic-core's parser takes in an integer literal (it refuses longer ones
    even where Python allows them, and takes shorter ones even past a lower
    ``sys.get_int_max_str_digits()``), or ``sys.maxsize`` if it has no such cap."""
    try:
        pydantic_core.from_json(b"9" * 4301)
    except ValueError:
        return 4300
    return sys.maxsize


_JITER_INT_DIGITS = _jiter_int_digits()


_JSON_DECODER = json.JSONDecoder()
"""What ``json.loads`` runs on a text once it decoded it (no state between calls)."""
_NOT_PLAIN_FIRST = b"\x00\xef\xfe\xff"
"""First bytes of a body ``json.detect_encoding`` may take for other than UTF-8 (a BOM or a NUL)."""


@overload
def utf8_json(body: bytes) -> bytes: ...
@overload
def utf8_json(body: bytes | bytearray) -> bytes | bytearray: ...
def utf8_json(body: bytes | bytearray) -> bytes | bytearray:
    """``body`` as the UTF-8 bytes of the text ``json.loads`` reads in it: ``body`` itself when
    ``json.detect_encoding`` says plain UTF-8 (a check of its first two bytes, nearly always),
    else its text decoded as ``json.loads`` decodes it (UTF-16/32 LE/BE, with or without a BOM,
    or UTF-8 after a BOM; ``"surrogatepass"``) and encoded again without a BOM. So every byte
    search of a body (the transfer-params scan, the surrogate scan, the known shapes, the token
    ids' text) sees what it sees in the same body sent as UTF-8, and the hop bodies are UTF-8.
    A body ``json.loads`` cannot decode raises its ``JSONBodyError``."""
    if len(body) > 1 and body[1] and body[0] not in _NOT_PLAIN_FIRST:
        return body
    encoding = json.detect_encoding(body)
    if encoding == "utf-8":
        return body
    try:
        text = body.decode(encoding, "surrogatepass")
    except UnicodeDecodeError:
        raise JSONBodyError("invalid UTF-8") from None
    out = text.encode("utf-8", "surrogatepass")
    if not out or json.detect_encoding(out) != "utf-8":
        # The text is empty (a BOM alone: not an empty body) or starts with a BOM or a NUL (not
        # JSON, and its UTF-8 bytes would be taken for another encoding again): the error is
        # ``json.loads``' own (its decoder's, once it decoded the body).
        try:
            _JSON_DECODER.decode(text)
        except json.JSONDecodeError as e:
            raise JSONBodyError(e.msg, e.pos, str(e)) from None
        raise JSONBodyError("Expecting value")  # not reached: such a text is not JSON
    return out


def loads_bounded(body: bytes) -> Any:
    """``json.loads`` for untrusted bodies: every failure (bad JSON, bad UTF-8, nesting that
    exhausts the parser's recursion, integers past Python's digit limit, lone surrogates,
    nesting deeper than ``MAX_JSON_DEPTH``) is a ``JSONBodyError``, never anything else.

    The value is ``json.loads``'s, asked first of pydantic-core's parser (jiter: a third of the
    time on a generate body of 256 ids, the surrogate search skipped too). What jiter takes,
    ``json.loads`` takes with the same value (types, big integers, correctly rounded floats,
    ``-0.0``, ``1e400`` as inf, ``NaN``, ``Infinity``, the last of repeated keys in the first
    one's place); whatever jiter refuses goes to ``json.loads``, so every error, and what only
    ``json.loads`` takes (a lone surrogate, integers of more than 4300 digits when Python allows
    them), comes from the same code as before. Two cases jiter would
    take differently go to ``json.loads`` directly: a body that can nest deeper than
    ``MAX_JSON_DEPTH`` (the walk that refuses it is on ``json.loads``'s path), and, under an
    integer digit limit lowered below jiter's cap, a body long enough to hold an integer past it
    (jiter does not apply the limit). jiter's strings are valid UTF-8 (Rust's), so no surrogate
    needs looking for on its path. A body in another encoding than UTF-8 is read as UTF-8 first
    (``utf8_json``), so the surrogate search sees every surrogate."""
    body = utf8_json(body)
    limit = sys.get_int_max_str_digits()
    if (body.count(b"[") + body.count(b"{") <= MAX_JSON_DEPTH
            and (limit == 0 or limit >= _JITER_INT_DIGITS or len(body) <= limit)):
        try:
            return pydantic_core.from_json(body, allow_inf_nan=True, allow_partial=False)
        except Exception:  # whatever jiter refuses, json.loads answers (a value or the error)
            return _loads_bounded_stdlib(body)
    return _loads_bounded_stdlib(body)


def _loads_bounded_stdlib(body: bytes) -> Any:
    """``loads_bounded`` by ``json.loads`` alone: the reference, and every error's source."""
    body = utf8_json(body)
    try:
        data = json.loads(body)
    except json.JSONDecodeError as e:
        raise JSONBodyError(e.msg, e.pos, str(e)) from None
    except UnicodeDecodeError:
        raise JSONBodyError("invalid UTF-8") from None
    except RecursionError:
        raise JSONBodyError(f"nested deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as e:  # e.g. an integer literal longer than sys.get_int_max_str_digits()
        raise JSONBodyError(str(e).split(":", 1)[0]) from None
    # The walk costs O(size): run it only when the body can be deep or carries a surrogate.
    if body.count(b"[") + body.count(b"{") > MAX_JSON_DEPTH or _SURROGATE_ESCAPE_RE.search(body):
        _check_nesting_and_text(data)
    return data


def _check_media_type(content_type: str) -> None:
    media_type = content_type.lower().split(";", maxsplit=1)[0].strip()
    if media_type != "application/json":
        raise format_validation_errors(["Unsupported Media Type: Only 'application/json' is allowed"])


def _json_invalid(e: JSONBodyError) -> RequestValidationError:
    return format_validation_errors(
        [{"type": "json_invalid", "loc": ("body", e.pos), "msg": "JSON decode error",
          "input": {}, "ctx": {"error": e.reason}}])


@overload
def utf8_request_body(body: bytes, content_type: str) -> bytes: ...
@overload
def utf8_request_body(body: bytes | bytearray, content_type: str) -> bytes | bytearray: ...
def utf8_request_body(body: bytes | bytearray, content_type: str) -> bytes | bytearray:
    """A generate body as UTF-8 (``utf8_json``), for every check after it; a body ``json.loads``
    cannot decode raises what ``parse_generate_body`` raises for it (its media type first)."""
    try:
        return utf8_json(body)
    except JSONBodyError as e:
        _check_media_type(content_type)
        raise _json_invalid(e) from None


def parse_generate_body(body: bytes, content_type: str) -> tuple[GenerateRequest, dict[str, Any]]:
    """Parse and validate a generate request body exactly as vLLM's FastAPI route does.

    Returns the validated model and the client's JSON object (to forward untouched).
    Raises ``RequestValidationError`` or ``VLLMValidationError``.
    """
    _check_media_type(content_type)
    if not body:
        raise format_validation_errors(
            [{"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}]
        )
    try:
        data = loads_bounded(body)
    except JSONBodyError as e:
        raise _json_invalid(e) from None
    if not isinstance(data, dict):
        raise format_validation_errors(
            [{"type": "model_attributes_type", "loc": ("body",),
              "msg": "Input should be a valid dictionary or object to extract fields from",
              "input": data}]
        )
    try:
        req = GenerateRequest.model_validate(data)
    except ValidationError as e:
        errors = [
            {**err, "loc": ("body", *err["loc"])}
            for err in e.errors(include_url=False)
        ]
        raise format_validation_errors(errors) from None
    return req, data


# --------------------------------------------------------------------------------------------
# JSON in and out

_COMPACT_ENCODE = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode
"""Built once: ``json.dumps`` with keyword arguments builds a new encoder per call."""


def compact_json(obj: Any) -> bytes:
    """JSON as vLLM (starlette) writes it: compact, UTF-8 unescaped. An object of integers
    (``{"cached_tokens": 3}``, what the proxy splices into a reply) is written by pydantic-core's
    serializer, whose bytes differ from ``json.dumps``' only in floats' spelling (2.0 -> 0.8 us)."""
    if type(obj) is dict and all(type(k) is str and type(v) is int for k, v in obj.items()):
        return pydantic_core.to_json(obj)
    return _COMPACT_ENCODE(obj).encode()


def stream_json(obj: Any) -> bytes:
    """A stream chunk's JSON as vLLM writes it (``model_dump_json`` of its stream response:
    pydantic-core): compact, UTF-8 unescaped, floats in pydantic-core's spelling (``1e-7``,
    ``0.00001``; ``json.dumps``, which writes vLLM's non-stream replies, has ``1e-07`` and
    ``1e-05``), NaN and infinities as ``null`` as ``model_dump_json`` writes them (vLLM floors
    logprobs at -9999.0: they do not occur). For the chunks the proxy writes itself or rewrites
    (P's first token, D's first chunk without it, a migrated stream's chunks)."""
    return pydantic_core.to_json(obj, inf_nan_mode="null")


def hop_json(obj: Any) -> bytes:
    """JSON for a worker (a hop's body): compact, UTF-8 unescaped, NaN and Infinity spelled as
    ``json.dumps`` spells them, written by pydantic-core's serializer, about five times faster
    than ``compact_json``. Not for the client: a float may be spelled differently from
    ``json.dumps`` (``0.00001`` for ``1e-05``), though it is the same number, and the bytes a
    client gets are those a vLLM server would send."""
    return pydantic_core.to_json(obj, inf_nan_mode="constants")


def parse_worker_json(raw: bytes) -> Any:
    """A worker's JSON answer, parsed by pydantic-core: 2-4x faster than ``json.loads`` on
    vLLM's replies, and the same values (NaN and Infinity accepted, big integers exact, the
    last of repeated keys kept). ``ValueError`` when it is not JSON. Not for client bodies:
    ``loads_bounded`` answers a body jiter refuses with ``json.loads``, whose error messages
    are the ones vLLM's FastAPI route reports."""
    return pydantic_core.from_json(raw, allow_inf_nan=True)


def parse_stream_chunk(payload: bytes) -> dict[str, Any] | None:
    """A stream event's data as a generate chunk (an object with a ``choices`` list), parsed as
    ``parse_worker_json`` parses it; None when it is not one (not JSON, or another shape)."""
    try:
        chunk = parse_worker_json(payload)
    except ValueError:
        return None
    if not isinstance(chunk, dict) or not isinstance(chunk.get("choices"), list):
        return None
    return chunk


def unique_key_end(raw: bytes, quoted: bytes) -> int | None:
    """Where the one occurrence of ``quoted`` (a key with its quotes, ``b'"token_ids"'``) in the
    JSON text ``raw`` ends, or None unless it occurs exactly once and no other spelling of it
    can: a quote inside a JSON string is always escaped, and only a ``\\u`` escape can spell a
    key another way. When the parse of ``raw`` has that key, the one occurrence is it."""
    # A lone backslash is looked for first: one byte is searched for at memchr's speed, the
    # two of ``\\u`` several times slower (1.6 against 0.5 us at 1 KiB).
    if (b"\\" in raw and b"\\u" in raw) or raw.count(quoted) != 1:
        return None
    return raw.find(quoted) + len(quoted)


def splice_null_key(raw: bytes, key: str, value: Any) -> bytes | None:
    """``raw`` (a JSON text whose parse has ``key`` with the value null, at whatever depth) with
    that null replaced by ``value``, without parsing or writing the rest; None when the key
    cannot be told apart for certain (``unique_key_end``) or is not written ``"key":null``."""
    end = unique_key_end(raw, b'"' + key.encode() + b'"')
    if end is None or not raw.startswith(b":null", end):
        return None
    return raw[:end] + b":" + compact_json(value) + raw[end + len(b":null"):]


def engine_request_id(base: str) -> str:
    """The id vLLM's engine knows a generate request by."""
    return GENERATE_PREFIX + base
