"""``pd-proxy``: run the proxy in front of prefill and decode pools."""

from __future__ import annotations

import argparse
import hmac
import ipaddress
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from proxy.config.config_file import CONFIG_FLAG, HelpFormatter, with_config_file
from proxy.config.logs import EscapingFormatter
from proxy.config.settings import ProxySettings
from proxy.config.tenants import Tenants, read_key_file
from proxy.http.multiproc import available_cpus
from proxy.http.server import serve
from proxy.observe.tracing import otel_installed
from proxy.pools import add_pool_arguments, normalize_url, pool_settings_from_args

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"
log = logging.getLogger(__name__)


def _add_workers_and_listener(p: argparse.ArgumentParser) -> None:
    """The workers (or the config file naming them), and where pd-proxy listens."""
    p.add_argument(CONFIG_FLAG, type=Path, default=None, metavar="FILE",
                   help="read settings from this YAML file, keys being the long flag names (decode-timeout: "
                        "900); flags given here win; secrets only from the environment or key files")
    # extend: `--prefill A B` and `--prefill A --prefill B` (vllm-router's habit) both give A and B.
    p.add_argument("--prefill", nargs="+", action="extend", default=[], metavar="URL",
                   help="prefill worker URLs, space-separated or the flag repeated (or --workers-file / "
                        "--k8s-endpointslices / the admin API)")
    p.add_argument("--decode", nargs="+", action="extend", default=[], metavar="URL",
                   help="decode worker URLs, space-separated or the flag repeated")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument("--workers", type=workers_arg, default=1, metavar="N|auto",
                   help="N processes serving the port (SO_REUSEPORT), or auto: one per CPU available "
                        "(affinity, capped by a cgroup CPU quota). Admin changes reach every process; "
                        "limits (in-flight, queues, per-worker caps, buffers) are PER PROCESS; see "
                        "proxy/http/multiproc.py")
    p.add_argument("--gc-threshold", type=int, default=20_000, metavar="N",
                   help="each serving process freezes its start-up objects and sets the cyclic garbage "
                        "collector's first threshold to N (Python's is 700, which costs 6-9%% of the "
                        "CPU per request under load); 0: Python's own settings")


def _add_keys(p: argparse.ArgumentParser) -> None:
    """The client keys (each one a tenant) and the key sent to the workers."""
    p.add_argument("--api-key", action="append", default=[], metavar="KEY",
                   help="a client key guarding /inference/* like vLLM's --api-key; repeat it for several "
                        "tenants, each key one tenant (also PD_PROXY_API_KEY: one key, PD_PROXY_API_KEYS: "
                        "several, comma-separated, so keys stay out of ps)")
    p.add_argument("--api-key-file", type=Path, default=None, metavar="PATH",
                   help="client keys, one per line: KEY or NAME KEY (NAME shows in the access log)")
    p.add_argument("--upstream-api-key", default=None, metavar="KEY",
                   help="API key sent to the workers (also PD_PROXY_UPSTREAM_API_KEY)")


def _add_walk_switches(p: argparse.ArgumentParser) -> None:
    """What the workers accept, and the walk's switches: prefill failure, remote_host, aborts."""
    p.add_argument("--decode-tokens-only", action="store_true",
                   help="the decode pool runs --tokens-only (reject text mode and stop strings)")
    p.add_argument("--prefill-tokens-only", action="store_true",
                   help="the prefill pool runs --tokens-only (stop strings are left out of its hop)")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="the workers' --max-num-seqs: sampling_params.n above it is refused up front")
    p.add_argument("--prefill-failure", choices=["fail", "decode-only"], default="fail",
                   help="when the prefill hop gives no usable KV: 502, or run on decode alone")
    p.add_argument("--render-pool", choices=["decode", "prefill"], default="decode",
                   help="OpenAI routes (/v1/chat/completions, /v1/completions, render, derender, "
                        "/v1/models): the pool whose workers tokenize (default: decode)")
    p.add_argument("--openai-derender", choices=["auto", "always"], default="auto",
                   help="OpenAI routes: 'auto' builds answers from text-mode hops where exact, else "
                        "derenders; 'always' derenders every answer (tool or reasoning parsers)")
    p.add_argument("--first-token-from-prefill", type=_on_off, choices=["on", "off"], default="on",
                   help="streams: send the prefill worker's token as the first chunk at once, "
                        "before the hand-off; the decode worker's token 1 is checked and dropped. "
                        "It moves the hand-off's wait to the second token: on real CPU workers TTFT "
                        "p50 was 0.71x vllm-router's at 4 concurrent but the answer's end came 1.13x "
                        "later (benchmarks/README.md, row L)")
    p.add_argument("--no-rewrite-remote-host", action="store_true",
                   help="keep a loopback remote_host a prefill worker advertises, instead of the host "
                        "the proxy reached it at")
    p.add_argument("--no-abort-broadcast", action="store_true",
                   help="do not send aborts for unknown ids to every worker")
    p.add_argument("--legacy-abort-mirror-vllm", action="store_true",
                   help="UNSAFE: serve /abort_requests without the API key, as vLLM does")


def _add_timeouts(p: argparse.ArgumentParser) -> None:
    """The hops' timeouts and connection caps toward the workers, the drain, the KV lease."""
    p.add_argument("--prefill-timeout", type=float, default=300.0,
                   help="seconds the whole prefill hop may take; then the prefill worker is sent an "
                        "abort and has 2 s more to answer (a late answer's KV is taken, not stranded)")
    p.add_argument("--decode-timeout", type=float, default=600.0,
                   help="seconds a whole non-streaming decode hop may take")
    p.add_argument("--stream-idle-timeout", type=float, default=120.0,
                   help="seconds a decode stream may stay silent")
    p.add_argument("--connect-timeout", type=float, default=5.0,
                   help="seconds to open a connection to a worker")
    p.add_argument("--upstream-keepalive-timeout", type=float, default=4.0,
                   help="idle pooled connections to workers are dropped after this many seconds; keep it "
                        "below the workers' keep-alive (vLLM: VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s)")
    p.add_argument("--upstream-max-connections-per-host", type=int, default=512, metavar="N",
                   help="connections open to one worker at most, per process, for the generate hops and "
                        "for the control calls each (0: no cap); a hop beyond it waits for a free one for "
                        "up to --connect-timeout")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds in-flight requests may take before they are ended")
    p.add_argument("--local-prefill-interval", type=float, default=15.0, metavar="S",
                   help="seconds between two scrapes of each decode worker's /metrics for the "
                        "local-prefill alarm (hand-offs ignored, KV pulls failed); 0: off")
    p.add_argument("--lease-duration", type=float, default=30.0,
                   help="the prefill workers' kv_lease_duration")


def _add_buffers_blocks_and_logs(p: argparse.ArgumentParser) -> None:
    """The slow-reader byte bounds, the KV block size, logs and tracing."""
    p.add_argument("--slow-reader-max-bytes", type=int, default=1024 * 1024,
                   help="bytes held for one streaming client that does not read before its stream is "
                        "ended (and its decode worker aborted)")
    p.add_argument("--slow-reader-total-bytes", type=int, default=256 * 1024 * 1024,
                   help="bytes held for all streaming clients of a process together; past it the "
                        "stream holding the most is ended (0: no such budget)")
    p.add_argument("--max-upstream-body-bytes", type=int, default=64 * 1024 * 1024,
                   help="largest body of a worker's non-stream 2xx answer; past it the hop fails at once "
                        "(502, the connection to the worker dropped)")
    p.add_argument("--max-upstream-error-bytes", type=int, default=1024 * 1024,
                   help="largest body of a worker's error (non-2xx) answer; past it the hop fails at once "
                        "(502 instead of the worker's answer)")
    p.add_argument("--max-upstream-header-bytes", type=int, default=64 * 1024,
                   help="largest head of a worker's answer (status line, headers, trailer); past it the "
                        "hop fails at once (502)")
    p.add_argument("--kv-block-size", type=int, default=None, metavar="TOKENS",
                   help="override the workers' KV block size for all of them (default: each worker's "
                        "own, read from vllm:cache_config_info on its /metrics; 16 until known)")
    p.add_argument("--max-model-len", type=int, default=None, metavar="TOKENS",
                   help="override the workers' model length for all of them (default: each worker's "
                        "own, read from max_model_len on its GET /v1/models; unknown until read)")
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
    p.add_argument("--log-format", choices=["text", "json"], default="text",
                   help="format of the one access line per request (logger pd_proxy.access)")
    p.add_argument("--otel", action="store_true",
                   help="OpenTelemetry spans per hop, traceparent sent to the workers (pd-proxy[otel]; "
                        "exporter from OTEL_TRACES_EXPORTER, OTEL_EXPORTER_OTLP_ENDPOINT, ...)")


def _add_client_limits(p: argparse.ArgumentParser) -> None:
    """What a client may take: a blocked write, body size and time, prompt length, head time."""
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


def _add_tls(p: argparse.ArgumentParser) -> None:
    """TLS on the listener and toward https:// workers."""
    p.add_argument("--tls-cert-file", default=None, help="serve HTTPS with this certificate (PEM)")
    p.add_argument("--tls-key-file", default=None, help="the key of --tls-cert-file (PEM)")
    p.add_argument("--upstream-ca-file", default=None,
                   help="verify https:// workers against this CA bundle (default: the system's)")
    p.add_argument("--upstream-cert-file", default=None,
                   help="client certificate for https:// workers behind mutual TLS (PEM)")
    p.add_argument("--upstream-key-file", default=None, help="the key of --upstream-cert-file (PEM)")


def build_parser() -> argparse.ArgumentParser:
    """Every flag of pd-proxy, each with a help line; ``--help`` adds its default."""
    p = argparse.ArgumentParser(prog="pd-proxy", description=__doc__, formatter_class=HelpFormatter)
    # In --help's order.
    _add_workers_and_listener(p)
    _add_keys(p)
    _add_walk_switches(p)
    _add_timeouts(p)
    _add_buffers_blocks_and_logs(p)
    _add_client_limits(p)
    _add_tls(p)
    add_pool_arguments(p)
    return p


AUTO = "auto"


def workers_arg(value: str) -> int | str:
    """``--workers``: a whole number of processes, at least 1, or ``auto``."""
    if value.strip().lower() == AUTO:
        return AUTO
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a number of processes (1 or more) or auto, got {value!r}")
    return n


def resolve_workers(value: int | str) -> tuple[int, str]:
    """The process count for ``--workers`` and how it was reached, for the start-up log."""
    if value != AUTO:
        return int(value), f"--workers {value}"
    cpus = available_cpus()
    return cpus.count, f"--workers auto: {cpus.describe()}"


def parse_args(argv: Sequence[str] | None = None) -> ProxySettings:
    return parse_args_explained(argv)[0]


def parse_args_explained(argv: Sequence[str] | None = None) -> tuple[ProxySettings, str]:
    """The settings, and how ``--workers`` came to its process count."""
    p = build_parser()
    a = p.parse_args(with_config_file(p, sys.argv[1:] if argv is None else argv))
    if a.otel and not otel_installed():
        p.error("--otel needs the OpenTelemetry packages: pip install 'pd-proxy[otel]'")
    logging.basicConfig(level=a.log_level.upper(), format=LOG_FORMAT)
    for handler in logging.getLogger().handlers:
        handler.setFormatter(EscapingFormatter(LOG_FORMAT))
    try:
        for url in (*a.prefill, *a.decode):
            normalize_url(url)
        a.workers, why = resolve_workers(a.workers)
        if a.workers > 1 and a.no_abort_broadcast:
            raise ValueError(f"{why} gives {a.workers} processes, and several processes need the abort "
                             "broadcast (an abort may reach another process): drop --no-abort-broadcast "
                             "or give --workers 1")
        return _settings(a), why
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
    api_keys = client_keys(a, os.environ)
    pools = pool_settings_from_args(a, os.environ)
    if pools.admin_key is not None and any(hmac.compare_digest(pools.admin_key.encode(), k.encode())
                                           for _, k in api_keys):
        raise ValueError("the admin key is also a client API key: every tenant could change the "
                         "pools; use a key of its own")
    if pools.admin_port and pools.admin_port == a.port and pools.admin_host == a.host:
        raise ValueError("--admin-port must differ from --port (the admin API's own listener)")
    return ProxySettings(
        prefill_urls=tuple(a.prefill), decode_urls=tuple(a.decode), host=a.host, port=a.port,
        api_keys=api_keys,
        upstream_api_key=a.upstream_api_key or os.environ.get("PD_PROXY_UPSTREAM_API_KEY"),
        decode_tokens_only=a.decode_tokens_only, prefill_tokens_only=a.prefill_tokens_only,
        max_num_seqs=a.max_num_seqs,
        prefill_failure_policy=a.prefill_failure,
        first_token_from_prefill=_switch(a.first_token_from_prefill),
        render_pool=a.render_pool, openai_derender=a.openai_derender,
        rewrite_remote_host=not a.no_rewrite_remote_host,
        abort_unknown_broadcast=not a.no_abort_broadcast,
        legacy_abort_mirror_vllm=a.legacy_abort_mirror_vllm, prefill_timeout=a.prefill_timeout,
        decode_timeout=a.decode_timeout, stream_idle_timeout=a.stream_idle_timeout,
        connect_timeout=a.connect_timeout, drain_timeout=a.drain_timeout,
        upstream_keepalive_timeout=a.upstream_keepalive_timeout,
        upstream_max_connections_per_host=a.upstream_max_connections_per_host,
        lease_duration=a.lease_duration, local_prefill_interval=a.local_prefill_interval,
        slow_reader_max_bytes=a.slow_reader_max_bytes,
        slow_reader_total_bytes=a.slow_reader_total_bytes,
        max_upstream_body_bytes=a.max_upstream_body_bytes,
        max_upstream_error_bytes=a.max_upstream_error_bytes,
        max_upstream_header_bytes=a.max_upstream_header_bytes,
        kv_block_size=a.kv_block_size, max_model_len=a.max_model_len,
        log_format=a.log_format, otel=a.otel, workers=a.workers,
        gc_threshold=a.gc_threshold,
        slow_reader_timeout=a.slow_reader_timeout, max_body_bytes=a.max_body_bytes,
        max_prompt_tokens=a.max_prompt_tokens,
        body_timeout=a.body_timeout, header_timeout=a.header_timeout,
        tls_cert_file=a.tls_cert_file, tls_key_file=a.tls_key_file, upstream_ca_file=a.upstream_ca_file,
        upstream_cert_file=a.upstream_cert_file, upstream_key_file=a.upstream_key_file,
        pools=pools,
    )


def _on_off(value: str) -> str:
    """``on``/``off``; a config file's YAML reads a bare ``on`` as true (``config_file`` passes
    ``true``), so true/false are taken as on/off."""
    return {"true": "on", "false": "off"}.get(value.lower(), value.lower())


def _switch(value: str) -> bool:
    """An ``on|off`` flag's value."""
    return value == "on"


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


KEY_FLAGS: tuple[tuple[str, str], ...] = (
    ("--api-key", "PD_PROXY_API_KEY(S) or --api-key-file"),
    ("--upstream-api-key", "PD_PROXY_UPSTREAM_API_KEY or the config file"))
"""Flags that take a secret, and where the secret belongs instead (the command line shows in ps)."""


def warn_keys_on_command_line(argv: Sequence[str]) -> None:
    """A WARNING for each key flag given on the command line, naming the flag, never the key."""
    given = {arg.split("=", 1)[0] for arg in argv}
    for flag, instead in KEY_FLAGS:
        if flag in given:
            log.warning("%s on the command line: any local user can read it in ps or /proc; "
                        "give it with %s", flag, instead)


def log_processes(settings: ProxySettings, why: str) -> None:
    """The process count at start-up, how it was reached, and that the limits hold per process."""
    n = settings.workers
    inflight = settings.pools.max_inflight
    total = "no limit" if inflight is None else f"{inflight} per process, up to {n * inflight} in all"
    log.info("pd-proxy: %d process%s (%s); limits hold per process: --max-inflight %s, and "
             "--max-queue, --max-inflight-per-worker and the byte budgets likewise",
             n, "" if n == 1 else "es", why, total)


def main(argv: Sequence[str] | None = None) -> None:
    settings, why = parse_args_explained(argv)
    warn_keys_on_command_line(sys.argv[1:] if argv is None else argv)
    warn_if_unguarded(settings)
    log_processes(settings, why)
    if settings.workers > 1:
        from proxy.http.multiproc import run_workers  # noqa: PLC0415

        raise SystemExit(run_workers(settings, settings.workers))
    serve(settings)


if __name__ == "__main__":
    main()
