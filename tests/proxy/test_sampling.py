"""vLLM's ``SamplingParams`` checks (``proxy.wire.sampling``), as ``GenerateRequest`` runs them: which
check speaks first when several fail (vLLM's order), the values kept, and the greedy-sampling rule
with vLLM's raise of a tiny temperature. The messages as a whole are held against vLLM's own code
by ``test_protocol`` (the referee)."""

from __future__ import annotations

import math
from typing import Any

import pytest
from pydantic import TypeAdapter, ValidationError

from proxy.wire.sampling import SamplingParams
from proxy.wire.validation_errors import VLLMValidationError

_ADAPTER: TypeAdapter[SamplingParams] = TypeAdapter(SamplingParams)


def refused(values: dict[str, Any]) -> tuple[str, str | None]:
    with pytest.raises(VLLMValidationError) as e:
        _ADAPTER.validate_python(values)
    return str(e.value), e.value.parameter


@pytest.mark.parametrize(("values", "first"), [
    # n and the penalties, then the temperature, then the ranges, then stop and bad words, then greedy n
    ({"n": 0, "temperature": -1.0, "top_p": 0.0}, "n must be at least 1, got 0."),
    ({"presence_penalty": 3.0, "temperature": -1.0}, "presence_penalty must be in [-2, 2], got 3.0."),
    ({"repetition_penalty": 0.0, "temperature": math.inf}, "repetition_penalty must be greater than zero"),
    ({"temperature": -1.0, "top_p": 0.0}, "temperature must be non-negative, got -1.0."),
    ({"temperature": 2.5, "max_tokens": 0}, "temperature must be in [0, 2], got 2.5."),
    ({"top_p": 0.0, "stop": [""]}, "top_p must be in (0, 1], got 0.0."),
    ({"max_tokens": 2, "min_tokens": 3, "stop": [""]},
     "min_tokens must be less than or equal to max_tokens=2"),
    ({"logprobs": -2, "bad_words": [""]}, "logprobs must be non-negative or -1, got -2."),
    ({"stop": ["a", ""], "n": 2, "temperature": 0}, "stop cannot contain an empty string."),
    ({"stop": "x", "detokenize": False}, "stop strings are only supported when detokenize is True."),
    ({"bad_words": ["", "", "w"], "n": 2, "temperature": 0}, "bad_words cannot contain an empty string. "
                                                             "Got bad_words=['', 'w']"),
    ({"n": 2, "temperature": 0}, "n must be 1 when using greedy sampling, got 2."),
])
def test_the_first_failing_check_in_vllms_order_is_reported(values: dict[str, Any], first: str) -> None:
    message, _ = refused(values)
    assert message.startswith(first), message


@pytest.mark.parametrize(("values", "param"), [
    ({"temperature": math.nan}, "temperature"), ({"top_p": 1.5}, "top_p"), ({"max_tokens": 0}, "max_tokens"),
    ({"stream_interval": 0}, "stream_interval"), ({"prompt_logprobs": -3}, "prompt_logprobs"),
    ({"n": 0}, None), ({"min_p": 2.0}, None), ({"top_k": -2}, None), ({"min_tokens": -1}, None),
])
def test_the_checks_that_name_their_parameter_name_it(values: dict[str, Any], param: str | None) -> None:
    assert refused(values)[1] == param


def test_a_tiny_temperature_is_sampling_not_greedy_and_is_kept_as_sent() -> None:
    """vLLM raises a temperature in (0, 0.01) to 0.01 for sampling: n > 1 is allowed with it, even
    below the greedy threshold (1e-5); the value forwarded is the client's."""
    sp = _ADAPTER.validate_python({"n": 2, "temperature": 1e-6})
    assert (sp.n, sp.get("temperature")) == (2, 1e-6)
    assert refused({"n": 2, "temperature": 0.0})[0].startswith("n must be 1 when using greedy sampling")


def test_the_values_kept_are_the_keys_sent_validated_laxly() -> None:
    sp = _ADAPTER.validate_python({"n": "2", "temperature": 1, "stop": "ab", "logprobs": -1})
    assert sp.values == {"n": 2, "temperature": 1.0, "stop": "ab", "logprobs": -1}
    assert (sp.n, sp.stop, sp.detokenize) == (2, ["ab"], True)
    empty = _ADAPTER.validate_python({})
    assert (empty.values, empty.n, empty.stop, empty.detokenize) == ({}, 1, [], True)
    assert _ADAPTER.validate_python(sp) is sp  # already validated: taken as it is


def test_a_value_of_the_wrong_type_is_a_field_error_not_a_check() -> None:
    with pytest.raises(ValidationError) as e:
        _ADAPTER.validate_python({"n": "x"})
    assert any(err["loc"][-1] == "n" for err in e.value.errors())
