"""vLLM's worker metrics (docs/vllm.md, section 4) on a per-app prometheus registry."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
_ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_XFER_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0)
_BYTES_BUCKETS = tuple(float(2048 * 4**i) for i in range(12))


def cache_config_labels(block_size: int, num_blocks: int) -> dict[str, str]:
    """The labels of vLLM 0.32's ``vllm:cache_config_info`` (its ``CacheConfig``, one series per
    engine, no ``model_name``), as the CPU build shows them, with this worker's block size and count.
    pd-proxy learns each worker's KV block size from ``block_size`` (``proxy.pools.blocks``)."""
    return {
        "_block_size_resolved": "True", "block_size": str(block_size), "cache_dtype": "auto",
        "cache_hit_alignment_tokens": "None", "effective_attention_block_size": str(block_size),
        "enable_mamba_shared_prefix_checkpoint": "False", "enable_prefix_caching": "True", "engine": "0",
        "gpu_memory_utilization": "0.92", "hash_block_size": "None", "is_attention_free": "False",
        "kv_cache_dtype_skip_layers": "[]", "kv_cache_layout": "None",
        "kv_cache_max_concurrency": "1024.0", "kv_cache_memory_bytes": "1073741824",
        "kv_cache_size_tokens": str(block_size * num_blocks), "kv_offloading_backend": "native",
        "kv_offloading_size": "None", "kv_sharing_fast_prefill": "False", "mamba_block_size": "None",
        "mamba_cache_dtype": "auto", "mamba_cache_mode": "none", "mamba_page_size_padded": "None",
        "mamba_ssm_cache_dtype": "auto", "num_cpu_blocks": "None", "num_gpu_blocks": str(num_blocks),
        "num_gpu_blocks_override": "None", "prefix_cache_retention_interval": "0",
        "prefix_caching_hash_algo": "sha256", "prefix_match_unit": "None", "replayssm_buffer_len": "16",
        "skip_page_size_padded": "None", "sliding_window": "None", "swa_bounded_replay": "True",
        "use_kda_recoverssm": "False", "use_replayssm": "False", "user_specified_block_size": "False",
    }


class SimMetrics:
    """The ``vllm:*`` metrics a worker exposes, labelled ``model_name`` and ``engine`` (the cache
    config info only ``engine``, as on vLLM)."""

    def __init__(self, model_name: str, *, block_size: int = 16, num_blocks: int = 4096) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ["model_name", "engine"]
        lv = {"model_name": model_name, "engine": "0"}
        r = self.registry
        info = cache_config_labels(block_size, num_blocks)
        Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", list(info),
              registry=r).labels(**info).set(1)

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, registry=r, buckets=buckets)

        self.ttft = hist(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            _LATENCY_BUCKETS,
        ).labels(**lv)
        self.itl = hist(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", _ITL_BUCKETS
        ).labels(**lv)
        self.e2e = hist(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            _LATENCY_BUCKETS,
        ).labels(**lv)
        self.queue_time = hist(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            _LATENCY_BUCKETS,
        ).labels(**lv)
        self.prefill_time = hist(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            _LATENCY_BUCKETS,
        ).labels(**lv)
        self.decode_time = hist(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            _LATENCY_BUCKETS,
        ).labels(**lv)
        self.xfer_time = hist(
            "vllm:nixl_xfer_time_seconds",
            "Histogram of transfer duration for NIXL KV Cache transfers.",
            _XFER_BUCKETS,
        ).labels(**lv)
        self.xfer_bytes = hist(
            "vllm:nixl_bytes_transferred",
            "Histogram of bytes transferred per NIXL KV Cache transfers.",
            _BYTES_BUCKETS,
        ).labels(**lv)
        self.running = Gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches.", labels, registry=r
        ).labels(**lv)
        self.waiting = Gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed.", labels, registry=r
        ).labels(**lv)
        self.kv_usage = Gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", labels, registry=r
        ).labels(**lv)
        self._success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*labels, "finished_reason"],
            registry=r,
        )
        self.success = {
            reason: self._success.labels(finished_reason=reason, **lv)
            for reason in ("stop", "length", "abort", "error", "repetition")
        }
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", labels, registry=r
        ).labels(**lv)
        by_source = Counter(
            "vllm:prompt_tokens_by_source",
            "Number of prompt tokens by source.",
            [*labels, "source"],
            registry=r,
        )
        self.prompt_tokens_by_source = {
            source: by_source.labels(source=source, **lv)
            for source in ("local_compute", "local_cache_hit", "external_kv_transfer")
        }
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", labels, registry=r
        ).labels(**lv)
        self.prefix_queries = Counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            labels,
            registry=r,
        ).labels(**lv)
        self.prefix_hits = Counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            labels,
            registry=r,
        ).labels(**lv)
        self.failed_transfers = Counter(
            "vllm:nixl_num_failed_transfers", "Number of failed NIXL KV Cache transfers.", labels, registry=r
        ).labels(**lv)
        self.kv_expired = Counter(
            "vllm:nixl_num_kv_expired_reqs",
            "Number of requests that had their KV expire.",
            labels,
            registry=r,
        ).labels(**lv)
