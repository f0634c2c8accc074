"""The fault matrix: every fault pd-sim can inject x the request's state x what the client does.

Each cell names the client's expected outcome, then checks the world's invariants
(``tests.reliability.harness.World.wait_clean``: nothing held on any worker, nothing in flight in
the proxy, no upstream connection checked out, no stray task) and, after shutdown, that no task
is left at all. KV that the proxy cannot free (the prefill worker gave no params, or no decode
worker can pull them) may only end by the prefill worker's lease expiring: cells say so, and
every other cell asserts that no lease expired.

Outcomes: ``"<status>"`` for an error status, ``"200:<finish_reason>"`` for a JSON reply,
``"sse:<finish_reason>"`` / ``"sse:error:<code>"`` for the last event of a stream before
``[DONE]``, ``"gone"`` when the client left before any outcome.

Act points (when the client disconnects or aborts): ``now`` (right after sending),
``prefill`` (the prefill worker has the request), ``kv_held`` (the proxy holds KV between the
hops), ``decode`` (the decode worker has the request), ``first_event`` (the client read the
stream's first event), ``after`` (the client got its whole answer; an abort then names an id
the proxy no longer knows).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

import aiohttp
import pytest

from proxy.pools import PoolSettings
from tests.reliability.harness import GENERATE, World, sse_events, start_world

pytestmark = pytest.mark.timeout(60)

Act = Literal["now", "prefill", "kv_held", "decode", "first_event", "after"]
Behaviour = Literal["read", "disconnect", "abort", "abort_twice"]
BEHAVIOURS: tuple[Behaviour, ...] = ("read", "disconnect", "abort", "abort_twice")

# 32 tokens at 20 ms: a 0.64 s stream, so that the "first_event" act point (the client acts
# mid-stream) is reached on a loaded machine before the stream ends (10 ms flaked once).
SLOW_DECODE: dict[str, Any] = {"zero_latency": False, "itl_ms": 20.0, "prefill_base_ms": 0.0,
                               "prefill_per_token_ms": 0.0, "transfer_per_block_ms": 0.0,
                               "remote_prefill_step_ms": 0.0}
SLOW_PREFILL: dict[str, Any] = {"zero_latency": False, "prefill_base_ms": 400.0, "prefill_per_token_ms": 0.0,
                                "itl_ms": 0.0, "transfer_per_block_ms": 0.0}
PROMPT = [3 + (7 * i) % 500 for i in range(48)]  # three KV blocks of pd-sim: never bypasses prefill
MAX_TOKENS = 32
SHORT_LEASE = 0.6
PERSISTENT = 1_000_000  # fail_next: every call fails, retries included


@dataclass(frozen=True)
class Fault:
    name: str
    stream: bool
    outcome: str
    """What a client that reads normally gets."""
    act: Act
    prefill: dict[str, Any] = field(default_factory=dict)
    decode: dict[str, Any] = field(default_factory=lambda: dict(SLOW_DECODE))
    settings: dict[str, Any] = field(default_factory=dict)
    down: Literal["prefill", "decode"] | None = None
    expired_ok: bool = False
    """The proxy cannot free this KV (no params, or no decode worker can pull): the prefill
    worker's lease ends it."""
    aborted: str | None = None
    """What an aborting client gets, when it acts mid-flight (default: vLLM's abort outcome)."""
    hole: str | None = None
    """A known hole: aborting cells are expected to fail (strict xfail) until it is closed."""
    pair: bool = False
    """Two workers per pool (round robin, the faulty one first): the pools retry, migrate."""

    @property
    def abort_act(self) -> Act:
        """A fault that ends the request at once leaves no moment to abort in: the client
        aborts after its answer (an id the proxy has forgotten), and disconnects at once."""
        return "after" if self.act == "now" else self.act

    @property
    def id(self) -> str:
        return f"{self.name}{'-x2' if self.pair else ''}-{'stream' if self.stream else 'full'}"

    def expect(self, behaviour: Behaviour) -> str:
        if behaviour == "read":
            return self.outcome
        if behaviour == "disconnect":
            return "gone"
        if self.abort_act == "after":
            return self.outcome
        if self.aborted is not None:
            return self.aborted
        return "sse:abort" if self.stream else "200:abort"


def both(name: str, outcome_full: str, outcome_stream: str, act_full: Act, act_stream: Act,
         **kw: Any) -> list[Fault]:
    """The same fault for a non-stream and a stream request (tuples: per mode)."""
    def split(key: str) -> tuple[Any, Any]:
        value = kw.pop(key, None)
        return value if isinstance(value, tuple) else (value, value)

    ab_full, ab_stream = split("aborted")
    hole_full, hole_stream = split("hole")
    return [Fault(name, False, outcome_full, act_full, aborted=ab_full, hole=hole_full, **kw),
            Fault(name, True, outcome_stream, act_stream, aborted=ab_stream, hole=hole_stream, **kw)]


FAULTS: list[Fault] = [
    # --- no fault, the client acts in each state of the walk
    *both("none@prefilling", "200:length", "sse:length", "prefill", "prefill", prefill=SLOW_PREFILL),
    *both("none@kv_held", "200:length", "sse:length", "kv_held", "kv_held",
          settings={"hold_between_hops": 0.5}),
    *both("none@decoding", "200:length", "sse:length", "decode", "first_event"),
    # --- prefill worker faults
    *both("prefill_down", "502", "502", "now", "now", down="prefill"),
    *both("prefill_5xx", "502", "502", "now", "now",
          prefill={"faults": {"fail_next": PERSISTENT, "fail_status": 503}}),
    *both("prefill_400", "400", "400", "now", "now",
          prefill={"faults": {"fail_next": PERSISTENT, "fail_status": 400}}),
    *both("prefill_hang_before_headers", "504", "504", "prefill", "prefill",
          prefill={"faults": {"hang_before_headers": True}}, settings={"prefill_timeout": 0.5}),
    *both("prefill_hang_after_headers", "504", "504", "prefill", "prefill",
          prefill={"faults": {"hang_after_headers": True}}, settings={"prefill_timeout": 0.5}),
    # No other prefill worker to try: the decode worker computes the prompt (it was a 502).
    *both("prefill_no_kv_params", "200:length", "sse:length", "now", "now",
          prefill={"faults": {"drop_kv_params": True}, "lease_seconds": SHORT_LEASE}, expired_ok=True),
    # --- decode worker faults. A stream has the prefill worker's token before the decode hop
    # (first_token_from_prefill, on by default): its headers are out, so a decode failure ends
    # in-band; with the setting off it is the status a non-stream request gets.
    *both("decode_down", "502", "sse:error:502", "now", "now", down="decode",
          prefill={"lease_seconds": SHORT_LEASE}, expired_ok=True),
    *both("decode_5xx", "502", "sse:error:502", "now", "now",
          decode={**SLOW_DECODE, "faults": {"fail_next": PERSISTENT, "fail_status": 503}},
          prefill={"lease_seconds": SHORT_LEASE}, expired_ok=True),
    *both("decode_hang_before_headers", "504", "sse:error:504", "decode", "decode",
          decode={**SLOW_DECODE, "faults": {"hang_before_headers": True}},
          prefill={"lease_seconds": SHORT_LEASE}, expired_ok=True,
          settings={"decode_timeout": 0.5, "stream_idle_timeout": 0.5}),
    Fault("decode_down@first_token_off", True, "502", "now", down="decode",
          prefill={"lease_seconds": SHORT_LEASE}, expired_ok=True,
          settings={"first_token_from_prefill": False}),
    Fault("decode_5xx@first_token_off", True, "502", "now",
          decode={**SLOW_DECODE, "faults": {"fail_next": PERSISTENT, "fail_status": 503}},
          prefill={"lease_seconds": SHORT_LEASE}, expired_ok=True,
          settings={"first_token_from_prefill": False}),
    Fault("decode_hang_before_headers@first_token_off", True, "504", "decode",
          decode={**SLOW_DECODE, "faults": {"hang_before_headers": True}},
          prefill={"lease_seconds": SHORT_LEASE}, expired_ok=True,
          settings={"decode_timeout": 0.5, "stream_idle_timeout": 0.5, "first_token_from_prefill": False}),
    *both("decode_hang_after_headers", "504", "sse:error:504", "decode", "decode",
          decode={**SLOW_DECODE, "faults": {"hang_after_headers": True}},
          prefill={"lease_seconds": SHORT_LEASE}, expired_ok=True,
          settings={"decode_timeout": 1.0, "stream_idle_timeout": 0.5}),
    Fault("decode_reset_mid_stream", True, "sse:error:502", "first_event",
          decode={**SLOW_DECODE, "faults": {"reset_after_tokens": 20}}),
    Fault("decode_inband_error", True, "sse:error:500", "first_event",
          decode={**SLOW_DECODE, "faults": {"error_after_tokens": 20}}),
    *both("decode_slow_chunks", "200:length", "sse:length", "decode", "first_event",
          decode={**SLOW_DECODE, "faults": {"chunk_delay_ms": 10.0}}),
    # The KV cannot be pulled: the same KV again (the one decode worker), then decode-only.
    *both("decode_refused_kv_pull", "200:length", "sse:length", "now", "now",
          prefill={"faults": {"refuse_kv_pulls": True}, "lease_seconds": SHORT_LEASE}, expired_ok=True),
]


# Two workers per pool: the fault is on the first of each pool, picked first (round robin); the
# pools' retries and migration turn it into a normal outcome (with one worker per pool the same
# faults fail the request, above).
PAIR = {"pair": True}
FAULTS += [
    *both("prefill_5xx", "200:length", "sse:length", "now", "now", **PAIR,
          prefill={"faults": {"fail_next": PERSISTENT, "fail_status": 503}}),
    *both("prefill_down", "200:length", "sse:length", "now", "now", down="prefill", **PAIR),
    *both("prefill_hang_before_headers", "200:length", "sse:length", "now", "now", **PAIR,
          prefill={"faults": {"hang_before_headers": True}}, settings={"prefill_timeout": 0.5}),
    # The prefill retry takes an unusable 200 to the other prefill worker (it was a 502).
    *both("prefill_no_kv_params", "200:length", "sse:length", "now", "now", **PAIR,
          prefill={"faults": {"drop_kv_params": True}, "lease_seconds": SHORT_LEASE}, expired_ok=True),
    *both("decode_5xx", "200:length", "sse:length", "now", "now", **PAIR,
          decode={**SLOW_DECODE, "faults": {"fail_next": PERSISTENT, "fail_status": 503}}),
    *both("decode_down", "200:length", "sse:length", "now", "now", down="decode", **PAIR),
    Fault("decode_reset_mid_stream", True, "sse:length", "first_event", pair=True,
          decode={**SLOW_DECODE, "faults": {"reset_after_tokens": 20}}),
    Fault("decode_inband_error", True, "sse:length", "first_event", pair=True,
          decode={**SLOW_DECODE, "faults": {"error_after_tokens": 20}}),
]


def outcome_of(status: int, raw: bytes, stream: bool) -> str:
    if status != 200:
        return str(status)
    if not stream:
        return f"200:{json.loads(raw)['choices'][0]['finish_reason']}"
    events = sse_events(raw)
    if not events or events[-1] != "[DONE]":
        return "sse:truncated"
    last = events[-2] if len(events) > 1 else {}
    if "error" in last:
        return f"sse:error:{last['error']['code']}"
    choices = [e for e in events[:-1] if isinstance(e, dict) and e.get("choices")]
    return f"sse:{choices[-1]['choices'][0]['finish_reason']}" if choices else "sse:empty"


class Client:
    """One client request, read in the background; ``first_event`` is set on its first data event."""

    def __init__(self, w: World, body: dict[str, Any], rid: str) -> None:
        self.w = w
        self.body = body
        self.rid = rid
        self.first_event = asyncio.Event()
        self.resp: aiohttp.ClientResponse | None = None
        self.task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> tuple[int, bytes]:
        headers = {"X-Request-Id": self.rid}
        async with self.w.session.post(self.w.url + GENERATE, json=self.body, headers=headers) as r:
            self.resp = r
            raw = b""
            while True:
                chunk = await r.content.readany()
                if not chunk:
                    return r.status, raw
                raw += chunk
                if b"data: " in raw:
                    self.first_event.set()

    async def disconnect(self) -> None:
        self.task.cancel()
        if self.resp is not None:
            self.resp.close()
        await asyncio.gather(self.task, return_exceptions=True)


async def until(cond: Any, client: Client, limit: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit
    while not client.task.done():
        if await cond():
            return
        if loop.time() > deadline:
            raise AssertionError("the act point was never reached")
        await asyncio.sleep(0.005)


async def reach(act: Act, w: World, client: Client) -> None:
    serving = w.serving

    async def phase(name: str) -> bool:
        return any(r.phase.value == name for r in serving.table.all())

    async def prefill_has_it() -> bool:
        st = await w.p.state()
        return bool(st["inflight"] or st["hung_before_headers"])

    async def decode_has_it() -> bool:
        st = await w.d.state()
        return bool(st["generate_calls"]) and await phase("decoding")

    async def first_event() -> bool:
        return client.first_event.is_set()

    if act == "now":
        return
    if act == "after":
        await asyncio.gather(client.task, return_exceptions=True)
        return
    cond = {"prefill": prefill_has_it, "decode": decode_has_it, "first_event": first_event,
            "kv_held": lambda: phase("kv_held")}[act]
    await until(cond, client)
    assert not client.task.done(), f"the request finished before reaching {act}"


async def run_cell(fault: Fault, behaviour: Behaviour) -> tuple[str, World]:
    prefill, decode = [{**fault.prefill}], [{**fault.decode}]
    settings = dict(fault.settings)
    if fault.pair:
        prefill.append({k: v for k, v in fault.prefill.items() if k != "faults"})
        decode.append({k: v for k, v in fault.decode.items() if k != "faults"})
        settings["pools"] = PoolSettings(prefill_policy="round_robin", decode_policy="round_robin")
    w = await start_world(prefill=prefill, decode=decode, **settings)
    if fault.down == "prefill":
        await w.p.close()
        del w.prefill[0]
    try:
        if fault.down == "decode":
            await w.d.close()
            del w.decode[0]
        rid = uuid.uuid4().hex
        body = {"token_ids": PROMPT, "stream": fault.stream,
                "sampling_params": {"temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True}}
        client = Client(w, body, rid)
        if behaviour == "disconnect":
            await reach(fault.act, w, client)
        elif behaviour != "read":
            await reach(fault.abort_act, w, client)
        if behaviour == "disconnect":
            await client.disconnect()
            return "gone", w
        if behaviour in ("abort", "abort_twice"):
            assert await w.abort(f"generate-tokens-{rid}") == 200
            if behaviour == "abort_twice":
                assert await w.abort(f"generate-tokens-{rid}") == 200
        status, raw = await asyncio.wait_for(client.task, 10)
        return outcome_of(status, raw, fault.stream), w
    except BaseException:
        await w.close()
        raise


def _marks(f: Fault, b: Behaviour) -> list[pytest.MarkDecorator]:
    return [pytest.mark.xfail(strict=True, reason=f.hole)] if f.hole and b.startswith("abort") else []


CELLS = [pytest.param(f, b, id=f"{f.id}-{b}", marks=_marks(f, b)) for f in FAULTS for b in BEHAVIOURS]


@pytest.mark.parametrize(("fault", "behaviour"), CELLS)
async def test_fault_cell(fault: Fault, behaviour: Behaviour) -> None:
    outcome, w = await run_cell(fault, behaviour)
    try:
        assert outcome == fault.expect(behaviour)
        if fault.pair and behaviour == "read" and not fault.down:
            faulty = w.p if "faults" in fault.prefill else w.d
            assert (await faulty.state())["generate_calls"] >= 1, "the faulty worker was never tried"
        await w.wait_clean(limit=SHORT_LEASE + 3.0)
        if not fault.expired_ok and w.prefill:
            assert (await w.releases()).get("expired", 0) == 0, "KV was left to expire"
    finally:
        await w.close()
    await w.assert_no_tasks_after_close()
