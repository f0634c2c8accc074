"""Launch-time configuration of P/D workers (pure): the NixlConnector ``--kv-transfer-config``
(``kv_transfer_config``) and a worker's added environment (``worker_env``)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, JsonValue, field_validator, model_validator

WorkerRole = Literal["prefill", "decode", "aggregated"]
KvRole = Literal["kv_producer", "kv_consumer", "kv_both"]
Device = Literal["cpu", "cuda"]

NIXL_CONNECTOR: Final = "NixlConnector"
DEFAULT_LEASE_SECONDS: Final = 30
ROLE_TO_KV_ROLE: Final[Mapping[str, KvRole]] = {"prefill": "kv_producer", "decode": "kv_consumer"}
NIXL_PROGRESS_DIR: Final = Path(__file__).resolve().parent / "nixl_progress"
"""Put first on a worker's ``PYTHONPATH``: its ``sitecustomize`` sets NIXL's progress delay."""
NIXL_PROGRESS_ENV: Final = "PD_NIXL_PROGRESS_DELAY_US"
DEFAULT_NIXL_PROGRESS_DELAY_US: Final = 1000


class NixlConfig(BaseModel):
    """A NixlConnector ``--kv-transfer-config``. Immutable; unknown fields are rejected."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kv_role: KvRole
    kv_buffer_device: Device = "cpu"
    kv_lease_duration: int | None = Field(default=None, gt=0)
    """Seconds P keeps KV blocks pinned for a decode that has not pulled them (vLLM's default: 30)."""
    extra: dict[str, JsonValue] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _lease_not_twice(self) -> NixlConfig:
        if self.kv_lease_duration is not None and "kv_lease_duration" in self.extra:
            raise ValueError("kv_lease_duration given both as a field and in extra")
        return self

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "kv_connector": NIXL_CONNECTOR,
            "kv_role": self.kv_role,
            "kv_buffer_device": self.kv_buffer_device,
        }
        extra: dict[str, Any] = dict(self.extra)
        if self.kv_lease_duration is not None:
            extra["kv_lease_duration"] = self.kv_lease_duration
        if extra:
            out["kv_connector_extra_config"] = extra
        return out

    def to_json(self) -> str:
        """The value of ``vllm serve --kv-transfer-config`` (compact JSON)."""
        return json.dumps(self.as_dict(), separators=(",", ":"))

    def cli_args(self) -> list[str]:
        return ["--kv-transfer-config", self.to_json()]


def kv_transfer_config(
    role: WorkerRole,
    *,
    device: Device = "cpu",
    lease_seconds: int | None = None,
    kv_both: bool = False,
    extra: Mapping[str, JsonValue] | None = None,
) -> NixlConfig | None:
    """The NixlConnector config for a worker ``role`` (``None`` for an aggregated worker)."""
    if role == "aggregated":
        return None
    kv_role: KvRole = "kv_both" if kv_both else ROLE_TO_KV_ROLE[role]
    return NixlConfig(
        kv_role=kv_role, kv_buffer_device=device, kv_lease_duration=lease_seconds, extra=dict(extra or {})
    )


class WorkerEnv(BaseModel):

    model_config = ConfigDict(frozen=True, extra="forbid")

    role: WorkerRole
    device: Device = "cpu"
    side_channel_host: str = "127.0.0.1"
    side_channel_port: int | None = Field(default=None, ge=1, le=65535)
    cpu_cores: tuple[int, ...] | None = None
    """CPU: cores for its OpenMP threads; None lets vLLM choose."""
    kvcache_gib: int = Field(default=1, gt=0)
    cuda_devices: tuple[int, ...] | None = None
    nixl_progress_delay_us: int = Field(default=DEFAULT_NIXL_PROGRESS_DELAY_US, ge=0)
    """CPU, P/D roles: longest sleep of NIXL's progress thread when idle; 0 keeps NIXL's busy poll."""

    @field_validator("cpu_cores", "cuda_devices")
    @classmethod
    def _ids(cls, value: tuple[int, ...] | None) -> tuple[int, ...] | None:
        if value is not None:
            if not value:
                raise ValueError("must name at least one id (or be None)")
            if any(i < 0 for i in value) or len(set(value)) != len(value):
                raise ValueError("ids must be distinct and non-negative")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> WorkerEnv:
        if self.role != "aggregated" and self.side_channel_port is None:
            raise ValueError(f"a {self.role} worker needs its own NIXL side-channel port")
        if self.device == "cpu" and self.cuda_devices is not None:
            raise ValueError("cuda_devices given for a CPU worker")
        if self.device == "cuda" and self.cpu_cores is not None:
            raise ValueError("cpu_cores given for a CUDA worker")
        if not self.side_channel_host:
            raise ValueError("side_channel_host must not be empty")
        return self


def worker_env(spec: WorkerEnv) -> dict[str, str]:
    """The environment variables to add to the inherited environment for one worker."""
    env: dict[str, str] = {}
    if spec.role != "aggregated":
        assert spec.side_channel_port is not None  # checked by WorkerEnv
        env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = spec.side_channel_host
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(spec.side_channel_port)
    if spec.device == "cpu":
        env["VLLM_CPU_KVCACHE_SPACE"] = str(spec.kvcache_gib)
        env["VLLM_CPU_OMP_THREADS_BIND"] = (
            "auto" if spec.cpu_cores is None else ",".join(str(c) for c in spec.cpu_cores)
        )
        if spec.role != "aggregated" and spec.nixl_progress_delay_us > 0:
            env["PYTHONPATH"] = str(NIXL_PROGRESS_DIR)
            env[NIXL_PROGRESS_ENV] = str(spec.nixl_progress_delay_us)
    elif spec.cuda_devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in spec.cuda_devices)
    return env


def round_robin_cores(index: int, cores: Sequence[int], per_worker: int = 1) -> tuple[int, ...]:
    """Cores for the ``index``-th worker when workers take ``per_worker`` cores each, wrapping around."""
    if not cores:
        raise ValueError("no cores to assign")
    if not 0 < per_worker <= len(cores):
        raise ValueError(f"per_worker must be between 1 and {len(cores)}")
    if index < 0:
        raise ValueError("index must be non-negative")
    start = index * per_worker
    return tuple(cores[(start + k) % len(cores)] for k in range(per_worker))


def with_inherited(added: Mapping[str, str], inherited: Mapping[str, str]) -> dict[str, str]:
    """A worker's whole environment: ``added`` over ``inherited``, an added ``PYTHONPATH`` first."""
    env = {**inherited, **added}
    if "PYTHONPATH" in added and inherited.get("PYTHONPATH"):
        env["PYTHONPATH"] = f"{added['PYTHONPATH']}{os.pathsep}{inherited['PYTHONPATH']}"
    return env
