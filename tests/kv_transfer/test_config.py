"""Unit tests for kv_transfer.config: the --kv-transfer-config JSON and the worker environment."""

from __future__ import annotations

import json
import os

import pytest
from pydantic import ValidationError

from kv_transfer.config import (
    NIXL_PROGRESS_DIR,
    NixlConfig,
    WorkerEnv,
    kv_transfer_config,
    round_robin_cores,
    with_inherited,
    worker_env,
)


def test_prefill_cpu_config_is_the_traces_exact_json() -> None:
    cfg = kv_transfer_config("prefill")
    assert cfg is not None
    assert (
        cfg.to_json() == '{"kv_connector":"NixlConnector","kv_role":"kv_producer","kv_buffer_device":"cpu"}'
    )


def test_decode_is_consumer_and_cli_args_carry_the_json() -> None:
    cfg = kv_transfer_config("decode", device="cuda")
    assert cfg is not None
    flag, value = cfg.cli_args()
    assert flag == "--kv-transfer-config"
    assert json.loads(value) == {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_consumer",
        "kv_buffer_device": "cuda",
    }


def test_aggregated_worker_has_no_connector() -> None:
    assert kv_transfer_config("aggregated", lease_seconds=5) is None


def test_kv_both_applies_to_either_pd_role() -> None:
    for role in ("prefill", "decode"):
        cfg = kv_transfer_config(role, kv_both=True)
        assert cfg is not None and cfg.as_dict()["kv_role"] == "kv_both"


def test_lease_and_extra_go_into_kv_connector_extra_config() -> None:
    cfg = kv_transfer_config("prefill", lease_seconds=7, extra={"num_threads": 2})
    assert cfg is not None
    assert cfg.as_dict()["kv_connector_extra_config"] == {"num_threads": 2, "kv_lease_duration": 7}


@pytest.mark.parametrize("lease", [0, -3])
def test_non_positive_lease_is_rejected(lease: int) -> None:
    with pytest.raises(ValidationError):
        kv_transfer_config("prefill", lease_seconds=lease)


def test_lease_given_twice_is_rejected() -> None:
    with pytest.raises(ValidationError, match="kv_lease_duration"):
        NixlConfig(kv_role="kv_producer", kv_lease_duration=5, extra={"kv_lease_duration": 9})


def test_unknown_role_device_and_fields_are_rejected() -> None:
    with pytest.raises(ValidationError):
        NixlConfig(kv_role="producer")
    with pytest.raises(ValidationError):
        NixlConfig(kv_role="kv_producer", kv_buffer_device="xpu")
    with pytest.raises(ValidationError):
        NixlConfig(kv_role="kv_producer", kv_ip="1.2.3.4")  # type: ignore[call-arg]


def test_prefill_cpu_env() -> None:
    env = worker_env(WorkerEnv(role="prefill", side_channel_port=5611, cpu_cores=(0,)))
    assert env == {
        "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
        "VLLM_NIXL_SIDE_CHANNEL_PORT": "5611",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "0",
        "PYTHONPATH": str(NIXL_PROGRESS_DIR),
        "PD_NIXL_PROGRESS_DELAY_US": "1000",
    }
    assert (NIXL_PROGRESS_DIR / "sitecustomize.py").is_file()


def test_nixl_progress_delay_zero_keeps_nixls_own_setting() -> None:
    env = worker_env(WorkerEnv(role="decode", side_channel_port=5612, nixl_progress_delay_us=0))
    assert "PYTHONPATH" not in env and "PD_NIXL_PROGRESS_DELAY_US" not in env
    env = worker_env(WorkerEnv(role="decode", side_channel_port=5612, nixl_progress_delay_us=250))
    assert env["PD_NIXL_PROGRESS_DELAY_US"] == "250"


def test_an_added_pythonpath_goes_before_the_inherited_one() -> None:
    added = {"PYTHONPATH": "/shim", "A": "1"}
    assert with_inherited(added, {"PYTHONPATH": "/mine", "B": "2"}) == {
        "PYTHONPATH": f"/shim{os.pathsep}/mine", "A": "1", "B": "2"}
    assert with_inherited(added, {"PYTHONPATH": ""})["PYTHONPATH"] == "/shim"
    assert with_inherited({"A": "1"}, {"PYTHONPATH": "/mine"}) == {"PYTHONPATH": "/mine", "A": "1"}


def test_aggregated_cpu_env_has_no_side_channel_and_auto_binding_by_default() -> None:
    env = worker_env(WorkerEnv(role="aggregated", kvcache_gib=2))
    assert env == {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "auto"}


def test_decode_gpu_env_sets_visible_devices_and_no_cpu_settings() -> None:
    env = worker_env(
        WorkerEnv(
            role="decode",
            device="cuda",
            side_channel_host="10.0.0.5",
            side_channel_port=5700,
            cuda_devices=(2, 3),
        )
    )
    assert env == {
        "VLLM_NIXL_SIDE_CHANNEL_HOST": "10.0.0.5",
        "VLLM_NIXL_SIDE_CHANNEL_PORT": "5700",
        "CUDA_VISIBLE_DEVICES": "2,3",
    }


@pytest.mark.parametrize(
    "kwargs",
    [
        {"role": "prefill"},  # no side-channel port
        {"role": "decode", "side_channel_port": 0},
        {"role": "decode", "side_channel_port": 70000},
        {"role": "aggregated", "cuda_devices": (0,)},  # CUDA ids on a CPU worker
        {"role": "aggregated", "device": "cuda", "cpu_cores": (0,)},
        {"role": "aggregated", "cpu_cores": ()},
        {"role": "aggregated", "cpu_cores": (1, 1)},
        {"role": "aggregated", "cpu_cores": (-1,)},
        {"role": "aggregated", "kvcache_gib": 0},
        {"role": "prefill", "side_channel_port": 5600, "side_channel_host": ""},
    ],
)
def test_inconsistent_worker_env_is_rejected(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        WorkerEnv.model_validate(kwargs)


def test_round_robin_cores_wraps_over_the_cores() -> None:
    assert [round_robin_cores(i, (0, 1)) for i in range(5)] == [(0,), (1,), (0,), (1,), (0,)]
    assert [round_robin_cores(i, (0, 1, 2, 3), per_worker=2) for i in range(3)] == [(0, 1), (2, 3), (0, 1)]
    with pytest.raises(ValueError):
        round_robin_cores(0, ())
    with pytest.raises(ValueError):
        round_robin_cores(0, (0, 1), per_worker=3)
    with pytest.raises(ValueError):
        round_robin_cores(-1, (0, 1))
