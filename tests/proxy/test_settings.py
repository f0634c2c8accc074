"""proxy.config.settings: what the settings refuse on their own, and the longest a request may take
under them (the histograms' buckets cover it). (Flags that fill them: ``test_cli_flags.py``;
the bounds' defaults: ``test_bounds.py``; client keys as tenants: ``test_tenants.py``.)"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from proxy.config.settings import ProxySettings
from proxy.pools import PoolSettings

P, D = ("http://127.0.0.1:9101",), ("http://127.0.0.1:9201",)


@pytest.mark.parametrize(("kw", "message"), [
    ({"upstream_max_connections_per_host": -1}, "must be 0 (no cap) or more"),
    ({"kv_block_size": 0}, "--kv-block-size must be at least 1"),
    ({"max_model_len": 0}, "--max-model-len must be at least 1"),
    ({"abort_repeat_first": 0.0}, "abort_grace and abort_repeat_first must be above 0"),
    ({"abort_grace": -1.0}, "abort_grace and abort_repeat_first must be above 0"),
    ({"prefill_urls": ()}, "at least one prefill and one decode URL"),
    ({"decode_urls": ()}, "at least one prefill and one decode URL"),
])
def test_settings_refuse_what_cannot_work(kw: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        ProxySettings(**{"prefill_urls": P, "decode_urls": D, **kw})


@pytest.mark.parametrize("pools", [PoolSettings(config_file=Path("workers.yaml")),
                                   PoolSettings(admin_key="k")])
def test_pools_may_start_empty_when_workers_come_later(pools: PoolSettings) -> None:
    s = ProxySettings(prefill_urls=(), decode_urls=(), pools=pools)
    assert s.prefill_urls == () and s.decode_urls == ()


def test_the_longest_request_is_a_queue_wait_a_prefill_and_the_longer_decode_bound() -> None:
    s = ProxySettings(P, D, prefill_timeout=30.0, decode_timeout=60.0, stream_idle_timeout=90.0,
                      drain_timeout=5.0, pools=PoolSettings(queue_timeout=10.0))
    assert s.longest_request() == 10.0 + 30.0 + 90.0


def test_the_longest_request_covers_a_longer_deadline_or_drain() -> None:
    pools = PoolSettings(queue_timeout=1.0, deadline_default_ms=5_000.0, deadline_max_ms=900_000.0)
    s = ProxySettings(P, D, prefill_timeout=1.0, decode_timeout=1.0, stream_idle_timeout=1.0, pools=pools)
    assert s.longest_request() == 900.0
    s = ProxySettings(P, D, prefill_timeout=1.0, decode_timeout=1.0, stream_idle_timeout=1.0,
                      drain_timeout=120.0, pools=PoolSettings(queue_timeout=1.0))
    assert s.longest_request() == 120.0


def test_the_main_key_is_the_first_client_key() -> None:
    s = ProxySettings(P, D, api_key="main", api_keys=(("team", "k2"),))
    assert s.client_keys() == [(None, "main"), ("team", "k2")]
    assert ProxySettings(P, D, api_keys=(("team", "k2"),)).client_keys() == [("team", "k2")]
