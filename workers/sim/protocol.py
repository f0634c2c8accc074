"""Request models of ``/inference/v1/generate`` and vLLM's validation-error rendering.

The models have the same pydantic shapes as vLLM's ``GenerateRequest`` so that pydantic
produces the same error entries; ``validation_message`` renders them the way vLLM's
``validation_exception_handler`` does (``1 validation error:\\n  {...}``).
"""

from __future__ import annotations

import json
import math
from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator

from .errors import BadRequest, RequestValidation

_MAX_REPORTED_ERRORS = 10
_MAX_ERROR_INPUT_CHARS = 200
_MAX_ERROR_CHARS = 1000


class StreamOptions(BaseModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class SamplingParams(BaseModel):
    """The subset of vLLM's ``SamplingParams`` that pd-sim acts on; other keys are ignored."""

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
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
    extra_args: dict[str, Any] | None = None

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

    def engine_kv_transfer_params(self) -> dict[str, Any] | None:
        """What vLLM's engine acts on: the top-level field when not null (the server copies it
        into ``sampling_params.extra_args``), else ``extra_args["kv_transfer_params"]`` as the
        client sent it (``vllm/v1/request.py`` reads only ``extra_args``)."""
        if self.kv_transfer_params is not None:
            return self.kv_transfer_params
        extra = self.sampling_params.extra_args
        params = extra.get("kv_transfer_params") if extra is not None else None
        return params if isinstance(params, dict) else None

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


def vllm_error(message: str, parameter: str | None = None, value: Any = None) -> BadRequest:
    """vLLM's ``VLLMValidationError``: ``str()`` appends ``(parameter=..., value=...)``."""
    extras = []
    if parameter is not None:
        extras.append(f"parameter={parameter}")
    if value is not None:
        extras.append(f"value={value}")
    return BadRequest(f"{message} ({', '.join(extras)})" if extras else message, param=parameter)


_VLLM_DEFAULT_MAX_TOKENS = 16  # SamplingParams' dataclass default, checked before the server fills it


def verify_sampling_params(sp: SamplingParams) -> None:
    """vLLM's ``SamplingParams._verify_args`` and greedy check (run while the body is parsed, so
    their ``BadRequestError`` wins over other fields' validation errors)."""
    if sp.n < 1:
        raise vllm_error(f"n must be at least 1, got {sp.n}.")
    if not -2.0 <= sp.presence_penalty <= 2.0:
        raise vllm_error(f"presence_penalty must be in [-2, 2], got {sp.presence_penalty}.")
    if not -2.0 <= sp.frequency_penalty <= 2.0:
        raise vllm_error(f"frequency_penalty must be in [-2, 2], got {sp.frequency_penalty}.")
    if not math.isfinite(sp.repetition_penalty):
        raise vllm_error(f"repetition_penalty must be a finite number, got {sp.repetition_penalty}.")
    if sp.repetition_penalty <= 0.0:
        raise vllm_error(f"repetition_penalty must be greater than zero, got {sp.repetition_penalty}.")
    t = sp.temperature
    if not math.isfinite(t):
        raise vllm_error(f"temperature must be a finite number, got {t}.", "temperature", t)
    if t < 0.0:
        raise vllm_error(f"temperature must be non-negative, got {t}.", "temperature", t)
    if t > 2.0:
        raise vllm_error(f"temperature must be in [0, 2], got {t}.", "temperature", t)
    if not 0.0 < sp.top_p <= 1.0:
        raise vllm_error(f"top_p must be in (0, 1], got {sp.top_p}.", "top_p", sp.top_p)
    if sp.top_k < -1:
        raise vllm_error(f"top_k must be 0 (disable), or at least 1, got {sp.top_k}.")
    if not 0.0 <= sp.min_p <= 1.0:
        raise vllm_error(f"min_p must be in [0, 1], got {sp.min_p}.")
    max_tokens = sp.max_tokens if "max_tokens" in sp.model_fields_set else _VLLM_DEFAULT_MAX_TOKENS
    if max_tokens is not None and max_tokens < 1:
        raise vllm_error(f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens", max_tokens)
    if sp.min_tokens < 0:
        raise vllm_error(f"min_tokens must be greater than or equal to 0, got {sp.min_tokens}.")
    if max_tokens is not None and sp.min_tokens > max_tokens:
        raise vllm_error(
            f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {sp.min_tokens}."
        )
    if sp.logprobs is not None and sp.logprobs != -1 and sp.logprobs < 0:
        raise vllm_error(f"logprobs must be non-negative or -1, got {sp.logprobs}.", "logprobs", sp.logprobs)
    if sp.prompt_logprobs is not None and sp.prompt_logprobs != -1 and sp.prompt_logprobs < 0:
        raise vllm_error(
            f"prompt_logprobs must be non-negative or -1, got {sp.prompt_logprobs}.",
            "prompt_logprobs",
            sp.prompt_logprobs,
        )
    stops = [sp.stop] if isinstance(sp.stop, str) else (sp.stop or [])
    if any(not s for s in stops):
        raise vllm_error("stop cannot contain an empty string.")
    if stops and not sp.detokenize:
        raise vllm_error(
            "stop strings are only supported when detokenize is True. Set detokenize=True to use stop."
        )
    if t < 1e-5 and sp.n > 1:
        raise vllm_error(f"n must be 1 when using greedy sampling, got {sp.n}.")


def parse_generate_request(body: Any) -> GenerateRequest:
    try:
        req = GenerateRequest.model_validate(body)
    except ValidationError as e:
        # vLLM builds SamplingParams (and runs its checks) while validating the body; its
        # VLLMValidationError is not a ValueError, so it escapes pydantic and wins.
        raw_sp = body.get("sampling_params") if isinstance(body, dict) else None
        if isinstance(raw_sp, dict):
            try:
                sp = SamplingParams.model_validate(raw_sp)
            except ValidationError:
                pass
            else:
                verify_sampling_params(sp)
        errors: list[dict[str, Any]] = []
        for err in e.errors(include_url=False):
            entry = dict(err)
            entry["loc"] = ("body", *err["loc"])
            errors.append(entry)
        raise validation_error(errors) from None
    verify_sampling_params(req.sampling_params)
    return req


def usage_body(prompt: int, completion: int, details: bool = True) -> dict[str, Any]:
    """vLLM's ``usage`` object, its keys in vLLM's order (``details``: the two null detail keys too)."""
    u: dict[str, Any] = {"prompt_tokens": prompt, "total_tokens": prompt + completion,
                         "completion_tokens": completion}
    if details:
        u["prompt_tokens_details"] = None
        u["completion_tokens_details"] = None
    return u
