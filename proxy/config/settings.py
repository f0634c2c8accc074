"""``ProxySettings``: every knob of pd-proxy; a ``setting(...)`` field is a flag, in ``--help`` order."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from proxy.config.tenants import Tenants, read_key_file
from proxy.pools import PoolSettings
from proxy.pools.kv_index import kv_sources
from proxy.pools.setting import setting

PrefillFailurePolicy = Literal["fail", "decode-only"]
LogFormat = Literal["text", "json"]


AUTO = "auto"


def workers_arg(value: str) -> int | str:
    if value.strip().lower() == AUTO:
        return AUTO
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a number of processes (1 or more) or auto, got {value!r}")
    return n


def client_keys_from(a: argparse.Namespace, env: Mapping[str, str]) -> tuple[tuple[str | None, str], ...]:
    keys: list[tuple[str | None, str]] = [(None, k) for k in a.api_keys]
    if a.api_key_file is not None:
        try:
            keys += read_key_file(a.api_key_file)
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--api-key-file {a.api_key_file}: cannot read it "
                             f"({type(e).__name__})") from None
    if env.get("PD_PROXY_API_KEY"):
        keys.append((None, env["PD_PROXY_API_KEY"]))
    keys += [(None, k.strip()) for k in env.get("PD_PROXY_API_KEYS", "").split(",") if k.strip()]
    Tenants(keys)  # an empty or repeated key is an error here, not at the first request
    return tuple(keys)


@dataclass(frozen=True, slots=True)
class ProxySettings:
    # ---- workers and listener
    prefill_urls: tuple[str, ...] = setting(
        (), "prefill worker URLs, space-separated or the flag repeated (or --workers-file / "
            "--k8s-endpointslices / the admin API)", flag="--prefill", nargs="+", metavar="URL")
    decode_urls: tuple[str, ...] = setting(
        (), "decode worker URLs, space-separated or the flag repeated", flag="--decode", nargs="+",
        metavar="URL")
    host: str = setting("127.0.0.1", "address to listen on")
    port: int = setting(8000, "port to listen on")
    workers: int = setting(
        1, "N processes serving the port (SO_REUSEPORT), or auto: one per CPU available (affinity, capped "
           "by a cgroup CPU quota). Admin changes reach every process; limits (in-flight, queues, per-worker "
           "caps, buffers) are PER PROCESS; see proxy/http/multiproc.py", metavar="N|auto",
        parse=workers_arg)
    # ---- keys
    api_key: str | None = None
    """Guards ``/inference/*`` (and ``/debug/*``, and by default the legacy abort path)."""
    api_keys: tuple[tuple[str | None, str], ...] = setting(
        (), "a client key guarding /inference/* like vLLM's --api-key; repeat it for several tenants, each "
            "key one tenant (also PD_PROXY_API_KEY: one key, PD_PROXY_API_KEYS: several, comma-separated, so "
            "keys stay out of ps)", flag="--api-key", metavar="KEY", secret=True,
        env=("PD_PROXY_API_KEY", "PD_PROXY_API_KEYS"), resolve=client_keys_from,
        key_file=("--api-key-file", "client keys, one per line: KEY or NAME KEY (NAME shows in the access "
                                    "log)"))
    upstream_api_key: str | None = setting(
        None, "API key sent to the workers (also PD_PROXY_UPSTREAM_API_KEY)", metavar="KEY", secret=True,
        env=("PD_PROXY_UPSTREAM_API_KEY",))
    # ---- what the workers accept, the walk's switches
    decode_tokens_only: bool = setting(
        False, "the decode pool runs --tokens-only (reject text mode and stop strings)")
    prefill_tokens_only: bool = setting(
        False, "the prefill pool runs --tokens-only (stop strings are left out of its hop)")
    """Stop strings only shape generated text, and the prefill hop's one token is discarded."""
    max_num_seqs: int | None = setting(
        None, "the workers' --max-num-seqs: sampling_params.n above it is refused up front")
    prefill_failure_policy: PrefillFailurePolicy = setting(
        "fail", "when the prefill hop gives no usable KV: 502, or run on decode alone",
        flag="--prefill-failure")
    render_pool: Literal["decode", "prefill"] = setting(
        "decode", "OpenAI routes (/v1/chat/completions, /v1/completions, render, derender, /v1/models): "
                  "the pool whose workers tokenize (default: decode)")
    openai_derender: Literal["auto", "always"] = setting(
        "auto", "OpenAI routes: 'auto' builds answers from text-mode hops where exact, else derenders; "
                "'always' derenders every answer (tool or reasoning parsers)")
    first_token_from_prefill: bool = setting(
        True, "streams: send the prefill worker's token as the first chunk at once, before the hand-off; "
              "the decode worker's token 1 is checked and dropped. It moves the hand-off's wait to the "
              "second token; the workers get the same hops either way, the decode hop about 0.5 ms later "
              "(benchmarks/README.md, row L)")
    """The decode worker's token 1 is checked against it and dropped (``proxy.sse.first_token``)."""
    rewrite_remote_host: bool = setting(
        True, "keep a loopback remote_host a prefill worker advertises, instead of the host the proxy "
              "reached it at", flag="--no-rewrite-remote-host")
    """Only when the host the proxy reached the worker at is not loopback itself."""
    abort_unknown_broadcast: bool = setting(
        True, "do not send aborts for unknown ids to every worker", flag="--no-abort-broadcast")
    legacy_abort_mirror_vllm: bool = setting(
        False, "UNSAFE: serve /abort_requests without the API key, as vLLM does")
    """Unsafe: anyone who can reach the proxy can abort any request by id."""
    report_cached_tokens: bool = True
    """Non-stream: the prefill worker's cached tokens fill ``usage`` when decode reports none."""
    max_abort_ids: int = 1024
    """Distinct request ids one abort call may name (a 400 beyond)."""
    abort_broadcast_concurrency: int = 8
    """Broadcasts of unknown ids (one call per worker each) running at once."""
    abort_broadcast_queue: int = 256
    """Broadcasts that may wait for a slot; an abort call beyond it gets a 429."""
    # ---- timeouts, connections, the drain, the KV lease
    prefill_timeout: float = setting(
        300.0, "seconds the whole prefill hop may take; then the prefill worker is sent an abort and has "
               "2 s more to answer (a late answer's KV is taken, not stranded)")
    decode_timeout: float = setting(600.0, "seconds a whole non-streaming decode hop may take")
    stream_idle_timeout: float = setting(120.0, "seconds a decode stream may stay silent")
    connect_timeout: float = setting(5.0, "seconds to open a connection to a worker")
    upstream_keepalive_timeout: float = setting(
        4.0, "idle pooled connections to workers are dropped after this many seconds; keep it below the "
             "workers' keep-alive (vLLM: VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s)")
    """A pooled connection closed as a request goes out is resent only after an abort of its id."""
    upstream_max_connections_per_host: int = setting(
        512, "connections open to one worker at most, per process, for the generate hops and for the "
             "control calls each (0: no cap); a hop beyond it waits for a free one for up to "
             "--connect-timeout", metavar="N")
    control_timeout: float = 5.0
    """Abort calls, KV releases and health probes."""
    abort_grace: float = 2.0
    """How long an aborted decode stream may take to send its final ``abort`` chunk before the proxy
    ends the client's stream itself; also the longest wait between two repeats of an abort."""
    abort_repeat_first: float = 0.05
    """Wait before an abort's first repeat (vLLM drops an abort of a request it has not registered
    yet); each repeat after waits twice as long, up to ``abort_grace``."""
    drain_timeout: float = setting(
        30.0, "on SIGTERM, seconds in-flight requests may take before they are ended")
    local_prefill_interval: float = setting(
        15.0, "seconds between two scrapes of each decode worker's /metrics for the local-prefill alarm "
              "(hand-offs ignored, KV pulls failed); 0: off", metavar="S")
    lease_duration: float = setting(30.0, "the prefill workers' kv_lease_duration")
    """The prefill workers' ``kv_lease_duration`` (ledger expiry when nothing else closes it)."""
    ledger_recent: int = 512
    hold_between_hops: float = 0.0
    """TEST ONLY: wait this long in KV_HELD (prefill done, decode not sent); never in production."""
    # ---- byte bounds, KV blocks, logs and tracing
    slow_reader_max_bytes: int = setting(
        1024 * 1024, "bytes held for one streaming client that does not read before its stream is ended "
                     "(and its decode worker aborted)")
    slow_reader_total_bytes: int = setting(
        256 * 1024 * 1024, "bytes held for all streaming clients of a process together; past it the stream "
                           "holding the most is ended (0: no such budget)")
    max_upstream_body_bytes: int = setting(
        64 * 1024 * 1024, "largest body of a worker's non-stream 2xx answer; past it the hop fails at once "
                          "(502, the connection to the worker dropped)")
    """A stream's events are bounded by ``slow_reader_max_bytes`` each instead."""
    max_upstream_error_bytes: int = setting(
        1024 * 1024, "largest body of a worker's error (non-2xx) answer; past it the hop fails at once (502 "
                     "instead of the worker's answer)")
    max_upstream_header_bytes: int = setting(
        64 * 1024, "largest head of a worker's answer (status line, headers, trailer); past it the hop "
                   "fails at once (502)")
    kv_block_size: int | None = setting(
        None, "override the workers' KV block size for all of them (default: each worker's own, read from "
              "vllm:cache_config_info on its /metrics; 16 until known)", metavar="TOKENS")
    max_model_len: int | None = setting(
        None, "override the workers' model length for all of them (default: each worker's own, read from "
              "max_model_len on its GET /v1/models; unknown until read)", metavar="TOKENS")
    log_level: str = setting("INFO", "DEBUG, INFO, WARNING or ERROR")
    log_format: LogFormat = setting("text", "format of the one access line per request (logger "
                                            "pd_proxy.access)")
    otel: bool = setting(False, "OpenTelemetry spans per hop, traceparent sent to the workers "
                                "(pd-proxy[otel]; exporter from OTEL_TRACES_EXPORTER, "
                                "OTEL_EXPORTER_OTLP_ENDPOINT, ...)")
    # ---- what a client may take
    slow_reader_timeout: float = setting(
        30.0, "seconds a write to a streaming client may block (it stopped reading) before its connection "
              "is closed")
    max_body_bytes: int = setting(16 * 1024 * 1024, "largest request body accepted (413 beyond it)")
    max_prompt_tokens: int = setting(1 << 20, "a longer token_ids is a 400 before any hop (0: no limit)",
                                     metavar="N")
    body_timeout: float = setting(30.0, "seconds a request body may take to arrive (408 beyond it)")
    header_timeout: float = setting(
        30.0, "seconds a connection may take to send a request head (and idle keep-alive)")
    # ---- TLS
    tls_cert_file: str | None = setting(None, "serve HTTPS with this certificate (PEM)")
    tls_key_file: str | None = setting(None, "the key of --tls-cert-file (PEM)")
    upstream_ca_file: str | None = setting(
        None, "verify https:// workers against this CA bundle (default: the system's)")
    upstream_cert_file: str | None = setting(
        None, "client certificate for https:// workers behind mutual TLS (PEM)")
    upstream_key_file: str | None = setting(None, "the key of --upstream-cert-file (PEM)")
    # ---- not flags
    extra_health_info: dict[str, str] = field(default_factory=dict)
    pools: PoolSettings = field(default_factory=PoolSettings)

    def longest_decode_hop(self) -> float:
        return max(self.decode_timeout, self.stream_idle_timeout) + self.abort_grace

    def longest_request(self) -> float:
        """The longest a request may take under the timeouts (seconds); a stream only bounds its gaps."""
        p = self.pools
        walk = p.queue_timeout + self.prefill_timeout + max(self.decode_timeout, self.stream_idle_timeout)
        deadlines = [ms / 1000.0 for ms in (p.deadline_default_ms, p.deadline_max_ms) if ms is not None]
        return max([walk, self.drain_timeout, *deadlines])

    def client_keys(self) -> list[tuple[str | None, str]]:
        return [*([(None, self.api_key)] if self.api_key else []), *self.api_keys]

    def __post_init__(self) -> None:
        if self.upstream_max_connections_per_host < 0:
            raise ValueError("--upstream-max-connections-per-host must be 0 (no cap) or more")
        if min(self.max_upstream_body_bytes, self.max_upstream_error_bytes,
               self.max_upstream_header_bytes) < 1:
            raise ValueError("--max-upstream-body-bytes, --max-upstream-error-bytes and "
                             "--max-upstream-header-bytes must be at least 1")
        if not self.local_prefill_interval >= 0:
            raise ValueError("--local-prefill-interval must be 0 (off) or more")
        if self.kv_block_size is not None and self.kv_block_size < 1:
            raise ValueError("--kv-block-size must be at least 1")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError("--max-model-len must be at least 1")
        if not (self.abort_grace > 0 and self.abort_repeat_first > 0):
            raise ValueError("abort_grace and abort_repeat_first must be above 0 (an abort's repeats wait "
                             "that long)")
        p = self.pools
        kv_sources(p.kv_events, self.prefill_urls)  # one per --prefill worker, each well formed
        dynamic = p.config_file is not None or bool(p.k8s) or bool(p.admin_key)
        if (not self.prefill_urls or not self.decode_urls) and not dynamic:
            raise ValueError("at least one prefill and one decode URL are required "
                             "(or a workers file, EndpointSlices or the admin API)")
