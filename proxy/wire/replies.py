"""Bodies the proxy writes itself in vLLM's shapes: the error object, and what vLLM answers for a
request aborted before its end (a stream's last chunk, a non-stream response with no output)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel


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
