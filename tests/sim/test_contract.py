"""Contract test: replay every request of the real vLLM 0.32 traces against pd-sim and compare the
responses' structure field by field.

Each trace is replayed against fresh pd-sim workers configured like the trace's server (scaleout,
tokonly, apikey, reqidhdr, or the prefill+decode pair). Requests are sent byte for byte with a raw
HTTP/1.1 client (only ``Host``, ``Content-Length`` and, for decode hops, ``kv_transfer_params`` --
which must name OUR prefill worker -- are rewritten).

Compared: status; content-type; chunked vs content-length; x-request-id presence; JSON key names
and order at every level; value types and nulls; exact values of everything that does not depend
on the model's weights (errors: message/type/param/code; model, output_mode, request ids, finish
reasons, usage prompt counts, kv_transfer_params fixed fields, ...); SSE framing (``data:`` lines,
``[DONE]``, one event per HTTP chunk, number of events where deterministic).

Documented exclusions (compared by type only, or not at all), and why:
- Token-dependent values: token ids, text, logprob numbers/ranks/tokens/bytes, decoded tokens,
  ``created``, and ``prompt_logprobs`` entry keys (token ids): pd-sim's model is not tiny-llama.
- KV hand-off values that are per-instance: remote_engine_id, remote_request_id suffix, host/port,
  block ids (pd-sim uses 16-token blocks; the CPU build used 128) and the prefix-cache hit count
  (the traces' P had served the same prompt before; each replay starts with fresh workers).
- ``MODEL_DEPENDENT`` traces: where the real run stopped depends on its tokens (stop strings, stop
  token ids) or on when an abort/disconnect landed, so finish_reason/stop_reason/completion counts,
  list lengths and the number of SSE events may differ (still type-checked, nulls allowed).
- n>1 streams: vLLM interleaves the two choices in engine order, so ``index`` is type-checked.
- ``metrics-*.txt``: metric values change from run to run; only the content type and the presence
  of every family of docs/vllm.md, section 4, are compared.
- The ``server``/``date``/``vary`` headers (uvicorn's) are not part of the contract.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
from dataclasses import dataclass
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests import sse
from tests.fixtures_sim import SimFactory, SimWorker
from tests.sim.rawhttp import RawConnection, RawResponse
from tests.traces import Block, Trace, load_trace, trace_files
from workers.sim import SimSettings

TRACES = trace_files()

SERVER_SETTINGS: dict[str, dict[str, Any]] = {
    "scaleout": {"enable_scale_out": True},
    "tokonly": {"enable_scale_out": False, "tokens_only": True},
    "apikey": {"enable_scale_out": False, "tokens_only": True, "api_key": "test-key-123"},
    "reqidhdr": {"enable_scale_out": True, "enable_request_id_headers": True},
}
# Trace ports of the P/D pair (see the traces' README).
PD_PORTS = {"8110": "prefill", "8210": "decode"}

# Values that depend on the model's weights or on the instance: compared by type only.
TYPE_ONLY_KEYS = frozenset(
    {
        "created",
        "token_ids",
        "text",
        "logprob",
        "rank",
        "token",
        "token_id",
        "bytes",
        "decoded_token",
        "remote_engine_id",
        "remote_request_id",
        "remote_host",
        "remote_port",
        "remote_block_ids",
        "remote_prefill_cached_tokens",
        "prompt_token_ids",
    }
)
# Where the real run's stopping point came from its tokens or from timing.
MODEL_DEPENDENT = frozenset(
    {
        "gen-tokens-stop-string",
        "gen-text-stop-nonstream",
        "gen-text-stop-stream",
        "gen-text-stop-include-nonstream",
        "gen-text-stop-include-stream",
        "tokonly-gen-stop-token-ids",
        "abort-inference-during-stream",
        "abort-inference-during-nonstream",
        "abort-request-ids-string-during-stream",
        "tokonly-abort-legacy-during-stream",
        "tokonly-abort-inference-during-stream",
        "apikey-abort-legacy-no-key-during-stream",
        "pd-decode-abort-during-stream",
        "disconnect-mid-stream",
    }
)
STOP_DEPENDENT_KEYS = frozenset({"finish_reason", "stop_reason", "completion_tokens", "total_tokens", "end"})
METRIC_FAMILIES = (
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds",
    "vllm:nixl_xfer_time_seconds",
    "vllm:nixl_bytes_transferred",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:request_success",
    "vllm:prompt_tokens",
    "vllm:generation_tokens",
    "vllm:nixl_num_failed_transfers",
    "vllm:nixl_num_kv_expired_reqs",
    "vllm:cache_config_info",
)
# Series vLLM labels by engine only (no model_name): the cache config, whose block_size pd-proxy reads.
ENGINE_ONLY = ("vllm:cache_config_info{",)


@dataclass
class Ctx:
    trace: Trace
    relaxed: bool
    n_gt_1: bool = False
    random_id: bool = False


def _type_name(v: Any) -> str:
    return "null" if v is None else type(v).__name__


def compare_json(exp: Any, act: Any, ctx: Ctx, path: str = "$", key: str = "") -> list[str]:
    """Differences between the trace's JSON ``exp`` and pd-sim's ``act`` (empty when they agree)."""
    errs: list[str] = []
    type_only = key in TYPE_ONLY_KEYS or (ctx.relaxed and key in STOP_DEPENDENT_KEYS)
    if key == "index" and ctx.n_gt_1:
        type_only = True
    if key == "request_id" and ctx.random_id:
        type_only = True
    if ctx.relaxed and key in STOP_DEPENDENT_KEYS and (exp is None or act is None):
        return errs  # e.g. stop_reason "lazy" in the trace, null when pd-sim ran to max_tokens
    if type(exp) is not type(act):
        return [f"{path}: type {_type_name(exp)} != {_type_name(act)}"]
    if isinstance(exp, dict):
        assert isinstance(act, dict)
        if key == "prompt_logprobs_entry":
            if not all(re.fullmatch(r"\d+", k) for k in act):
                errs.append(f"{path}: keys must be token ids, got {list(act)}")
            ref = next(iter(exp.values()))
            for k, v in act.items():
                errs += compare_json(ref, v, ctx, f"{path}.{k}", "prompt_logprob_value")
            return errs
        if list(exp) != list(act):
            return [f"{path}: keys {list(exp)} != {list(act)}"]
        for k in exp:
            errs += compare_json(exp[k], act[k], ctx, f"{path}.{k}", k)
        return errs
    if isinstance(exp, list):
        assert isinstance(act, list)
        variable_len = type_only or ctx.relaxed or key in ("prompt_logprobs",)
        if not variable_len and len(exp) != len(act):
            return [f"{path}: length {len(exp)} != {len(act)}"]
        child_key = "prompt_logprobs_entry" if key == "prompt_logprobs" else key
        for i, (e, a) in enumerate(zip(exp, act, strict=False)):
            if child_key == "prompt_logprobs_entry" and (e is None or a is None):
                if (e is None) != (a is None):
                    errs.append(f"{path}[{i}]: null mismatch")
                continue
            errs += compare_json(e, a, ctx, f"{path}[{i}]", child_key if isinstance(e, dict) else key)
        return errs
    if not type_only and key != "prompt_logprob_value" and exp != act:
        return [f"{path}: {exp!r} != {act!r}"]
    return errs


def _noted_last_finish_reason(trace: Trace) -> str | None:
    for c in trace.comments:
        m = re.search(r"last data event finish_reason=(\w+)", c)
        if m:
            return m.group(1)
    if trace.name == "pd-decode-abort-during-stream":
        return "abort"
    return None


def _choice_index(event: str) -> int:
    if event == "[DONE]":
        return 1 << 30
    choices = json.loads(event).get("choices") or []
    return int(choices[0]["index"]) if choices else (1 << 29)


def sse_events(body: bytes) -> list[str]:
    return [e.decode() for e in sse.events(body)]


def compare_response(exp: Block, act: RawResponse, ctx: Ctx) -> list[str]:
    errs: list[str] = []
    if exp.status != act.status:
        return [f"status {exp.status} != {act.status}: {act.body[:300]!r}"]
    exp_ct, act_ct = exp.header("content-type"), act.header("content-type")
    if exp_ct != act_ct:
        errs.append(f"content-type {exp_ct!r} != {act_ct!r}")
    exp_chunked = (exp.header("transfer-encoding") or "") == "chunked"
    if exp_chunked != act.chunked:
        errs.append(f"chunked {exp_chunked} != {act.chunked}")
    if (exp.header("x-request-id") is None) != (act.header("x-request-id") is None):
        errs.append(f"x-request-id {exp.header('x-request-id')!r} vs {act.header('x-request-id')!r}")
    elif (
        exp.header("x-request-id") is not None and ctx.trace.requests()[0].header("X-Request-Id") is not None
    ) and exp.header("x-request-id") != act.header("x-request-id"):
        errs.append("x-request-id value differs")
    if exp_ct and exp_ct.startswith("text/event-stream"):
        errs += compare_sse(exp, act, ctx)
    elif exp_ct == "application/json":
        errs += compare_json(exp.json(), json.loads(act.body), ctx)
    elif exp.body != act.body:
        errs.append(f"body {exp.body[:100]!r} != {act.body[:100]!r}")
    return errs


def compare_sse(exp: Block, act: RawResponse, ctx: Ctx) -> list[str]:
    errs: list[str] = []
    e_ev, a_ev = sse_events(exp.body), sse_events(act.body)
    # one SSE event per HTTP chunk, as vLLM sends them
    if any(c.count(b"\n\n") != 1 or not c.startswith(b"data: ") for c in act.chunks):
        errs.append("an HTTP chunk does not hold exactly one SSE event")
    if exp.closed_early:
        pairs = list(zip(e_ev, a_ev, strict=False))
    else:
        if e_ev[-1] != "[DONE]" or a_ev[-1] != "[DONE]":
            errs.append(f"last event {e_ev[-1]!r} / {a_ev[-1]!r}")
        if not ctx.relaxed and len(e_ev) != len(a_ev):
            errs.append(f"{len(e_ev)} events != {len(a_ev)}")
        if not ctx.relaxed and exp.http_chunks is not None and exp.http_chunks != len(act.chunks):
            errs.append(f"{exp.http_chunks} http chunks != {len(act.chunks)}")
        if ctx.n_gt_1:
            # choices interleave in engine order: compare each choice's own sequence of events
            e_ev = sorted(e_ev, key=_choice_index)
            a_ev = sorted(a_ev, key=_choice_index)
        if ctx.relaxed:
            # first event, and the tail (final chunk, usage chunk, [DONE]) aligned from the end
            tail = min(3, len(e_ev), len(a_ev))
            pairs = [(e_ev[0], a_ev[0]), *zip(e_ev[-tail:], a_ev[-tail:], strict=True)]
        else:
            pairs = list(zip(e_ev, a_ev, strict=True))
    expected_last = _noted_last_finish_reason(ctx.trace)
    if expected_last is not None and act.chunked and exp.label in ("stream", "decode"):
        data = [json.loads(a) for a in a_ev if a != "[DONE]"]
        last = [d for d in data if d.get("choices")][-1]["choices"][0]
        if last["finish_reason"] != expected_last:
            errs.append(f"last data event finish_reason {last['finish_reason']!r} != {expected_last!r}")
        if expected_last == "abort" and last["token_ids"] != []:
            errs.append("the abort chunk must carry no tokens")
    for i, (e, a) in enumerate(pairs):
        if e == "[DONE]" or a == "[DONE]":
            if e != a:
                errs.append(f"event {i}: {e[:60]!r} != {a[:60]!r}")
            continue
        errs += compare_json(json.loads(e), json.loads(a), ctx, f"event[{i}]")
    return errs


# ---------------------------------------------------------------------------------------------


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _events_before_abort(trace: Trace) -> int:
    for c in trace.comments:
        m = re.search(r"SSE event #(\d+)", c) or re.search(
            r"after the decode stream's (\d+)\w\w SSE event", c
        )
        if m:
            return int(m.group(1))
        m = re.search(r"after (\d+) SSE events", c)
        if m:
            return int(m.group(1))
    return 3


def _abort_takes_effect(trace: Trace) -> bool:
    return trace.name in MODEL_DEPENDENT and any(w in trace.name for w in ("abort", "disconnect"))


async def _workers(trace: Trace, sim_factory: SimFactory) -> dict[str, SimWorker]:
    timing: dict[str, Any] = (
        {"itl_ms": 40.0, "prefill_base_ms": 0.0, "prefill_per_token_ms": 0.0}
        if _abort_takes_effect(trace)
        else {"zero_latency": True}
    )
    if trace.server in ("prefill", "decode"):
        p = await sim_factory(role="prefill", zero_latency=True)
        d = await sim_factory(role="decode", **timing)
        return {"prefill": p, "decode": d}
    w = await sim_factory(**SERVER_SETTINGS[trace.server], **timing)
    return {"main": w}


def _target(block: Block, workers: dict[str, SimWorker]) -> SimWorker:
    if "main" in workers:
        return workers["main"]
    port = (block.header("Host") or "").rsplit(":", 1)[-1]
    return workers[PD_PORTS[port]]


def _request_bytes(block: Block, last_kv: dict[str, Any] | None) -> bytes:
    body = block.body
    if block.path == "/inference/v1/generate" and b'"do_remote_prefill":true' in body:
        data = json.loads(body)
        kv = data.get("kv_transfer_params") or {}
        if kv.get("remote_port") == 5999 or last_kv is None:  # the unreachable-prefill case
            kv = {**kv, "remote_host": "127.0.0.1", "remote_port": _closed_port()}
        else:
            kv = last_kv
        data["kv_transfer_params"] = kv
        body = json.dumps(data, separators=(",", ":")).encode()
    return body


async def _send(block: Block, worker: SimWorker, last_kv: dict[str, Any] | None) -> RawConnection:
    body = _request_bytes(block, last_kv)
    headers = []
    for k, v in block.headers:
        value = v
        if k.lower() == "host":
            value = f"127.0.0.1:{worker.port}"
        elif k.lower() == "content-length":
            value = str(len(body))
        headers.append((k, value))
    conn = await RawConnection.open("127.0.0.1", worker.port)
    await conn.send(block.method, block.path, headers, body)
    return conn


async def replay(trace: Trace, sim_factory: SimFactory) -> list[str]:
    workers = await _workers(trace, sim_factory)
    blocks = trace.blocks
    relaxed = trace.name in MODEL_DEPENDENT
    conns: dict[str, RawConnection] = {}
    responses: dict[str, RawResponse] = {}
    last_kv: dict[str, Any] | None = None
    errs: list[str] = []
    try:
        for i, blk in enumerate(blocks):
            if blk.kind == "request":
                nxt = blocks[i + 1] if i + 1 < len(blocks) else None
                worker = _target(blk, workers)
                conns[blk.label] = await _send(blk, worker, last_kv)
                if nxt is not None and nxt.kind == "request":
                    # another request goes out while this one runs: wait until it is under way
                    if _is_stream(blk):
                        resp = await conns[blk.label].response()
                        responses[blk.label] = resp
                        await resp.read_events(_events_before_abort(trace))
                    else:
                        await _wait_inflight(worker)
                continue
            resp = responses.get(blk.label) or await conns[blk.label].response()
            if blk.closed_early:
                await resp.read_events(_events_before_abort(trace))
                await conns[blk.label].close()
            else:
                await resp.read_all()
            sp = _sampling_params(trace, blk.label)
            ctx = Ctx(
                trace=trace,
                relaxed=relaxed,
                n_gt_1=bool(sp and sp.get("n", 1) > 1),
                random_id=_random_request_id(trace),
            )
            if trace.name.startswith("metrics-"):
                errs += _compare_metrics(blk, resp)
            else:
                errs += [f"{blk.label}: {e}" for e in compare_response(blk, resp, ctx)]
            if resp.status == 200 and resp.header("content-type") == "application/json" and resp.body:
                kv = json.loads(resp.body).get("kv_transfer_params")
                if kv:
                    last_kv = kv
    finally:
        for c in conns.values():
            await c.close()
    return errs


def _is_stream(block: Block) -> bool:
    try:
        data = json.loads(block.body)
    except json.JSONDecodeError:
        return False
    return isinstance(data, dict) and data.get("stream") is True


def _random_request_id(trace: Trace) -> bool:
    """No X-Request-Id header and no body request_id: the server made one up."""
    req = trace.requests()[0]
    if req.header("X-Request-Id") is not None:
        return False
    try:
        data = json.loads(req.body)
    except json.JSONDecodeError:
        return True
    return not (isinstance(data, dict) and "request_id" in data)


def _sampling_params(trace: Trace, label: str) -> dict[str, Any] | None:
    for b in trace.requests():
        if b.label == label and b.body.startswith(b"{"):
            try:
                data = json.loads(b.body)
            except json.JSONDecodeError:
                return None
            sp = data.get("sampling_params") if isinstance(data, dict) else None
            return sp if isinstance(sp, dict) else None
    return None


async def _wait_inflight(worker: SimWorker) -> None:
    for _ in range(200):
        if (await worker.state())["inflight"]:
            return
        await asyncio.sleep(0.01)


def _compare_metrics(exp: Block, act: RawResponse) -> list[str]:
    errs = []
    if exp.status != act.status:
        errs.append(f"status {exp.status} != {act.status}")
    if exp.header("content-type") != act.header("content-type"):
        errs.append(f"content-type {exp.header('content-type')!r} != {act.header('content-type')!r}")
    text = act.body.decode()
    for fam in METRIC_FAMILIES:
        if f"# TYPE {fam}" not in exp.body.decode():
            continue
        if f"# TYPE {fam}" not in text:
            errs.append(f"missing metric family {fam}")
    for line in text.splitlines():
        if line.startswith(ENGINE_ONLY):
            continue
        if line.startswith("vllm:") and 'model_name="tiny-llama"' not in line:
            errs.append(f"unlabelled series {line}")
    errs += _compare_cache_config(exp.body.decode(), text)
    return errs


def _cache_config(text: str) -> dict[str, str] | None:
    for family in text_string_to_metric_families(text):
        if family.name == "vllm:cache_config_info":
            (sample,) = family.samples
            return dict(sample.labels)
    return None


def _compare_cache_config(expected: str, actual: str) -> list[str]:
    """vllm:cache_config_info: the same label names as vLLM's, block_size the worker's own."""
    exp, act = _cache_config(expected), _cache_config(actual)
    if exp is None:
        return []
    if act is None:
        return ["no vllm:cache_config_info series"]
    errs = []
    if set(exp) != set(act):
        errs.append(f"cache_config_info labels differ: {sorted(set(exp) ^ set(act))}")
    if act.get("block_size") != str(SimSettings().block_size):
        errs.append(f"cache_config_info block_size {act.get('block_size')!r}")
    return errs


@pytest.mark.parametrize("path", TRACES, ids=[p.stem for p in TRACES])
async def test_trace_contract(path: Any, sim_factory: SimFactory) -> None:
    trace = load_trace(path)
    errs = await replay(trace, sim_factory)
    assert not errs, "\n".join(errs)


def test_every_trace_is_replayed() -> None:
    assert len(TRACES) >= 100
    servers = {load_trace(p).server for p in TRACES}
    assert servers <= {*SERVER_SETTINGS, "prefill", "decode"}


def test_compare_json_catches_what_it_must() -> None:
    trace = Trace(name="x", server="scaleout")
    ctx = Ctx(trace=trace, relaxed=False)
    exp = {"a": 1, "error": {"message": "m", "type": "t"}, "token_ids": [1, 2]}
    assert compare_json(exp, {"a": 1, "error": {"message": "m", "type": "t"}, "token_ids": [5, 6]}, ctx) == []
    assert compare_json(exp, {"error": {"message": "m", "type": "t"}, "a": 1, "token_ids": [1, 2]}, ctx)
    assert compare_json(exp, {"a": 1, "error": {"message": "other", "type": "t"}, "token_ids": [1, 2]}, ctx)
    assert compare_json(exp, {"a": None, "error": {"message": "m", "type": "t"}, "token_ids": [1, 2]}, ctx)
    assert compare_json(exp, {"a": 1, "error": {"message": "m", "type": "t"}, "token_ids": ["1"]}, ctx)
