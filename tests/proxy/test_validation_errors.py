"""vLLM's wording of validation errors (``proxy.wire.validation_errors``): the count, the first ten and
the rest counted, ``param`` from the first error's location without pydantic's internal segments,
long inputs summarised, addresses and paths kept out of the message. The whole 400s are held
against vLLM's own code by ``test_protocol`` (the referee)."""

from __future__ import annotations

from typing import Any

from proxy.wire.validation_errors import (
    RequestValidationError,
    VLLMValidationError,
    clean_loc_for_param,
    format_validation_errors,
    sanitize_message,
)


def err(loc: tuple[Any, ...], value: Any = 1) -> dict[str, Any]:
    return {"type": "int_type", "loc": loc, "msg": "Input should be a valid integer", "input": value}


def test_param_is_the_first_errors_location_without_pydantics_internal_segments() -> None:
    internal = "function-after[_verify(), typed-dict]"
    e = format_validation_errors([err(("body", "sampling_params", internal, "n")),
                                  err(("body", "token_ids", 0))])
    assert isinstance(e, RequestValidationError)
    assert e.param == "body.sampling_params.n"
    assert e.message.startswith("2 validation errors:\n"
                                "  {'type': 'int_type', 'loc': 'body.sampling_params.n',")
    assert clean_loc_for_param(("function-after[x]", "union")) == "function-after[x].union"  # all internal


def test_ten_errors_are_written_and_the_rest_counted() -> None:
    e = format_validation_errors([err(("body", "token_ids", i), i) for i in range(12)])
    lines = e.message.split("\n")
    assert lines[0] == "12 validation errors:"
    assert lines[1:11] == [f"  {{'type': 'int_type', 'loc': 'body.token_ids.{i}', 'msg': "
                           f"'Input should be a valid integer', 'input': '{i}'}}" for i in range(10)]
    assert lines[11:] == ["  ...and 2 more errors"]
    one = format_validation_errors([err(("body", "token_ids", 0))], total=2)  # the rest not given
    assert one.message.split("\n")[0] == "2 validation errors:"
    assert one.message.endswith("...and 1 more errors")


def test_long_and_container_inputs_are_summarised() -> None:
    long = format_validation_errors([err(("body", "model"), "x" * 300)]).message
    assert "'input': '" + "x" * 200 + "...[truncated]'" in long
    assert "'input': '<list of 3 items>'" in format_validation_errors([err(("body",), [1, 2, 3])]).message
    assert "'input': '<bytes of 4 bytes>'" in format_validation_errors([err(("body",), b"abcd")]).message


def test_plain_messages_and_no_errors() -> None:
    e = format_validation_errors(["Unsupported Media Type: Only 'application/json' is allowed"])
    assert (e.message, e.param) == ("1 validation error:\n  Unsupported Media Type: Only 'application/json' "
                                    "is allowed", None)
    none = format_validation_errors([])
    assert (none.message, none.param) == ("Validation error", None)


def test_addresses_and_paths_are_kept_out_of_messages() -> None:
    message = sanitize_message("bad <object at 0x7f00aa> in /home/u/x.py and /srv/a/b ")
    assert message == "bad <object> in <path> and <path>"


def test_a_vllm_validation_error_names_its_parameter_and_value() -> None:
    assert str(VLLMValidationError("m", parameter="p", value=0)) == "m (parameter=p, value=0)"
    assert str(VLLMValidationError("m", value=3)) == "m (value=3)"
    assert str(VLLMValidationError("m")) == "m"
    assert not isinstance(VLLMValidationError("m"), ValueError)  # pydantic lets it through
