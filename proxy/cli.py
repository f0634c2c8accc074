"""``pd-proxy``: run the proxy in front of prefill and decode pools."""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging
import os
import socket
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from aiohttp import web

from proxy.app import build_app
from proxy.logs import EscapingFormatter, configure_access_log
from proxy.pools.pool import normalize_url
from proxy.pools.runtime import add_pool_arguments, pool_settings_from_args
from proxy.settings import ProxySettings
from proxy.tenants import Tenants, read_key_file
from proxy.tls import server_context
from proxy.tracing import otel_installed

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"
log = logging.getLogger(__name__)


def parse_args(argv: Sequence[str] | None = None) -> ProxySettings:
    p = argparse.ArgumentParser(prog="pd-proxy", description=__doc__)
    p.add_argument("--prefill", nargs="+", default=[], metavar="URL",
                   help="prefill worker URLs (or --workers-file / --k8s-endpointslices / --admin-key)")
    p.add_argument("--decode", nargs="+", default=[], metavar="URL", help="decode worker URLs")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--workers", type=int, default=1, metavar="N",
                   help="N processes serving the port (SO_REUSEPORT); see proxy/multiproc.py")
    p.add_argument("--api-key", action="append", default=[], metavar="KEY",
                   help="a client key guarding /inference/* like vLLM's --api-key; repeat it for several "
                        "tenants, each key one tenant (also PD_PROXY_API_KEY: one key, PD_PROXY_API_KEYS: "
                        "several, comma-separated, so keys stay out of ps)")
    p.add_argument("--api-key-file", type=Path, default=None, metavar="PATH",
                   help="client keys, one per line: KEY or NAME KEY (NAME shows in the access log)")
    p.add_argument("--upstream-api-key", default=os.environ.get("PD_PROXY_UPSTREAM_API_KEY"),
                   help="API key sent to the workers")
    p.add_argument("--decode-tokens-only", action="store_true",
                   help="the decode pool runs --tokens-only (reject text mode and stop strings)")
    p.add_argument("--prefill-tokens-only", action="store_true",
                   help="the prefill pool runs --tokens-only (stop strings are left out of its hop)")
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--prefill-failure", choices=["fail", "decode-only"], default="fail",
                   help="when the prefill hop gives no usable KV: 502, or run on decode alone")
    p.add_argument("--no-rewrite-remote-host", action="store_true")
    p.add_argument("--no-abort-broadcast", action="store_true",
                   help="do not send aborts for unknown ids to every worker")
    p.add_argument("--legacy-abort-mirror-vllm", action="store_true",
                   help="UNSAFE: serve /abort_requests without the API key, as vLLM does")
    p.add_argument("--prefill-timeout", type=float, default=300.0)
    p.add_argument("--decode-timeout", type=float, default=600.0)
    p.add_argument("--stream-idle-timeout", type=float, default=120.0)
    p.add_argument("--connect-timeout", type=float, default=5.0)
    p.add_argument("--upstream-keepalive-timeout", type=float, default=4.0,
                   help="idle pooled connections to workers are dropped after this many seconds; keep it "
                        "below the workers' keep-alive (vLLM: VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s)")
    p.add_argument("--drain-timeout", type=float, default=30.0)
    p.add_argument("--lease-duration", type=float, default=30.0,
                   help="the prefill workers' kv_lease_duration")
    p.add_argument("--slow-reader-max-bytes", type=int, default=1024 * 1024,
                   help="bytes held for one streaming client that does not read before its stream is "
                        "ended (and its decode worker aborted)")
    p.add_argument("--slow-reader-total-bytes", type=int, default=256 * 1024 * 1024,
                   help="bytes held for all streaming clients of a process together; past it the "
                        "stream holding the most is ended (0: no such budget)")
    p.add_argument("--kv-block-size", type=int, default=128,
                   help="the workers' KV block size (for the suspect-no-transfer counter)")
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--log-format", choices=["text", "json"], default="text",
                   help="format of the one access line per request (logger pd_proxy.access)")
    p.add_argument("--otel", action="store_true",
                   help="OpenTelemetry spans per hop, traceparent sent to the workers (pd-proxy[otel]; "
                        "exporter from OTEL_TRACES_EXPORTER, OTEL_EXPORTER_OTLP_ENDPOINT, ...)")
    p.add_argument("--slow-reader-timeout", type=float, default=30.0,
                   help="seconds a write to a streaming client may block (it stopped reading) before "
                        "its connection is closed")
    p.add_argument("--max-body-bytes", type=int, default=16 * 1024 * 1024,
                   help="largest request body accepted (413 beyond it)")
    p.add_argument("--max-prompt-tokens", type=int, default=1 << 20, metavar="N",
                   help="a longer token_ids is a 400 before any hop (0: no limit)")
    p.add_argument("--body-timeout", type=float, default=30.0,
                   help="seconds a request body may take to arrive (408 beyond it)")
    p.add_argument("--header-timeout", type=float, default=30.0,
                   help="seconds a connection may take to send a request head (and idle keep-alive)")
    p.add_argument("--tls-cert-file", default=None, help="serve HTTPS with this certificate (PEM)")
    p.add_argument("--tls-key-file", default=None, help="the key of --tls-cert-file (PEM)")
    p.add_argument("--upstream-ca-file", default=None,
                   help="verify https:// workers against this CA bundle (default: the system's)")
    p.add_argument("--upstream-cert-file", default=None,
                   help="client certificate for https:// workers behind mutual TLS (PEM)")
    p.add_argument("--upstream-key-file", default=None, help="the key of --upstream-cert-file (PEM)")
    add_pool_arguments(p)
    a = p.parse_args(argv)
    if a.otel and not otel_installed():
        p.error("--otel needs the OpenTelemetry packages: pip install 'pd-proxy[otel]'")
    logging.basicConfig(level=a.log_level.upper(), format=LOG_FORMAT)
    for handler in logging.getLogger().handlers:
        handler.setFormatter(EscapingFormatter(LOG_FORMAT))
    try:
        for url in (*a.prefill, *a.decode):
            normalize_url(url)
        return _settings(a)
    except ValueError as e:
        p.error(str(e))


def client_keys(a: argparse.Namespace, env: Mapping[str, str]) -> tuple[tuple[str | None, str], ...]:
    """Every client key, from the flags, the key file and the environment (all of them count)."""
    keys: list[tuple[str | None, str]] = [(None, k) for k in a.api_key]
    if a.api_key_file is not None:
        keys += read_key_file(a.api_key_file)
    if env.get("PD_PROXY_API_KEY"):
        keys.append((None, env["PD_PROXY_API_KEY"]))
    keys += [(None, k.strip()) for k in env.get("PD_PROXY_API_KEYS", "").split(",") if k.strip()]
    Tenants(keys)  # an empty or repeated key is an error here, not at the first request
    return tuple(keys)


def _settings(a: argparse.Namespace) -> ProxySettings:
    return ProxySettings(
        prefill_urls=tuple(a.prefill), decode_urls=tuple(a.decode), host=a.host, port=a.port,
        api_keys=client_keys(a, os.environ), upstream_api_key=a.upstream_api_key,
        decode_tokens_only=a.decode_tokens_only, prefill_tokens_only=a.prefill_tokens_only,
        max_num_seqs=a.max_num_seqs,
        prefill_failure_policy=a.prefill_failure, rewrite_remote_host=not a.no_rewrite_remote_host,
        abort_unknown_broadcast=not a.no_abort_broadcast,
        legacy_abort_mirror_vllm=a.legacy_abort_mirror_vllm, prefill_timeout=a.prefill_timeout,
        decode_timeout=a.decode_timeout, stream_idle_timeout=a.stream_idle_timeout,
        connect_timeout=a.connect_timeout, drain_timeout=a.drain_timeout,
        upstream_keepalive_timeout=a.upstream_keepalive_timeout,
        lease_duration=a.lease_duration, slow_reader_max_bytes=a.slow_reader_max_bytes,
        slow_reader_total_bytes=a.slow_reader_total_bytes,
        kv_block_size=a.kv_block_size, log_format=a.log_format, otel=a.otel, workers=a.workers,
        slow_reader_timeout=a.slow_reader_timeout, max_body_bytes=a.max_body_bytes,
        max_prompt_tokens=a.max_prompt_tokens,
        body_timeout=a.body_timeout, header_timeout=a.header_timeout,
        tls_cert_file=a.tls_cert_file, tls_key_file=a.tls_key_file, upstream_ca_file=a.upstream_ca_file,
        upstream_cert_file=a.upstream_cert_file, upstream_key_file=a.upstream_key_file,
        pools=pool_settings_from_args(a),
    )


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop when installed, else the default loop."""
    try:
        import uvloop  # noqa: PLC0415
    except ImportError:
        return asyncio.new_event_loop()
    loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    return loop


def is_loopback(host: str) -> bool:
    """``localhost`` or a loopback address (127.0.0.0/8, ::1); any other name or address is not."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def warn_if_unguarded(settings: ProxySettings) -> None:
    """A WARNING when the proxy listens beyond loopback with no client API key (anyone who can reach
    the port may then generate and abort requests)."""
    if settings.client_keys() or is_loopback(settings.host):
        return
    log.warning("pd-proxy listens on %s:%d with no client API key: anyone who can reach it may generate "
                "and abort requests; set --api-key or PD_PROXY_API_KEY", settings.host, settings.port)


def main(argv: Sequence[str] | None = None) -> None:
    settings = parse_args(argv)
    warn_if_unguarded(settings)
    if settings.workers > 1:
        from proxy.multiproc import run_workers  # noqa: PLC0415

        raise SystemExit(run_workers(settings, settings.workers))
    serve(settings)


def serve(settings: ProxySettings, sock: socket.socket | None = None) -> None:
    """Run one server process until SIGTERM/SIGINT, on ``sock`` when given (``--workers``)."""
    configure_access_log(settings.log_format)
    loop = new_event_loop()
    asyncio.set_event_loop(loop)
    where: dict[str, Any] = {"sock": sock} if sock is not None else \
        {"host": settings.host, "port": settings.port}
    ssl_context = server_context(settings.tls_cert_file, settings.tls_key_file) \
        if settings.tls_cert_file else None
    web.run_app(build_app(settings), **where, ssl_context=ssl_context,
                keepalive_timeout=settings.header_timeout,
                shutdown_timeout=settings.drain_timeout, handler_cancellation=True,
                access_log=None, loop=loop)


if __name__ == "__main__":
    main()
