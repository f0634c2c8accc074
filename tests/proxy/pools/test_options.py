"""proxy.pools.options: the pools' flags (declared on ``PoolSettings``' fields) and what they set."""

from __future__ import annotations

from pathlib import Path

import pytest

from proxy.cli import build_parser
from proxy.config.table import settings_from_args
from proxy.pools.options import K8sSelector, PoolSettings


def parse(*argv: str) -> PoolSettings:
    workers = ["--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"]
    a = build_parser().parse_args([*workers, *argv])
    return settings_from_args(a, {}).pools


def test_cli_defaults_and_flags(tmp_path: Path) -> None:
    d = parse()
    assert d == PoolSettings()
    (tmp_path / "admin.key").write_text("k\n")
    s = parse("--prefill-policy", "prefix", "--decode-policy", "session", "--max-inflight", "8",
              "--max-queue", "3", "--no-migrate", "--bypass-prompt-tokens", "0",
              "--admin-key-file", str(tmp_path / "admin.key"),
              "--workers-file", str(tmp_path / "w.toml"),
              "--k8s-endpointslices", "decode:serving:app=vllm,role=decode:http",
              "--k8s-endpointslices", "prefill:serving:app=p:8000")
    assert (s.prefill_policy, s.decode_policy, s.max_inflight, s.max_queue, s.migrate) == \
        ("prefix", "session", 8, 3, False)
    assert s.bypass_prompt_tokens == 0 and s.admin_key == "k" and s.config_file == tmp_path / "w.toml"
    assert s.k8s == (K8sSelector("decode", "serving", "app=vllm,role=decode", "http"),
                     K8sSelector("prefill", "serving", "app=p", 8000))
    with pytest.raises(SystemExit):
        parse("--k8s-endpointslices", "decode:serving")
    with pytest.raises(SystemExit):
        parse("--prefill-policy", "random")
