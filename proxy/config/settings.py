"""``ProxySettings``: every knob of pd-proxy in one frozen dataclass (the CLI fills it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from proxy.pools import PoolSettings

PrefillFailurePolicy = Literal["fail", "decode-only"]
LogFormat = Literal["text", "json"]


@dataclass(frozen=True, slots=True)
class ProxySettings:
    prefill_urls: tuple[str, ...]
    decode_urls: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    """Guards ``/inference/*`` (and ``/debug/*``, and by default the legacy abort path)."""
    api_keys: tuple[tuple[str | None, str], ...] = ()
    """More client keys, (name or None, key): each key is a tenant (``proxy.config.tenants``)."""
    upstream_api_key: str | None = None
    """Sent to the workers as ``Authorization: Bearer``."""
    decode_tokens_only: bool = False
    """The decode pool runs ``--tokens-only``: text mode and stop strings are rejected up front."""
    prefill_tokens_only: bool = False
    """The prefill pool runs ``--tokens-only``: stop strings (which only shape generated text,
    and the prefill hop's one token is discarded) are left out of the prefill hop."""
    max_num_seqs: int | None = None
    """When set, ``sampling_params.n`` above it is rejected up front (vLLM's message)."""
    prefill_failure_policy: PrefillFailurePolicy = "fail"
    """What to do when the prefill hop fails or returns no usable ``kv_transfer_params``:
    ``fail`` with a 502 naming the worker, or run the request on a decode worker alone."""
    render_pool: Literal["decode", "prefill"] = "decode"
    """The pool whose workers render and derender the OpenAI routes' requests (``proxy.openai``)."""
    openai_derender: Literal["auto", "always"] = "auto"
    """OpenAI routes: ``auto`` builds the answer from text-mode hops where that is exact, else
    derenders; ``always`` derenders every answer (tool or reasoning parsers on the workers)."""
    first_token_from_prefill: bool = True
    """Streams: the client gets the prefill worker's token as its first chunk when the prefill hop
    answers (TTFT without the hand-off); the decode worker's token 1 is checked against it and
    left out of the relayed stream (``proxy.sse.first_token``)."""
    rewrite_remote_host: bool = True
    """Replace a loopback/unspecified ``remote_host`` advertised by a prefill worker with the
    host the proxy reached that worker at (when that host is not loopback itself)."""
    report_cached_tokens: bool = True
    """Non-stream: put the prefill worker's cached prompt tokens into
    ``usage.prompt_tokens_details`` when the decode worker reports none."""
    connect_timeout: float = 5.0
    upstream_keepalive_timeout: float = 4.0
    """How long an idle pooled connection to a worker is kept for reuse. Keep it below the workers'
    own keep-alive (vLLM's ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``, 5 s by default). A pooled connection is
    polled before reuse; one the worker closes just as a request goes out is sent again only after an
    abort of its id (``proxy.upstream.client.Upstream.open``, ``pd_proxy_upstream_resends_total``)."""
    upstream_max_connections_per_host: int = 512
    """Connections open to one worker at most, per process, for the generate hops and for the control
    calls each (0: no cap). A generate hop beyond it waits for a free one for at most
    ``connect_timeout``; a control call (abort, health probe) within its own timeout (aiohttp's
    ``limit_per_host``)."""
    prefill_timeout: float = 300.0
    """Whole prefill hop (a non-streaming call)."""
    decode_timeout: float = 600.0
    """Whole non-streaming decode hop."""
    stream_idle_timeout: float = 120.0
    """Longest gap between two reads of a decode stream."""
    control_timeout: float = 5.0
    """Abort calls, KV releases and health probes."""
    abort_grace: float = 2.0
    """After forwarding an abort to a decode worker, how long its stream may take to send
    its final ``abort`` chunk before the proxy ends the client's stream itself; also the longest
    wait between two repeats of an abort to a worker still running the hop."""
    abort_repeat_first: float = 0.05
    """From an abort sent to a worker still running the hop to its first repeat (vLLM drops an
    abort of a request it has not registered yet); each repeat after waits twice as long, up to
    ``abort_grace`` (``Part.abort_until``)."""
    drain_timeout: float = 30.0
    """On shutdown, how long in-flight requests may take before they are ended."""
    slow_reader_max_bytes: int = 1024 * 1024
    """Bytes that may be held for one streaming client (queued, or in a write that has not
    returned) before its stream is ended and its decode worker aborted."""
    slow_reader_total_bytes: int = 256 * 1024 * 1024
    """Bytes that may be held for all streaming clients of the process together; past it the
    stream holding the most is ended (as past its own cap). 0: no such budget."""
    max_upstream_body_bytes: int = 64 * 1024 * 1024
    """Largest body of a worker's non-stream 2xx answer (a stream's events are bounded by
    ``slow_reader_max_bytes`` each). 64 MiB holds a non-stream answer of about 48,000 tokens with
    20 top logprobs each (vLLM writes about 1.3 KiB of JSON per such token); larger ones stream.
    Past it the hop fails at once as the worker's protocol error (502, connection dropped)."""
    max_upstream_error_bytes: int = 1024 * 1024
    """Largest body of a worker's answer that is not 2xx: vLLM's error JSON is a few hundred
    bytes. Past it the hop fails at once (502 instead of the worker's answer)."""
    max_upstream_header_bytes: int = 64 * 1024
    """Largest head of a worker's answer (status line and headers, interim answers and a chunked
    body's trailer included). Past it the hop fails at once (502)."""
    slow_reader_timeout: float = 30.0
    """A write to a streaming client that does not complete within this many seconds (it stopped
    reading) closes its connection; the decode worker is aborted."""
    abort_unknown_broadcast: bool = True
    """An abort naming an id this proxy does not know goes to every worker of both pools."""
    max_abort_ids: int = 1024
    """Distinct request ids one abort call may name (a 400 beyond)."""
    abort_broadcast_concurrency: int = 8
    """Broadcasts of unknown ids (one call per worker each) running at once."""
    abort_broadcast_queue: int = 256
    """Broadcasts that may wait for a slot; an abort call beyond it gets a 429."""
    legacy_abort_mirror_vllm: bool = False
    """Serve ``POST /abort_requests`` WITHOUT checking the API key, as vLLM's --tokens-only
    server does. Unsafe: anyone who can reach the proxy can then abort any request by id
    (ids are often predictable or logged), a denial of service on every tenant."""
    local_prefill_interval: float = 15.0
    """Seconds between two scrapes of each decode worker's ``/metrics`` by the local-prefill alarm
    (``proxy.observe.local_prefill``); 0 turns the alarm off (no scrape, nothing counted)."""
    lease_duration: float = 30.0
    """The prefill workers' ``kv_lease_duration`` (ledger expiry when nothing else closes it)."""
    ledger_recent: int = 512
    hold_between_hops: float = 0.0
    """TEST ONLY: wait this long in the KV_HELD state (prefill done, decode not sent) so that
    tests can open that window reliably. Never set it in production."""
    kv_block_size: int | None = None
    """The workers' KV block size for every worker (vLLM GPU: 16, CPU: 128); None: each worker's
    own, read from its ``/metrics`` (``proxy.pools.blocks``). It sets the short-prompt bypass, the
    prefix key, the preflight's prompt, and which prompts count in
    ``pd_proxy_suspect_no_transfer_total`` (at least one block, and no transfer seen)."""
    max_model_len: int | None = None
    """The workers' model length (prompt and output tokens) for every worker; None: each worker's
    own, read from its ``GET /v1/models`` (``proxy.pools.blocks``). A stream whose prompt leaves
    room for one token only ends at the prefill worker's token (``proxy.stream.first_stream``)."""
    log_format: LogFormat = "text"
    """The per-request access line (logger ``pd_proxy.access``): ``key=value`` text or JSON."""
    otel: bool = False
    """OpenTelemetry spans per hop, ``traceparent`` sent to the workers (``proxy.observe.tracing``; needs
    the ``otel`` extra; exporter and endpoint from the standard ``OTEL_*`` variables)."""
    workers: int = 1
    """Processes serving the port (``proxy.http.multiproc``: ``SO_REUSEPORT``, one request table each;
    aborts reach other processes through the broadcast). 1: this process serves."""
    gc_threshold: int = 20_000
    """Each serving process, once started: its start-up objects frozen (``gc.freeze``) and the
    cyclic collector's first threshold set to this (``gc.set_threshold``; Python's is 700). At 700
    the objects of the requests in flight set off a young collection every few requests, and what
    outlives it is scanned again in the older generations: 6-9% of the CPU per request at 64 at a
    time (``proxy.http.server.settle_gc``). 0: Python's own collector settings."""
    max_prompt_tokens: int = 1 << 20
    """A longer ``token_ids`` is a 400 (param ``token_ids``) before any hop; 0: no limit. Bodies over
    1 MiB are parsed in slices (``proxy.wire.large_body``), so the count is known early."""
    max_body_bytes: int = 16 * 1024 * 1024
    """Largest request body accepted (413 in vLLM's shape beyond it; ``proxy.http.limits``)."""
    body_timeout: float = 30.0
    """A request body must arrive within this many seconds once its headers did (else 408)."""
    header_timeout: float = 30.0
    """A connection must send a complete request head within this many seconds of opening (or of
    its previous response), else it is closed: aiohttp's server keep-alive timer (``proxy.http.limits``)."""
    tls_cert_file: str | None = None
    """Serve HTTPS with this certificate chain (PEM); ``tls_key_file`` its key (``proxy.http.tls``)."""
    tls_key_file: str | None = None
    upstream_ca_file: str | None = None
    """Verify ``https://`` workers against this CA bundle instead of the system's."""
    upstream_cert_file: str | None = None
    """Client certificate (PEM) presented to ``https://`` workers behind mutual TLS."""
    upstream_key_file: str | None = None
    extra_health_info: dict[str, str] = field(default_factory=dict)
    pools: PoolSettings = field(default_factory=PoolSettings)
    """Routing policies, health, admission, retries, migration, bypass (``proxy.pools``)."""

    def longest_decode_hop(self) -> float:
        """The longest a decode hop may run before it ends by its own limits (seconds): its
        timeout or a stream's idle gap, and the abort's grace after it."""
        return max(self.decode_timeout, self.stream_idle_timeout) + self.abort_grace

    def longest_request(self) -> float:
        """The longest a request may take under the proxy's timeouts (seconds): a queue wait, the
        prefill hop and the decode hop (or a stream's idle gap), or the longest deadline. Streams
        may run longer (only their gaps are bounded); the histograms' buckets cover this much."""
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
        dynamic = p.config_file is not None or bool(p.k8s) or bool(p.admin_key)
        if (not self.prefill_urls or not self.decode_urls) and not dynamic:
            raise ValueError("at least one prefill and one decode URL are required "
                             "(or a workers file, EndpointSlices or the admin API)")
