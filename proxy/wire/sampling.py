"""vLLM's ``SamplingParams`` checks, in vLLM's order with its messages (``VLLMValidationError``)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from pydantic import GetCoreSchemaHandler
from pydantic_core import core_schema

from proxy.wire.validation_errors import VLLMValidationError

_SAMPLING_EPS = 1e-5
_MAX_N_SEQUENCES = 16384


class SamplingParams:
    """A request's sampling parameters, validated as vLLM's msgspec ``SamplingParams``; ``values``
    holds only the keys the client sent."""

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
