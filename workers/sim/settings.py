"""Configuration of one pd-sim worker: what it is, how fast it is and how it fails."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from kv_transfer.kv_events import KvEventsConfig

Role = Literal["prefill", "decode", "aggregated"]

ROLES: tuple[Role, ...] = ("prefill", "decode", "aggregated")


@dataclass
class Faults:
    """Failure injection. Mutable at run time through ``POST /sim/faults``.

    ``fail_next`` counts down: each generate request consumes one and is answered with
    ``fail_status`` (vLLM's error shape). The other switches stay on until cleared.
    ``exit_after_requests`` (CLI processes only) kills the process when the generate request
    after that many arrives. ``first_token_mismatch`` (decode role) makes a request that carries a
    prefill worker's KV (``do_remote_prefill``) generate another first token than the one the
    prefill worker generated for it (and the aggregated worker would): the later tokens follow
    from that one, as a real engine's would. Decode-only requests are left alone.
    ``recompute_failed_pulls`` (decode role): a KV pull that fails is computed here instead of
    failing the request (vLLM's ``kv_load_failure_policy: "recompute"``): the answer is 200 and only
    ``vllm:nixl_num_failed_transfers_total`` shows it (``vllm:prompt_tokens_by_source_total`` counts
    the tokens the pull promised as ``external_kv_transfer``, as vLLM 0.32 does).
    """

    fail_next: int = 0
    fail_status: int = 500
    drop_kv_params: bool = False
    hang_before_headers: bool = False
    hang_after_headers: bool = False
    reset_after_tokens: int | None = None
    error_after_tokens: int | None = None
    chunk_delay_ms: float = 0.0
    refuse_kv_pulls: bool = False
    first_token_mismatch: bool = False
    recompute_failed_pulls: bool = False
    exit_after_requests: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def update(self, values: dict[str, Any]) -> None:
        """Apply a partial update; raises ``ValueError`` on unknown keys or wrong types."""
        known = {f.name: f for f in dataclasses.fields(self)}
        for key, value in values.items():
            if key not in known:
                raise ValueError(f"unknown fault {key!r}")
            current = getattr(self, key)
            if key in ("reset_after_tokens", "error_after_tokens", "exit_after_requests"):
                if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                    raise ValueError(f"{key} must be a non-negative integer or null")
            elif isinstance(current, bool):
                if not isinstance(value, bool):
                    raise ValueError(f"{key} must be a boolean")
            elif isinstance(current, int):
                if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                    raise ValueError(f"{key} must be a non-negative integer")
                if key == "fail_status" and not 400 <= value <= 599:
                    raise ValueError("fail_status must be an HTTP error status (400-599)")
            elif isinstance(current, float):
                if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
                    raise ValueError(f"{key} must be a non-negative number")
                setattr(self, key, float(value))
                continue
            setattr(self, key, value)


@dataclass
class SimSettings:
    """Everything that defines one pd-sim worker.

    Timing values are in milliseconds unless the name says seconds; ``zero_latency`` turns all
    of them off (the worker then only costs CPU).
    """

    role: Role = "aggregated"
    enable_scale_out: bool = True
    tokens_only: bool = False
    api_key: str | None = None
    enable_request_id_headers: bool = False
    return_tokens_as_token_ids: bool = False
    model_name: str = "tiny-llama"
    max_model_len: int = 512
    vocab_size: int = 515
    max_num_seqs: int = 128
    max_logprobs: int = 20
    block_size: int = 16
    num_kv_blocks: int = 4096
    # timing
    zero_latency: bool = False
    prefill_base_ms: float = 5.0
    prefill_per_token_ms: float = 0.05
    itl_ms: float = 10.0
    itl_jitter_ms: float = 0.0
    slowdown_per_running: float = 0.0
    max_running: int = 256
    transfer_per_block_ms: float = 0.2
    remote_prefill_step_ms: float = 1.0
    pull_timeout_s: float = 5.0
    lease_seconds: float = 30.0
    kv_heartbeat_s: float = 5.0
    # advertised KV side channel (default: the address the prefill request arrived on)
    kv_host: str | None = None
    kv_port: int | None = None
    engine_id: str | None = None
    allow_exit: bool = False
    kv_events: KvEventsConfig | None = None
    """vLLM's ``--kv-events-config``: publish the prefix cache's KV events over ZMQ."""
    faults: Faults = field(default_factory=Faults)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.block_size < 1 or self.num_kv_blocks < 2:
            raise ValueError("block_size must be >= 1 and num_kv_blocks >= 2")
        if self.max_running < 1:
            raise ValueError("max_running must be >= 1")
        if self.lease_seconds <= 0 or self.kv_heartbeat_s <= 0:
            raise ValueError("lease_seconds and kv_heartbeat_s must be > 0")

    @property
    def has_tokenizer(self) -> bool:
        return not self.tokens_only

    @property
    def generate_enabled(self) -> bool:
        return self.enable_scale_out or self.tokens_only
