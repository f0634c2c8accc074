"""What one request measured, and how a failed request is classified (no I/O here)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Final

# Failure kinds (the result JSON counts each under ``failures``).
FAIL_HTTP_STATUS: Final = "http_status"  # answered with a status other than 200
FAIL_ERROR_EVENT: Final = "error_event"  # an in-band ``{"error": ...}`` event or body
FAIL_NO_DONE: Final = "no_done"  # a 200 stream ended or broke without ``data: [DONE]``
FAIL_OUTPUT_MODE: Final = "output_mode"  # ``output_mode`` echo missing or not what was asked
FAIL_ABORTED: Final = "aborted"  # ``finish_reason: "abort"``
FAIL_INVALID: Final = "invalid_response"  # unparsable JSON, wrong content type, no choices
FAIL_TRANSPORT: Final = "transport"  # no answer: connection refused, or broken before a 200 stream
FAIL_TIMEOUT: Final = "timeout"  # the per-request timeout passed
FAILURE_KINDS: Final = (
    FAIL_HTTP_STATUS,
    FAIL_ERROR_EVENT,
    FAIL_NO_DONE,
    FAIL_OUTPUT_MODE,
    FAIL_ABORTED,
    FAIL_INVALID,
    FAIL_TRANSPORT,
    FAIL_TIMEOUT,
)


@dataclass(slots=True)
class RequestRecord:
    """What one request measured. Times in seconds; ``chunk_times_s`` since the request was sent."""

    index: int
    request_id: str
    target: str
    prompt_len: int
    requested_output_len: int
    scheduled_s: float = 0.0  # when the load generator meant to send it (since the run began)
    start_s: float = 0.0  # when it was sent (since the run began)
    success: bool = False
    failure: str | None = None
    error: str | None = None
    http_status: int | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    chunk_times_s: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    output_tokens: int = 0
    finish_reason: str | None = None
    server_request_id: str | None = None
    server_timing: dict[str, float] | None = None
    # Cancellation (``--cancel-rate``): a cancelled request is neither completed nor failed.
    cancelled: bool = False
    cancel_mode: str | None = None  # "disconnect" or "abort"
    cancel_phase: str | None = None  # "before_first_token" or "mid_stream": where it really landed
    cancel_s: float | None = None  # when it was cancelled, since it was sent
    tokens_at_cancel: int = 0
    abort_status: int | None = None  # HTTP status of the abort call (abort mode; None: no answer)
    abort_ended_s: float | None = None  # abort mode: when the answer ended after the abort, since sent

    def fail(self, kind: str, error: str) -> None:
        """Keep the first failure: later ones are consequences of it."""
        if self.failure is None:
            self.failure = kind
            self.error = error[:500]

    def to_json(self) -> dict[str, Any]:
        """The JSONL record; times in milliseconds."""
        d = asdict(self)
        for key in ("scheduled_s", "start_s", "ttft_s", "e2e_s", "cancel_s", "abort_ended_s"):
            v = d.pop(key)
            d[key[:-2] + "_ms"] = None if v is None else v * 1000.0
        d["chunk_times_ms"] = [t * 1000.0 for t in d.pop("chunk_times_s")]
        return d
