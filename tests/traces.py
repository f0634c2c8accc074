"""Reader for the vLLM wire traces in ``tests/data/traces/vllm-0.32.0-cpu/`` (format in its README).

They are the project's recorded exchanges with a real vLLM 0.32.0 (CPU build), byte for byte, and the
referee for pd-sim and the proxy (``docs/vllm.md`` states what they show); ``PD_TRACE_DIR`` points
elsewhere.

``load_trace(path) -> Trace``; ``trace_files()`` lists every case. Import read-only from any test.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.sse import events

TRACE_DIR = Path(
    os.environ.get("PD_TRACE_DIR", Path(__file__).resolve().parent / "data" / "traces" / "vllm-0.32.0-cpu")
)

_BLOCK_RE = re.compile(r"(>>> REQUEST|<<< RESPONSE) (\S+) body_bytes=(\d+)(?: http_chunks=(\d+))?(.*)$")


@dataclass
class Block:
    kind: str  # "request" | "response"
    label: str
    start_line: str
    headers: list[tuple[str, str]]
    body: bytes
    http_chunks: int | None = None
    note: str = ""

    def header(self, name: str) -> str | None:
        lname = name.lower()
        for k, v in self.headers:
            if k.lower() == lname:
                return v
        return None

    @property
    def method(self) -> str:
        return self.start_line.split(" ", 1)[0]

    @property
    def path(self) -> str:
        return self.start_line.split(" ")[1]

    @property
    def status(self) -> int:
        return int(self.start_line.split(" ")[1])

    def json(self) -> Any:
        return json.loads(self.body)

    def sse_events(self) -> list[str]:
        """The ``data:`` payloads of an SSE body, in order (``[DONE]`` included)."""
        return [e.decode() for e in events(self.body)]

    @property
    def closed_early(self) -> bool:
        return "client closed the connection" in self.note


@dataclass
class Trace:
    name: str
    server: str
    comments: list[str] = field(default_factory=list)
    blocks: list[Block] = field(default_factory=list)

    def requests(self) -> list[Block]:
        return [b for b in self.blocks if b.kind == "request"]

    def response(self, label: str) -> Block:
        return next(b for b in self.blocks if b.kind == "response" and b.label == label)

    def request(self, label: str) -> Block:
        return next(b for b in self.blocks if b.kind == "request" and b.label == label)


def parse_trace(data: bytes, name: str = "") -> Trace:
    trace = Trace(name=name, server="")
    i = 0
    while True:
        j = data.index(b"\n", i)
        line = data[i:j].decode()
        i = j + 1
        if line.startswith("# "):
            trace.comments.append(line[2:])
            if line.startswith("# server: "):
                trace.server = line[len("# server: ") :].split(" ", 1)[0]
            continue
        if line == "<<< END":
            return trace
        m = _BLOCK_RE.match(line)
        if m is None:
            raise ValueError(f"{name}: unexpected line {line!r}")
        head: list[str] = []
        while True:
            j = data.index(b"\n", i)
            h = data[i:j].decode("latin-1")
            i = j + 1
            if h == "":
                break
            head.append(h)
        n = int(m.group(3))
        body = data[i : i + n]
        i += n + 1
        headers = [(k, v) for k, _, v in (x.partition(": ") for x in head[1:])]
        trace.blocks.append(
            Block(
                kind="request" if m.group(1).startswith(">") else "response",
                label=m.group(2),
                start_line=head[0],
                headers=headers,
                body=body,
                http_chunks=int(m.group(4)) if m.group(4) else None,
                note=m.group(5).strip(),
            )
        )


def load_trace(path: Path) -> Trace:
    return parse_trace(path.read_bytes(), path.stem)


def trace_files() -> list[Path]:
    return sorted(p for p in TRACE_DIR.glob("*.txt"))
