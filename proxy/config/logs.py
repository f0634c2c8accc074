"""One access line per request (logger ``pd_proxy.access``, INFO), text or JSON: never prompt or
output content, never keys."""

from __future__ import annotations

import json
import logging
import re
import sys
import time
from typing import IO, Any

from proxy.config.settings import LogFormat

ACCESS_LOG = logging.getLogger("pd_proxy.access")


_PLAIN = re.compile(r"[!#-~]*")
"""Printable ASCII but space and ``"``: a text value made only of these is written bare."""
_UNSAFE = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def text_value(value: object) -> str:
    """A ``key=value`` text value that cannot break the line or forge another field."""
    if value is None:
        return "-"
    text = str(value)
    if text and _PLAIN.fullmatch(text):
        return text
    return json.dumps(text)


def format_access(fields: dict[str, Any], fmt: LogFormat) -> str:
    if fmt == "json":
        return json.dumps({"ts": round(time.time(), 3), **fields}, separators=(",", ":"),
                          ensure_ascii=False)
    return " ".join(f"{k}={text_value(v)}" for k, v in fields.items())


class EscapingFormatter(logging.Formatter):
    """Escapes control characters in a message so outside text cannot forge a line."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        message = record.message
        if _UNSAFE.search(message):
            record.message = _UNSAFE.sub(lambda m: m.group().encode("unicode_escape").decode(), message)
        return super().formatMessage(record)


def log_access(fields: dict[str, Any], fmt: LogFormat) -> None:
    ACCESS_LOG.info("%s", format_access(fields, fmt))


def configure_access_log(fmt: LogFormat, stream: IO[str] | None = None) -> logging.Handler | None:
    """For ``json``: bare JSON lines to ``stream`` (stderr), not through the root handler."""
    if fmt != "json":
        return None
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    ACCESS_LOG.addHandler(handler)
    ACCESS_LOG.propagate = False
    return handler
