"""``pd-sim``: serve one simulated vLLM worker.

    pd-sim --port 0 --role prefill --enable-scale-out --zero-latency

With ``--port 0`` the OS picks a free port; the bound address is printed on stdout as
``pd-sim listening on http://HOST:PORT`` (one line, flushed) so a parent process can read it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import signal
import sys
from collections.abc import Sequence

from aiohttp import web

from kv_transfer.kv_events import KvEventsConfig, KvEventsError

from .server import KV_EVENTS, build_app
from .settings import ROLES, Faults, SimSettings


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pd-sim", description="A simulated vLLM 0.32 worker for P/D testing.")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed on stdout)")
    p.add_argument("--role", choices=ROLES, default="aggregated")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument(
        "--tokens-only", action="store_true", help="no tokenizer; adds legacy POST /abort_requests"
    )
    mode.add_argument("--enable-scale-out", action="store_true", help="tokenizer loaded (text mode works)")
    p.add_argument(
        "--no-scale-out",
        action="store_true",
        help="neither --enable-scale-out nor --tokens-only: /inference/v1/* answers 403",
    )
    p.add_argument("--api-key", default=None)
    p.add_argument("--enable-request-id-headers", action="store_true")
    p.add_argument(
        "--return-tokens-as-token-ids",
        action="store_true",
        help="text-mode logprobs carry token_id:N placeholders",
    )
    p.add_argument("--served-model-name", default="tiny-llama")
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int, default=4096)
    p.add_argument(
        "--kv-events-config",
        default=None,
        help="vLLM's JSON, e.g. '{\"enable_kv_cache_events\": true, \"endpoint\": \"tcp://*:5557\", "
        "\"replay_endpoint\": \"tcp://*:5558\"}': publish the prefix cache's KV events "
        "(port 0 picks a free one; the bound endpoints are printed on stdout)",
    )
    t = p.add_argument_group("timing")
    t.add_argument("--zero-latency", action="store_true", help="no simulated delays at all")
    t.add_argument("--prefill-base-ms", type=float, default=5.0)
    t.add_argument("--prefill-per-token-ms", type=float, default=0.05, help="per uncached prompt token")
    t.add_argument("--itl-ms", type=float, default=10.0)
    t.add_argument("--itl-jitter-ms", type=float, default=0.0)
    t.add_argument(
        "--slowdown-per-running",
        type=float,
        default=0.0,
        help="ITL grows by this fraction per other running request",
    )
    t.add_argument("--max-running", type=int, default=256, help="running requests; the rest wait")
    t.add_argument(
        "--transfer-per-block-ms",
        type=float,
        default=0.2,
        help="per KV block, applied by a prefill worker while a decode worker pulls",
    )
    t.add_argument(
        "--remote-prefill-step-ms",
        type=float,
        default=1.0,
        help="decode role, KV pulled (do_remote_prefill): fixed cost of the first step, "
        "instead of --prefill-base-ms",
    )
    t.add_argument("--pull-timeout-s", type=float, default=5.0)
    t.add_argument("--lease-seconds", type=float, default=30.0)
    t.add_argument(
        "--kv-heartbeat-s",
        type=float,
        default=5.0,
        help="a queued decode request extends the prefill lease this often",
    )
    k = p.add_argument_group("KV side channel")
    k.add_argument(
        "--kv-host", default=None, help="host advertised in kv_transfer_params (default: local address)"
    )
    k.add_argument("--kv-port", type=int, default=None)
    k.add_argument("--engine-id", default=None)
    f = p.add_argument_group("faults (also settable at run time: POST /sim/faults)")
    f.add_argument("--fail-next", type=int, default=0)
    f.add_argument("--fail-status", type=int, default=500)
    f.add_argument("--drop-kv-params", action="store_true")
    f.add_argument("--hang-before-headers", action="store_true")
    f.add_argument("--hang-after-headers", action="store_true")
    f.add_argument("--reset-after-tokens", type=int, default=None)
    f.add_argument("--error-after-tokens", type=int, default=None)
    f.add_argument("--chunk-delay-ms", type=float, default=0.0)
    f.add_argument("--refuse-kv-pulls", action="store_true")
    f.add_argument(
        "--first-token-mismatch",
        action="store_true",
        help="decode role: a request with the prefill worker's KV starts with another token than "
        "the one the prefill worker generated (the rest follows from it)",
    )
    f.add_argument(
        "--recompute-failed-pulls",
        action="store_true",
        help="decode role: a failed KV pull is computed locally instead of failing the request "
        "(vLLM's kv_load_failure_policy recompute)",
    )
    f.add_argument(
        "--exit-after-requests",
        type=int,
        default=None,
        help="crash (exit code 3) when the generate request after this many arrives",
    )
    p.add_argument("--log-level", default="WARNING")
    return p


def settings_from_args(args: argparse.Namespace) -> SimSettings:
    faults = Faults(
        fail_next=args.fail_next,
        fail_status=args.fail_status,
        drop_kv_params=args.drop_kv_params,
        hang_before_headers=args.hang_before_headers,
        hang_after_headers=args.hang_after_headers,
        reset_after_tokens=args.reset_after_tokens,
        error_after_tokens=args.error_after_tokens,
        chunk_delay_ms=args.chunk_delay_ms,
        refuse_kv_pulls=args.refuse_kv_pulls,
        first_token_mismatch=args.first_token_mismatch,
        recompute_failed_pulls=args.recompute_failed_pulls,
        exit_after_requests=args.exit_after_requests,
    )
    try:
        kv_events = KvEventsConfig.from_json(args.kv_events_config) if args.kv_events_config else None
    except KvEventsError as e:
        raise ValueError(str(e)) from None
    return SimSettings(
        kv_events=kv_events,
        role=args.role,
        enable_scale_out=not args.tokens_only and not args.no_scale_out,
        tokens_only=args.tokens_only,
        api_key=args.api_key,
        enable_request_id_headers=args.enable_request_id_headers,
        return_tokens_as_token_ids=args.return_tokens_as_token_ids,
        model_name=args.served_model_name,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        zero_latency=args.zero_latency,
        prefill_base_ms=args.prefill_base_ms,
        prefill_per_token_ms=args.prefill_per_token_ms,
        itl_ms=args.itl_ms,
        itl_jitter_ms=args.itl_jitter_ms,
        slowdown_per_running=args.slowdown_per_running,
        max_running=args.max_running,
        transfer_per_block_ms=args.transfer_per_block_ms,
        remote_prefill_step_ms=args.remote_prefill_step_ms,
        pull_timeout_s=args.pull_timeout_s,
        lease_seconds=args.lease_seconds,
        kv_heartbeat_s=args.kv_heartbeat_s,
        kv_host=args.kv_host,
        kv_port=args.kv_port,
        engine_id=args.engine_id,
        allow_exit=True,
        faults=faults,
    )


async def serve(settings: SimSettings, host: str, port: int) -> None:
    app = build_app(settings)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=2.0)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = port
    for sock_addr in runner.addresses:
        if isinstance(sock_addr, tuple):
            bound = int(sock_addr[1])
            break
    listening = {"event": "listening", "url": f"http://{host}:{bound}", "port": bound, "role": settings.role}
    publisher = app.get(KV_EVENTS)
    if publisher is not None:
        listening["kv_events"] = {
            "endpoint": publisher.endpoint,
            "replay_endpoint": publisher.replay_endpoint,
            "topic": publisher.config.topic,
        }
    print(json.dumps(listening), flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr)
    try:
        settings = settings_from_args(args)
    except ValueError as e:
        print(f"pd-sim: {e}", file=sys.stderr)
        return 2
    try:
        import uvloop  # noqa: PLC0415
    except ImportError:  # pragma: no cover
        run = asyncio.run
    else:
        run = uvloop.run
    try:
        run(serve(settings, args.host, args.port))
    except KvEventsError as e:  # the KV-event sockets could not be opened
        print(f"pd-sim: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
