"""Per-app state of a pd-sim worker (one typed ``web.AppKey``) and small HTTP helpers."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections import deque
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from .engine import Clock, KvPool, LeaseTable, Registry, Scheduler
from .errors import SimError
from .metrics import SimMetrics
from .protocol import parse_json_body
from .settings import Faults, SimSettings
from .tokenizer import ByteTokenizer

TRACEPARENTS_KEPT = 256
DUMPS = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


@dataclass
class SimState:
    settings: SimSettings
    engine_id: str
    metrics: SimMetrics
    pool: KvPool
    leases: LeaseTable
    scheduler: Scheduler
    tokenizer: ByteTokenizer | None = None
    registry: Registry = field(default_factory=Registry)
    session: aiohttp.ClientSession | None = None
    background: set[asyncio.Task[Any]] = field(default_factory=set)
    generate_calls: int = 0
    hung: int = 0  # requests held by the hang_before_headers fault
    clock: Clock = field(default_factory=Clock)  # the latency model's time (tests inject one)
    traceparents: deque[tuple[str, str]] = field(default_factory=lambda: deque(maxlen=TRACEPARENTS_KEPT))
    """(request id, W3C ``traceparent``) of the latest generate calls that carried one."""

    @property
    def faults(self) -> Faults:
        return self.settings.faults

    def client_session(self) -> aiohttp.ClientSession:
        if self.session is None or self.session.closed:
            self.session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.settings.pull_timeout_s)
            )
        return self.session

    def spawn(self, coro: Awaitable[Any]) -> None:
        task: asyncio.Task[Any] = asyncio.ensure_future(coro)
        self.background.add(task)
        task.add_done_callback(self.background.discard)


SIM = web.AppKey("pd_sim_state", SimState)


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(
        body=DUMPS(body).encode(), status=status, content_type="application/json", headers=headers
    )


def error_response(err: SimError, headers: dict[str, str] | None = None) -> web.Response:
    return json_response(err.body(), err.status, headers)


def request_id_header(request: web.Request) -> dict[str, str] | None:
    if not request.app[SIM].settings.enable_request_id_headers:
        return None
    return {"x-request-id": request.headers.get("X-Request-Id") or uuid.uuid4().hex}


def side_channel_url(remote: dict[str, Any], what: str) -> str | None:
    host = remote.get("remote_host")
    port = remote.get("remote_port")
    if not isinstance(host, str) or not host or not isinstance(port, int) or isinstance(port, bool):
        return None
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{port}/sim/kv/{what}"


async def read_json(request: web.Request) -> Any:
    raw = await request.read()
    return parse_json_body(raw)
