from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest

from proxy.fleet.runtime import PoolRuntime
from proxy.pools.breaker import CircuitState
from proxy.pools.options import PoolSettings
from proxy.pools.worker import Outcome
from tests.proxy.pools.helpers import FakeClock
from tests.proxy.pools.test_options import parse

P, D = "http://127.0.0.1:8101", "http://127.0.0.1:8201"


def test_bypass_reasons() -> None:
    rt = PoolRuntime(PoolSettings(), [P], [D], block_size=16)
    assert rt.bypass_reason(15) == "short_prompt"
    assert rt.bypass_reason(16) is None
    rt.prefill.workers[0].healthy = False
    assert rt.bypass_reason(100) == "prefill_unavailable"
    off = PoolRuntime(PoolSettings(bypass_prompt_tokens=0, bypass_when_prefill_unavailable=False), [P], [D])
    off.prefill.workers[0].healthy = False
    assert off.bypass_reason(1) is None


def test_pick_context_and_deadline() -> None:
    clock = FakeClock()
    rt = PoolRuntime(PoolSettings(deadline_default_ms=2000, deadline_max_ms=5000), [P], [D], clock=clock)
    ctx = rt.pick_context([1, 2], {"X-Session-ID": "s1"}, tokens=9)
    assert (ctx.session_id, ctx.tokens, list(ctx.token_ids)) == ("s1", 9, [1, 2])
    assert rt.pick_context([1], {}).session_id is None
    d = rt.deadline({})
    assert d is not None and d.remaining() == pytest.approx(2.0)
    d = rt.deadline({"X-PD-Deadline-Ms": "60000"})
    assert d is not None and d.remaining() == pytest.approx(5.0)
    assert PoolRuntime(PoolSettings(), [P], [D]).deadline({}) is None
    assert rt.admin_app() is None
    assert PoolRuntime(PoolSettings(admin_key="x"), [P], [D]).admin_app() is not None


def test_metrics_names_and_circuit_values() -> None:
    registry = CollectorRegistry()
    clock = FakeClock()
    rt = PoolRuntime(PoolSettings(breaker_failures=1), [P], [D], registry=registry, clock=clock)
    w = rt.decode.workers[0]
    w.begin()
    rt.decode.release(w, Outcome.FAILURE)
    assert w.circuit is CircuitState.OPEN
    rt.prefill.workers[0].healthy = False
    rt.count_retry("prefill")
    rt.count_migration()
    rt.count_rejection()
    text = generate_latest(registry).decode()
    assert f'pd_proxy_circuit_state{{pool="decode",worker="{D}"}} 2.0' in text
    assert f'pd_proxy_circuit_state{{pool="prefill",worker="{P}"}} 0.0' in text
    assert f'pd_proxy_worker_healthy{{pool="prefill",worker="{P}"}} 0.0' in text
    assert 'pd_proxy_retries_total{hop="prefill"} 1.0' in text
    assert 'pd_proxy_retries_total{hop="decode"} 0.0' in text
    assert "pd_proxy_migrations_total 1.0" in text and "pd_proxy_queue_rejections_total 1.0" in text
    bare = CollectorRegistry()
    PoolRuntime(PoolSettings(), [P], [D], registry=bare, metrics_with_health=False)
    assert "pd_proxy_worker_healthy" not in generate_latest(bare).decode()


async def test_start_runs_probes_and_config_file_then_stops(aiohttp_server: Any, tmp_path: Path) -> None:
    probed: list[str] = []

    async def health(request: web.Request) -> web.Response:
        probed.append(request.path)
        return web.Response(status=503)

    app = web.Application()
    app.router.add_get("/health", health)
    server = await aiohttp_server(app, host="127.0.0.1")
    url = f"http://127.0.0.1:{server.port}"
    cfg = tmp_path / "w.toml"
    cfg.write_text(f'[pools.decode]\nworkers = ["{url}"]\n')
    rt = PoolRuntime(PoolSettings(config_file=cfg, health_interval=0.01, health_fail_threshold=1),
                     [url], [D])
    async with aiohttp.ClientSession() as session:
        await rt.start(session)
        assert sorted(w.url for w in rt.decode) == sorted([url, D])  # applied at start
        assert rt.health is not None
        await rt.health.probe_once()
        assert not rt.prefill.workers[0].healthy and probed
        await rt.stop()
    assert rt._tasks == []


def test_plain_settings_turn_recovery_off() -> None:
    s = PoolSettings.plain(max_inflight=3)
    rt = PoolRuntime(s, [P], [D])
    assert (s.prefill_attempts, s.decode_attempts, s.migrate, s.active_health) == (1, 1, False, False)
    assert rt.bypass_reason(1) is None and s.max_inflight == 3
    w = rt.decode.workers[0]
    for _ in range(1000):
        w.begin()
        rt.decode.release(w, Outcome.FAILURE)
    assert w.circuit is CircuitState.CLOSED


def test_one_block_size_setting_for_bypass_prefix_and_suspect_counter() -> None:
    from proxy.cli import parse_args  # noqa: PLC0415
    from proxy.http.serving import Serving  # noqa: PLC0415
    from proxy.observe.metrics import ProxyMetrics  # noqa: PLC0415

    default = Serving(parse_args(["--prefill", P, "--decode", D]), ProxyMetrics())
    assert default.settings.kv_block_size is None  # each worker's own, from its /metrics
    assert default.pools.blocks.learning and default.pools.blocks.of(None) == 16  # until known
    assert default.pools.bypass_reason(15) == "short_prompt" and default.pools.bypass_reason(16) is None
    default.pools.prefill.workers[0].block_size = 128
    assert default.pools.bypass_reason(127) == "short_prompt" and default.pools.bypass_reason(128) is None
    small = Serving(parse_args(["--prefill", P, "--decode", D, "--kv-block-size", "16"]), ProxyMetrics())
    assert small.pools.blocks.override == 16 and not small.pools.blocks.learning
    small.pools.prefill.workers[0].block_size = 128  # the override wins
    assert small.pools.bypass_reason(16) is None
    prefix = small.pools.make_policy("prefix")
    assert getattr(prefix, "block_size", None) == 16
    off = parse_args(["--prefill", P, "--decode", D, "--bypass-prompt-tokens", "0"])
    assert Serving(off, ProxyMetrics()).pools.bypass_reason(1) is None
    with pytest.raises(SystemExit):
        parse_args(["--prefill", P, "--decode", D, "--block-size", "16"])  # one flag, not two
    with pytest.raises(SystemExit):
        parse_args(["--prefill", P, "--decode", D, "--kv-block-size", "0"])


def test_panic_is_on_for_decode_and_for_prefill_only_without_the_bypass() -> None:
    rt = PoolRuntime(PoolSettings(), [P], [D])
    assert rt.decode.panic and not rt.prefill.panic  # prefill: the bypass takes those requests
    rt.prefill.workers[0].healthy = rt.decode.workers[0].healthy = False
    assert rt.decode.candidates() == rt.decode.workers
    assert rt.bypass_reason(1000) == "prefill_unavailable"
    strict = PoolRuntime(PoolSettings(bypass_when_prefill_unavailable=False), [P], [D])
    assert strict.prefill.panic
    assert not PoolRuntime(parse("--no-health-panic"), [P], [D]).decode.panic
