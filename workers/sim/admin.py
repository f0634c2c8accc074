"""The simulator's own endpoints: ``/sim/state``, ``/sim/faults`` and the prefill side channel
(``/sim/kv/pull``, ``/sim/kv/free``, ``/sim/kv/heartbeat``) that decode workers call."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any

from aiohttp import web

from .errors import BadRequest, InjectedFailure
from .settings import Faults
from .state import SIM, SimState, json_response, read_json

log = logging.getLogger("pd_sim")


def state_snapshot(st: SimState) -> dict[str, Any]:
    now = time.monotonic()
    return {
        "role": st.settings.role,
        "engine_id": st.engine_id,
        "generate_calls": st.generate_calls,
        "hung_before_headers": st.hung,
        "running": st.scheduler.running,
        "waiting": st.scheduler.waiting,
        "kv_blocks_used": st.pool.used,
        "kv_cache_usage_perc": st.pool.usage,
        "inflight": [
            {
                "request_id": r.external_id,
                "state": r.state,
                "prompt_tokens": r.num_prompt,
                "output_tokens": r.num_output,
                "blocks": len(r.blocks),
                "age_s": now - r.created,
            }
            for r in st.registry.all()
        ],
        "kv_held": [
            {
                "remote_request_id": lease.remote_request_id,
                "request_id": lease.request_id,
                "blocks": len(lease.blocks),
                "block_ids": lease.blocks,
                "num_tokens": lease.num_tokens,
                "age_s": now - lease.created,
                "expires_in_s": lease.expires - now,
            }
            for lease in st.leases.leases.values()
        ],
        "releases": dict(st.leases.releases),
        "faults": st.faults.to_dict(),
        "traceparents": [{"request_id": rid, "traceparent": tp} for rid, tp in st.traceparents],
    }


async def sim_state(request: web.Request) -> web.Response:
    return json_response(state_snapshot(request.app[SIM]))


async def sim_faults(request: web.Request) -> web.Response:
    st = request.app[SIM]
    if request.method == "POST":
        body = await read_json(request)
        if not isinstance(body, dict):
            raise BadRequest("faults must be a JSON object")
        exit_now = body.pop("exit", None) is not None
        if (exit_now or body.get("exit_after_requests") is not None) and not st.settings.allow_exit:
            raise BadRequest("exit is only allowed for a pd-sim process started from the command line")
        if body.pop("reset", False):
            body = {**Faults().to_dict(), **body}
        try:
            st.faults.update(body)
        except ValueError as e:
            raise BadRequest(str(e)) from None
        if exit_now:
            asyncio.get_running_loop().call_later(0.05, os._exit, 3)
    return json_response(st.faults.to_dict())


async def kv_pull(request: web.Request) -> web.Response:
    """The prefill side channel: a decode worker pulls (and thereby frees) a lease's blocks."""
    st = request.app[SIM]
    body = await read_json(request)
    rrid = body.get("remote_request_id") if isinstance(body, dict) else None
    if not isinstance(rrid, str):
        raise BadRequest("remote_request_id is required")
    if st.faults.refuse_kv_pulls:
        raise InjectedFailure(503)
    engine_id = body.get("remote_engine_id")
    if engine_id is not None and engine_id != st.engine_id:
        # NIXL's handshake checks the engine id the params name against the one it reaches
        raise BadRequest(f"remote engine id mismatch: expected {st.engine_id}, got {engine_id}")
    lease = st.leases.leases.get(rrid)
    if lease is None:
        # Like NIXL: reading blocks that were already released "works" (P logs a warning).
        log.warning("KV pull for unknown or released request %s", rrid)
        return json_response({"found": False, "blocks": 0})
    lease.pulling = True
    s = st.settings
    delay = 0.0 if s.zero_latency else s.transfer_per_block_ms * len(lease.blocks) / 1000.0
    if delay > 0:
        await st.clock.wait(delay)
    n = len(lease.blocks)
    st.leases.release(rrid, "pulled")
    return json_response({"found": True, "blocks": n})


async def kv_free(request: web.Request) -> web.Response:
    st = request.app[SIM]
    body = await read_json(request)
    rrid = body.get("remote_request_id") if isinstance(body, dict) else None
    if not isinstance(rrid, str):
        raise BadRequest("remote_request_id is required")
    return json_response({"freed": st.leases.release(rrid, "aborted")})


async def kv_heartbeat(request: web.Request) -> web.Response:
    st = request.app[SIM]
    body = await read_json(request)
    rrid = body.get("remote_request_id") if isinstance(body, dict) else None
    if not isinstance(rrid, str):
        raise BadRequest("remote_request_id is required")
    return json_response({"extended": st.leases.extend(rrid, st.settings.lease_seconds)})
