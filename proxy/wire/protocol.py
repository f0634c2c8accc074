"""vLLM's ``/inference/v1/generate`` request validation (as vLLM 0.32 does it before the engine),
and the proxy's JSON helpers. Validation never changes what is forwarded: the client's own JSON
object. The referee is ``tests/proxy/data/validation_cases.json``, generated from vLLM's code.
"""

from __future__ import annotations

import json
import re
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
        if v and min(v) < 0:
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
# A surrogate as a ``\u`` escape or raw bytes: ``json.loads`` lets either through, no encode can carry it.
_SURROGATE_ESCAPE_RE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}|\xed[\xa0-\xbf]")


class JSONBodyError(ValueError):
    """A request body that is not JSON the proxy can handle (and forward as UTF-8)."""

    def __init__(self, reason: str, pos: int = 0, detail: str | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.pos = pos
        self.detail = detail if detail is not None else reason


def _check_nesting_and_text(obj: Any) -> None:
    """Raise ``JSONBodyError`` if ``obj`` is too deep or holds a string UTF-8 cannot carry."""
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


_JSON_DECODER = json.JSONDecoder()


@overload
def utf8_json(body: bytes) -> bytes: ...
@overload
def utf8_json(body: bytes | bytearray) -> bytes | bytearray: ...
def utf8_json(body: bytes | bytearray) -> bytes | bytearray:
    """``body`` as UTF-8 bytes of the text ``json.loads`` reads in it, so every byte search of a
    body sees what it would in UTF-8; undecodable raises ``JSONBodyError``."""
    encoding = json.detect_encoding(body)
    if encoding == "utf-8":
        return body
    try:
        text = body.decode(encoding, "surrogatepass")
    except UnicodeDecodeError:
        raise JSONBodyError("invalid UTF-8") from None
    out = text.encode("utf-8", "surrogatepass")
    if not out or json.detect_encoding(out) != "utf-8":
        # Not JSON (a BOM alone, or a BOM or NUL first): the error is ``json.loads``' own.
        try:
            _JSON_DECODER.decode(text)
        except json.JSONDecodeError as e:
            raise JSONBodyError(e.msg, e.pos, str(e)) from None
        raise JSONBodyError("Expecting value")  # not reached: such a text is not JSON
    return out


def loads_bounded(body: bytes) -> Any:
    """``json.loads``'s value for an untrusted body, or ``JSONBodyError``: nested at most
    ``MAX_JSON_DEPTH`` deep, every string one UTF-8 can carry."""
    body = utf8_json(body)
    try:
        data = json.loads(body)
    except json.JSONDecodeError as e:
        raise JSONBodyError(e.msg, e.pos, str(e)) from None
    except UnicodeDecodeError:
        raise JSONBodyError("invalid UTF-8") from None
    except RecursionError:
        raise JSONBodyError(f"nested deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as e:
        raise JSONBodyError(str(e).split(":", 1)[0]) from None
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
    """A generate body as UTF-8; undecodable raises what ``parse_generate_body`` raises."""
    try:
        return utf8_json(body)
    except JSONBodyError as e:
        _check_media_type(content_type)
        raise _json_invalid(e) from None


def parse_generate_body(body: bytes, content_type: str) -> tuple[GenerateRequest, dict[str, Any]]:
    """The validated model and the client's JSON object (forwarded untouched), or what vLLM's
    route raises: ``RequestValidationError`` or ``VLLMValidationError``."""
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


_COMPACT_ENCODE = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode


def compact_json(obj: Any) -> bytes:
    """JSON as vLLM (starlette) writes it (pydantic-core only for an object of ints: no floats)."""
    if type(obj) is dict and all(type(k) is str and type(v) is int for k, v in obj.items()):
        return pydantic_core.to_json(obj)
    return _COMPACT_ENCODE(obj).encode()


def stream_json(obj: Any) -> bytes:
    """A stream chunk's JSON as vLLM's ``model_dump_json`` writes it (floats in pydantic-core's
    spelling, NaN and infinities as ``null``), for the chunks the proxy writes or rewrites."""
    return pydantic_core.to_json(obj, inf_nan_mode="null")


def hop_json(obj: Any) -> bytes:
    """JSON for a worker (a hop's body). Not for the client: a float may be spelled differently
    from ``json.dumps`` (same number), and a client gets the bytes vLLM would send."""
    return pydantic_core.to_json(obj, inf_nan_mode="constants")


def parse_worker_json(raw: bytes) -> Any:
    """A worker's JSON answer (``ValueError`` if not JSON). Client bodies go to ``loads_bounded``."""
    return pydantic_core.from_json(raw, allow_inf_nan=True)


def parse_stream_chunk(payload: bytes) -> dict[str, Any] | None:
    """A stream event's data as a generate chunk (an object with a ``choices`` list), or None."""
    try:
        chunk = parse_worker_json(payload)
    except ValueError:
        return None
    if not isinstance(chunk, dict) or not isinstance(chunk.get("choices"), list):
        return None
    return chunk


def unique_key_end(raw: bytes, quoted: bytes) -> int | None:
    """Where the one occurrence of ``quoted`` (``b'"key"'``) in JSON ``raw`` ends, or None unless
    it occurs once and no ``\\u`` escape could spell it another way (quotes in strings are escaped)."""
    if (b"\\" in raw and b"\\u" in raw) or raw.count(quoted) != 1:
        return None
    return raw.find(quoted) + len(quoted)


def splice_null_key(raw: bytes, key: str, value: Any) -> bytes | None:
    """``raw`` with ``"key":null`` replaced by ``value`` without a parse; None unless the key is
    told apart for certain (``unique_key_end``) and written ``"key":null``."""
    end = unique_key_end(raw, b'"' + key.encode() + b'"')
    if end is None or not raw.startswith(b":null", end):
        return None
    return raw[:end] + b":" + compact_json(value) + raw[end + len(b":null"):]


def engine_request_id(base: str) -> str:
    """The id vLLM's engine knows a generate request by."""
    return GENERATE_PREFIX + base
