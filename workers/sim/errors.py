"""The one error tree of pd-sim, mapped once to vLLM's error JSON."""

from __future__ import annotations

from http import HTTPStatus
from typing import Any


class SimError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}``."""

    status: int = 500
    error_type: str = "InternalServerError"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.status,
            }
        }


class BadRequest(SimError):
    """The server's own checks (vLLM's ``create_error_response``): type ``BadRequestError``."""

    status = 400
    error_type = "BadRequestError"


class RequestValidation(SimError):
    """Request-body validation (FastAPI's ``RequestValidationError``): type ``Bad Request``."""

    status = 400
    error_type = "Bad Request"


class NotFound(SimError):
    status = 404
    error_type = "NotFoundError"


class Forbidden(SimError):
    status = 403
    error_type = "PermissionDeniedError"


class InternalError(SimError):
    """vLLM hides the cause of a 500 behind a fixed message."""

    status = 500
    error_type = "InternalServerError"

    def __init__(self, message: str = "Internal server error") -> None:
        super().__init__(message)


class InjectedFailure(SimError):
    """A fault-injected error with an arbitrary status."""

    def __init__(self, status: int) -> None:
        phrase = HTTPStatus(status).phrase
        message = "Internal server error" if status == 500 else phrase
        super().__init__(message)
        self.status = status
        self.error_type = phrase.replace(" ", "").replace("-", "") + (
            "" if phrase.endswith("Error") else "Error"
        )
