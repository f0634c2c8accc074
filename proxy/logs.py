"""One access line per request (logger ``pd_proxy.access``, INFO), text or JSON.

Only ids, worker URLs, timings, outcome and status go in: never prompt or output content,
never keys. Callers check ``ACCESS_LOG.isEnabledFor(INFO)`` first, so a disabled log costs
nothing on the hot path.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import IO, Any

from proxy.settings import LogFormat

ACCESS_LOG = logging.getLogger("pd_proxy.access")


def format_access(fields: dict[str, Any], fmt: LogFormat) -> str:
    if fmt == "json":
        return json.dumps({"ts": round(time.time(), 3), **fields}, separators=(",", ":"),
                          ensure_ascii=False)
    return " ".join(f"{k}={'-' if v is None else v}" for k, v in fields.items())


def log_access(fields: dict[str, Any], fmt: LogFormat) -> None:
    ACCESS_LOG.info("%s", format_access(fields, fmt))


def configure_access_log(fmt: LogFormat, stream: IO[str] | None = None) -> logging.Handler | None:
    """For ``json``: the access logger writes bare JSON lines (no level/time prefix) to
    ``stream`` (stderr) instead of going through the root handler. Returns the handler."""
    if fmt != "json":
        return None
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    ACCESS_LOG.addHandler(handler)
    ACCESS_LOG.propagate = False
    return handler
