"""Request models of ``/inference/v1/generate`` and vLLM's validation-error rendering.

The models have the same pydantic shapes as vLLM's ``GenerateRequest`` so that pydantic
produces the same error entries; ``validation_message`` renders them the way vLLM's
``validation_exception_handler`` does (``1 validation error:\\n  {...}``).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator

from .errors import RequestValidation

_MAX_REPORTED_ERRORS = 10
_MAX_ERROR_INPUT_CHARS = 200
_MAX_ERROR_CHARS = 1000


class StreamOptions(BaseModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class SamplingParams(BaseModel):
    """The subset of vLLM's ``SamplingParams`` that pd-sim acts on; other keys are ignored."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = None
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    allowed_token_ids: list[int] | None = None
    prompt_logprob_token_ids: list[list[int]] | None = None

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        if isinstance(self.stop, str):
            return [self.stop] if self.stop else []
        return [s for s in self.stop if s]


class GenerateRequest(BaseModel):
    request_id: str | None = None
    token_ids: list[int] = Field(min_length=1)
    sampling_params: SamplingParams
    model: str | None = None
    return_token_ids: bool | None = None
    output_mode: Literal["tokens", "text"] = "tokens"
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024)
    priority: int = 0
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None

    @field_validator("token_ids")
    @classmethod
    def _validate_token_ids(cls, v: list[int]) -> list[int]:
        if any(t < 0 for t in v):
            raise ValueError("token_ids must not contain negative values")
        return v

    @model_validator(mode="after")
    def _check_output_mode_detokenizes(self) -> GenerateRequest:
        if self.output_mode != "tokens" and not self.sampling_params.detokenize:
            raise ValueError(
                f"output_mode={self.output_mode!r} requires sampling_params.detokenize to be true"
            )
        return self


def _summarize_input(value: object) -> object:
    if isinstance(value, str):
        if len(value) > _MAX_ERROR_INPUT_CHARS:
            return value[:_MAX_ERROR_INPUT_CHARS] + "...[truncated]"
        return value
    if isinstance(value, (bytes, bytearray)):
        return f"<{type(value).__name__} of {len(value)} bytes>"
    if isinstance(value, (list, tuple, set, frozenset, dict)):
        return f"<{type(value).__name__} of {len(value)} items>"
    text = str(value)
    if len(text) > _MAX_ERROR_INPUT_CHARS:
        return text[:_MAX_ERROR_INPUT_CHARS] + "...[truncated]"
    return text


def _format_error(err: dict[str, Any]) -> str:
    err = dict(err)
    if "input" in err:
        err["input"] = _summarize_input(err["input"])
    loc = err.get("loc")
    if isinstance(loc, (tuple, list)):
        err["loc"] = ".".join(str(p) for p in loc)
    text = str(err)
    if len(text) > _MAX_ERROR_CHARS:
        text = text[:_MAX_ERROR_CHARS] + "...[truncated]"
    return text


def validation_error(errors: list[dict[str, Any]]) -> RequestValidation:
    """vLLM's rendering of a list of pydantic error entries (``loc`` already prefixed)."""
    count = len(errors)
    label = "error" if count == 1 else "errors"
    reported = errors[:_MAX_REPORTED_ERRORS]
    message = f"{count} validation {label}:\n" + "".join(f"  {_format_error(e)}\n" for e in reported)
    if count > len(reported):
        message += f"  ...and {count - len(reported)} more {label}\n"
    param = None
    if errors:
        loc = errors[0].get("loc")
        if loc:
            param = ".".join(str(p) for p in loc)
    return RequestValidation(message.rstrip(), param=param)


def unsupported_media_type() -> RequestValidation:
    return RequestValidation(
        "1 validation error:\n  Unsupported Media Type: Only 'application/json' is allowed"
    )


def parse_json_body(raw: bytes) -> Any:
    """Decode a JSON body the way FastAPI does, raising vLLM's 400 on bad JSON."""
    try:
        return json.loads(raw)
    except json.JSONDecodeError as e:
        raise validation_error(
            [
                {
                    "type": "json_invalid",
                    "loc": ("body", e.pos),
                    "msg": "JSON decode error",
                    "input": {},
                    "ctx": {"error": e.msg},
                }
            ]
        ) from None
    except UnicodeDecodeError:
        raise validation_error(
            [
                {
                    "type": "json_invalid",
                    "loc": ("body", 0),
                    "msg": "JSON decode error",
                    "input": {},
                    "ctx": {"error": "invalid UTF-8"},
                }
            ]
        ) from None


def parse_generate_request(body: Any) -> GenerateRequest:
    try:
        return GenerateRequest.model_validate(body)
    except ValidationError as e:
        errors: list[dict[str, Any]] = []
        for err in e.errors(include_url=False):
            entry = dict(err)
            entry["loc"] = ("body", *err["loc"])
            errors.append(entry)
        raise validation_error(errors) from None
