"""Wire models of vLLM's tokens-in/tokens-out API (``/inference/v1/generate``).

This is the leaf module of the proxy: it imports nothing else of the project, so pd-sim and
pd-bench may share it. It reproduces what vLLM 0.32 does *before* a request reaches the engine:

* the pydantic request model (``GenerateRequest``) with vLLM's field types and validators,
* vLLM's ``SamplingParams`` checks (``VLLMValidationError``: a 400 ``BadRequestError``),
* FastAPI's body handling (content type, JSON decode errors) and vLLM's formatting of
  validation errors into ``{"error": {"message", "type", "param", "code"}}``.

The proxy validates with these models only; what it forwards is the client's own JSON object
(unknown keys included), so validation can never silently change a request.
The referee is ``tests/proxy/data/validation_cases.json``, generated from vLLM's own code.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import Any, Literal

import pydantic_core
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    GetCoreSchemaHandler,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import core_schema

OutputMode = Literal["tokens", "text"]
GENERATE_PREFIX = "generate-tokens-"
_SAMPLING_EPS = 1e-5
_MAX_N_SEQUENCES = 16384
_CACHE_SALT_FORBIDDEN_CHARS = frozenset("@/\\\x00")
_MAX_CACHE_SALT_LENGTH = 128


# --------------------------------------------------------------------------------------------
# Errors raised while validating (mapped to HTTP by proxy.errors)


class VLLMValidationError(Exception):
    """vLLM's ``VLLMValidationError``: not a ``ValueError``, so pydantic lets it propagate
    and the client sees ``type: "BadRequestError"`` with ``param`` = the parameter (or null)."""

    def __init__(self, message: str, *, parameter: str | None = None, value: Any = None) -> None:
        super().__init__(message)
        self.parameter = parameter
        self.value = value

    def __str__(self) -> str:
        base = super().__str__()
        extras = []
        if self.parameter is not None:
            extras.append(f"parameter={self.parameter}")
        if self.value is not None:
            extras.append(f"value={self.value}")
        return f"{base} ({', '.join(extras)})" if extras else base


class RequestValidationError(Exception):
    """FastAPI's ``RequestValidationError``: a 400 with ``type: "Bad Request"``."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


# --------------------------------------------------------------------------------------------
# vLLM's formatting of validation errors (vllm/entrypoints/serve/exception_handling)

_BRACKETED_INTERNAL_RE = re.compile(r"[\[\]{}()]")
_INTERNAL_LOC_MARKERS = frozenset(
    {
        "function-wrap", "function-after", "function-before", "function-plain", "json-or-python",
        "lax-or-strict", "chain", "default", "nullable", "tagged-union", "union", "call",
        "arguments", "is-instance", "is-subclass", "callable", "str", "int", "float", "bool",
        "bytes", "bytearray", "list", "tuple", "dict", "set", "frozenset", "complex", "none",
        "nonetype",
    }
)
_MAX_REPORTED_ERRORS = 10
_MAX_ERROR_INPUT_CHARS = 200
_MAX_ERROR_CHARS = 1000


def _summarize_error_input(value: object) -> object:
    if isinstance(value, bytes | bytearray):
        return f"<{type(value).__name__} of {len(value)} bytes>"
    if isinstance(value, list | tuple | set | frozenset | dict):
        return f"<{type(value).__name__} of {len(value)} items>"
    if isinstance(value, str):
        text = value
    else:
        try:
            text = str(value)
        except Exception:
            return f"<{type(value).__name__}>"
    if len(text) > _MAX_ERROR_INPUT_CHARS:
        return text[:_MAX_ERROR_INPUT_CHARS] + "...[truncated]"
    return text


def _is_internal_loc_segment(segment: str) -> bool:
    return bool(_BRACKETED_INTERNAL_RE.search(segment)) or segment.lower() in _INTERNAL_LOC_MARKERS


def clean_loc_for_param(loc: tuple[Any, ...]) -> str:
    parts = [str(p) for p in loc if not _is_internal_loc_segment(str(p))]
    if not parts:
        return ".".join(str(p) for p in loc)
    return ".".join(parts)


def _format_error(err: object) -> str:
    if isinstance(err, dict):
        err = dict(err)
        if "input" in err:
            err["input"] = _summarize_error_input(err["input"])
        loc = err.get("loc")
        if isinstance(loc, tuple | list):
            err["loc"] = clean_loc_for_param(tuple(loc))
    text = str(err)
    if len(text) > _MAX_ERROR_CHARS:
        text = text[:_MAX_ERROR_CHARS] + "...[truncated]"
    return text


def sanitize_message(message: str) -> str:
    message = re.sub(r" at 0x[0-9a-fA-F]+>", ">", message)
    message = re.sub(r'\n?\s*File "[^"]+", line \d+, in \S+(\n\s+.*)?', "", message)
    message = re.sub(r"/(?:home|usr|opt|var|tmp|root|lib|mnt|srv)(?:/[\w.\-]+)+", "<path>", message)
    message = re.sub(r"(?:/[\w\-]+)+/[\w\-]+\.\w+", "<path>", message)
    return message.strip()


def format_validation_errors(errors: list[Any], *, total: int | None = None) -> RequestValidationError:
    """Build the 400 that vLLM's ``validation_exception_handler`` would send for ``errors``
    (FastAPI-style dicts whose ``loc`` starts with ``"body"``, or plain strings). ``total``: how
    many errors there were when ``errors`` holds only the first of them."""
    param: str | None = None
    if errors:
        first = errors[0]
        loc = first.get("loc") if isinstance(first, dict) else None
        if loc:
            param = clean_loc_for_param(tuple(loc))
        count = len(errors) if total is None else total
        label = "error" if count == 1 else "errors"
        reported = errors[:_MAX_REPORTED_ERRORS]
        message = f"{count} validation {label}:\n"
        message += "".join(f"  {_format_error(err)}\n" for err in reported)
        if count > len(reported):
            message += f"  ...and {count - len(reported)} more {label}\n"
        message = message.rstrip()
    else:
        message = "Validation error"
    return RequestValidationError(sanitize_message(message), param)


# --------------------------------------------------------------------------------------------
# Request models


class SamplingParams:
    """The sampling parameters of a request, validated like vLLM's msgspec ``SamplingParams``
    (same pydantic schema shape: ``is-instance | typed-dict`` union, then ``_verify_args``).

    ``values`` holds the validated values of the keys the client sent (plus nothing else).
    """

    __slots__ = ("values",)

    def __init__(self, values: Mapping[str, Any]) -> None:
        self.values: dict[str, Any] = dict(values)

    def get(self, key: str, default: Any = None) -> Any:
        return self.values.get(key, default)

    @property
    def n(self) -> int:
        return int(self.values.get("n", 1))

    @property
    def detokenize(self) -> bool:
        return bool(self.values.get("detokenize", True))

    @property
    def stop(self) -> list[str]:
        stop = self.values.get("stop")
        if stop is None:
            return []
        return [stop] if isinstance(stop, str) else list(stop)

    @classmethod
    def __get_pydantic_core_schema__(
        cls, source_type: Any, handler: GetCoreSchemaHandler
    ) -> core_schema.CoreSchema:
        types: dict[str, Any] = {
            "n": int,
            "presence_penalty": float,
            "frequency_penalty": float,
            "repetition_penalty": float,
            "temperature": float,
            "top_p": float,
            "top_k": int,
            "min_p": float,
            "seed": int | None,
            "stop": str | list[str] | None,
            "stop_token_ids": list[int] | None,
            "ignore_eos": bool,
            "max_tokens": int | None,
            "min_tokens": int,
            "logprobs": int | None,
            "prompt_logprobs": int | None,
            "prompt_logprob_token_ids": list[list[int]] | None,
            "logprob_token_ids": list[int] | None,
            "detokenize": bool,
            "skip_special_tokens": bool,
            "spaces_between_special_tokens": bool,
            "include_stop_str_in_output": bool,
            "stream_interval": int | None,
            "logit_bias": dict[int, float] | None,
            "allowed_token_ids": list[int] | None,
            "extra_args": dict[str, Any] | None,
            "bad_words": list[str] | None,
        }
        fields = {
            name: core_schema.typed_dict_field(handler.generate_schema(tp), required=False)
            for name, tp in types.items()
        }
        return core_schema.union_schema(
            [
                core_schema.is_instance_schema(cls),
                core_schema.no_info_after_validator_function(
                    cls._verify, core_schema.typed_dict_schema(fields)
                ),
            ]
        )

    @classmethod
    def _verify(cls, values: dict[str, Any]) -> SamplingParams:
        """vLLM's ``SamplingParams.__post_init__`` / ``_verify_args`` checks, in its order."""
        n = values.get("n", 1)
        _verify_n_and_penalties(values, n)
        temperature = _verify_temperature(values.get("temperature", 1.0))
        _verify_ranges(values)
        _verify_stop_and_bad_words(values)
        if temperature < _SAMPLING_EPS and n > 1:
            raise VLLMValidationError(f"n must be 1 when using greedy sampling, got {n}.")
        return cls(values)


def _verify_n_and_penalties(v: dict[str, Any], n: int) -> None:
    if n < 1:
        raise VLLMValidationError(f"n must be at least 1, got {n}.")
    if n > _MAX_N_SEQUENCES:
        raise VLLMValidationError(
            f"n must be at most {_MAX_N_SEQUENCES}, got {n}. To increase this limit, set the "
            "VLLM_MAX_N_SEQUENCES environment variable."
        )
    presence = v.get("presence_penalty", 0.0)
    if not -2.0 <= presence <= 2.0:
        raise VLLMValidationError(f"presence_penalty must be in [-2, 2], got {presence}.")
    frequency = v.get("frequency_penalty", 0.0)
    if not -2.0 <= frequency <= 2.0:
        raise VLLMValidationError(f"frequency_penalty must be in [-2, 2], got {frequency}.")
    rep = v.get("repetition_penalty", 1.0)
    if not math.isfinite(rep):
        raise VLLMValidationError(f"repetition_penalty must be a finite number, got {rep}.")
    if rep <= 0.0:
        raise VLLMValidationError(f"repetition_penalty must be greater than zero, got {rep}.")


def _verify_temperature(temperature: float) -> float:
    """The temperature vLLM samples with (a tiny positive one is raised to 0.01), checked."""
    if 0 < temperature < 1e-2:
        temperature = 1e-2
    if not math.isfinite(temperature):
        raise VLLMValidationError(
            f"temperature must be a finite number, got {temperature}.",
            parameter="temperature", value=temperature,
        )
    if temperature < 0.0:
        raise VLLMValidationError(
            f"temperature must be non-negative, got {temperature}.",
            parameter="temperature", value=temperature,
        )
    if temperature > 2.0:
        raise VLLMValidationError(
            f"temperature must be in [0, 2], got {temperature}.",
            parameter="temperature", value=temperature,
        )
    return temperature


def _verify_ranges(v: dict[str, Any]) -> None:
    top_p = v.get("top_p", 1.0)
    if not 0.0 < top_p <= 1.0:
        raise VLLMValidationError(
            f"top_p must be in (0, 1], got {top_p}.", parameter="top_p", value=top_p
        )
    top_k = v.get("top_k", 0)
    if top_k < -1:
        raise VLLMValidationError(f"top_k must be 0 (disable), or at least 1, got {top_k}.")
    min_p = v.get("min_p", 0.0)
    if not 0.0 <= min_p <= 1.0:
        raise VLLMValidationError(f"min_p must be in [0, 1], got {min_p}.")
    max_tokens = v.get("max_tokens", 16)
    if max_tokens is not None and max_tokens < 1:
        raise VLLMValidationError(
            f"max_tokens must be at least 1, got {max_tokens}.",
            parameter="max_tokens", value=max_tokens,
        )
    min_tokens = v.get("min_tokens", 0)
    if min_tokens < 0:
        raise VLLMValidationError(
            f"min_tokens must be greater than or equal to 0, got {min_tokens}."
        )
    if max_tokens is not None and min_tokens > max_tokens:
        raise VLLMValidationError(
            f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {min_tokens}."
        )
    interval = v.get("stream_interval")
    if interval is not None and interval < 1:
        raise VLLMValidationError(
            f"stream_interval must be at least 1, got {interval}.",
            parameter="stream_interval", value=interval,
        )
    for name in ("logprobs", "prompt_logprobs"):
        lp = v.get(name)
        if lp is not None and lp != -1 and lp < 0:
            raise VLLMValidationError(
                f"{name} must be non-negative or -1, got {lp}.", parameter=name, value=lp
            )


def _verify_stop_and_bad_words(v: dict[str, Any]) -> None:
    stop = v.get("stop")
    stop_list = [] if stop is None else ([stop] if isinstance(stop, str) else stop)
    if any(not s for s in stop_list):
        raise VLLMValidationError("stop cannot contain an empty string.")
    if stop_list and not v.get("detokenize", True):
        raise VLLMValidationError(
            "stop strings are only supported when detokenize is True. "
            "Set detokenize=True to use stop."
        )
    bad_words = v.get("bad_words") or []
    if any(not w for w in bad_words):
        raise VLLMValidationError(
            f"bad_words cannot contain an empty string. Got bad_words={list(dict.fromkeys(bad_words))}"
        )


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


def loads_bounded(body: bytes) -> Any:
    """``json.loads`` for untrusted bodies: every failure (bad JSON, bad UTF-8, nesting that
    exhausts the parser's recursion, integers past Python's digit limit, lone surrogates,
    nesting deeper than ``MAX_JSON_DEPTH``) is a ``JSONBodyError``, never anything else."""
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


def parse_generate_body(body: bytes, content_type: str) -> tuple[GenerateRequest, dict[str, Any]]:
    """Parse and validate a generate request body exactly as vLLM's FastAPI route does.

    Returns the validated model and the client's JSON object (to forward untouched).
    Raises ``RequestValidationError`` or ``VLLMValidationError``.
    """
    media_type = content_type.lower().split(";", maxsplit=1)[0].strip()
    if media_type != "application/json":
        raise format_validation_errors(["Unsupported Media Type: Only 'application/json' is allowed"])
    if not body:
        raise format_validation_errors(
            [{"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}]
        )
    try:
        data = loads_bounded(body)
    except JSONBodyError as e:
        raise format_validation_errors(
            [{"type": "json_invalid", "loc": ("body", e.pos), "msg": "JSON decode error",
              "input": {}, "ctx": {"error": e.reason}}]
        ) from None
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
# Response / error shapes

_COMPACT_ENCODE = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode
"""Built once: ``json.dumps`` with keyword arguments builds a new encoder per call."""


def compact_json(obj: Any) -> bytes:
    """JSON as vLLM (starlette) writes it: compact, UTF-8 unescaped."""
    return _COMPACT_ENCODE(obj).encode()


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
    ``loads_bounded`` keeps ``json.loads``, whose error messages are the ones vLLM's FastAPI
    route reports."""
    return pydantic_core.from_json(raw, allow_inf_nan=True)


def unique_key_end(raw: bytes, quoted: bytes) -> int | None:
    """Where the one occurrence of ``quoted`` (a key with its quotes, ``b'"token_ids"'``) in the
    JSON text ``raw`` ends, or None unless it occurs exactly once and no other spelling of it
    can: a quote inside a JSON string is always escaped, and only a ``\\u`` escape can spell a
    key another way. When the parse of ``raw`` has that key, the one occurrence is it."""
    if b"\\u" in raw or raw.count(quoted) != 1:
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


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorInfo


def error_body(message: str, err_type: str, code: int, param: str | None = None) -> dict[str, Any]:
    """vLLM's error JSON object."""
    return ErrorResponse(
        error=ErrorInfo(message=message, type=err_type, param=param, code=code)
    ).model_dump()


def engine_request_id(base: str) -> str:
    """The id vLLM's engine knows a generate request by."""
    return GENERATE_PREFIX + base


def abort_choice(index: int, output_mode: str) -> dict[str, Any]:
    """A stream chunk's choice that vLLM sends when a request is aborted."""
    choice: dict[str, Any] = {
        "index": index, "finish_reason": "abort", "stop_reason": None, "token_ids": [],
        "routed_experts": None, "sampling_mask": None, "weight_versions": None,
    }
    if output_mode == "text":
        choice["text"] = ""
    choice["logprobs"] = None
    return choice


def abort_stream_chunk(request_id: str, output_mode: str, index: int = 0) -> dict[str, Any]:
    return {"request_id": request_id, "usage": None, "output_mode": output_mode,
            "choices": [abort_choice(index, output_mode)]}


def abort_full_response(
    request_id: str, *, model: str | None, created: int, prompt_tokens: int, output_mode: str, n: int
) -> dict[str, Any]:
    """A non-stream response for a request aborted before it produced anything."""
    return {
        "request_id": request_id, "model": model, "created": created,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens,
                  "completion_tokens": 0, "prompt_tokens_details": None,
                  "completion_tokens_details": None},
        "prompt_logprobs": None, "prompt_token_id_logprobs": None, "prompt_token_ids": None,
        "mm_placeholders": None, "metrics": None, "kv_transfer_params": None,
        "ec_transfer_params": None, "output_mode": output_mode,
        "choices": [abort_choice(i, output_mode) for i in range(n)],
    }
