"""vLLM's two validation exceptions, and its wording of pydantic's errors into a 400's message
and ``param``. Imports nothing of the project."""

from __future__ import annotations

import re
from typing import Any


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
    """The 400 vLLM's ``validation_exception_handler`` sends for ``errors``; ``total``: how many
    there were when ``errors`` holds only the first."""
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
