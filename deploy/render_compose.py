"""Render ``deploy/compose/docker-compose.yml`` and its Prometheus targets from ``deploy/compose/.env``.

Compose cannot loop, and every worker needs its own GPUs, HTTP port and NIXL side-channel port, so the
file is generated: one service per prefill and per decode worker, pd-proxy (built from the repository's
Dockerfile) pointed at all of them, Prometheus scraping all of them and Grafana with the dashboards.
Every listener is on loopback unless .env says otherwise (PROXY_BIND, GRAFANA_BIND); pd-proxy's API
key and Grafana's admin password come from the environment at ``up`` time (Compose refuses to start
without them), never from .env or the generated file.

    python -m deploy.render_compose            # writes the files from deploy/compose/.env
    python -m deploy.render_compose --check    # exit 1 if the committed files are stale
    python -m deploy.render_compose --env-file my.env --out-dir /tmp/pd   # another layout
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import shlex
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Literal

from deploy.targets import DEPLOY_DIR, Endpoints, render_targets, write_atomic
from kv_transfer.config import kv_transfer_config
from kv_transfer.kv_events import KvEventsConfig, loopback_bind_endpoint

COMPOSE_DIR: Final = DEPLOY_DIR / "compose"
COMPOSE_FILE: Final = "docker-compose.yml"
TARGETS_DIR: Final = "prometheus-targets"

# Pinned images (a test checks that every image in the rendered file carries an exact version).
# vLLM: the version the project is tested against (workers/install_vllm.sh, the recorded traces).
VLLM_IMAGE: Final = "vllm/vllm-openai:v0.32.0"
PROMETHEUS_IMAGE: Final = "prom/prometheus:v3.1.0"
GRAFANA_IMAGE: Final = "grafana/grafana:11.4.0"
PROXY_IMAGE: Final = "pd-proxy:0.1.0"

ApiMode = Literal["scale-out", "tokens-only"]
Role = Literal["prefill", "decode"]
# Where pd-proxy and Grafana listen unless .env says otherwise (PROXY_BIND, GRAFANA_BIND): loopback.
# Workers and Prometheus always stay on loopback.
DEFAULT_BIND: Final = "127.0.0.1"
API_FLAGS: Final[Mapping[str, str]] = {"scale-out": "--enable-scale-out", "tokens-only": "--tokens-only"}


class SettingsError(ValueError):
    """The .env file does not describe a valid layout."""


@dataclass(frozen=True)
class Worker:
    role: Role
    index: int
    gpus: tuple[int, ...]
    port: int
    side_channel_port: int
    kv_events_port: int | None = None
    """Prefill workers: the KV-event PUB port; the replay port is the next one."""

    @property
    def name(self) -> str:
        return f"{self.role}-{self.index}"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def kv_event_ports(self) -> tuple[int, ...]:
        """The KV-event PUB and replay ports (none for a decode worker)."""
        return () if self.kv_events_port is None else (self.kv_events_port, self.kv_events_port + 1)

    @property
    def kv_events_endpoint(self) -> str | None:
        """Where pd-proxy subscribes to this worker's KV events (``--kv-events``)."""
        return None if self.kv_events_port is None else f"tcp://127.0.0.1:{self.kv_events_port}"

    def kv_events_config(self) -> KvEventsConfig | None:
        """vLLM's ``--kv-events-config``: PUB bound on the loopback (vLLM binds only an endpoint
        holding ``*`` or ``::``, hence the IPv6-mapped form), replay on the port after it."""
        if self.kv_events_port is None:
            return None
        return KvEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                              endpoint=loopback_bind_endpoint(self.kv_events_port),
                              replay_endpoint=f"tcp://127.0.0.1:{self.kv_events_port + 1}")


@dataclass(frozen=True)
class Settings:
    prefill: tuple[Worker, ...]
    decode: tuple[Worker, ...]
    api_mode: ApiMode
    extra_args: tuple[str, ...]
    lease_seconds: int | None
    side_channel_host: str
    proxy_port: int
    prometheus_port: int
    grafana_port: int
    proxy_bind: str = DEFAULT_BIND
    grafana_bind: str = DEFAULT_BIND

    @property
    def workers(self) -> tuple[Worker, ...]:
        return self.prefill + self.decode


def parse_env(text: str) -> dict[str, str]:
    """``KEY=VALUE`` lines as Compose reads them (comments and blank lines skipped, quotes removed)."""
    values: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep or not key.strip():
            raise SettingsError(f"line {number}: expected KEY=VALUE")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        values[key.strip()] = value
    return values


def _int(env: Mapping[str, str], key: str, default: int | None = None) -> int:
    raw = env.get(key)
    if raw is None or raw == "":
        if default is None:
            raise SettingsError(f"{key} is required")
        return default
    try:
        return int(raw)
    except ValueError:
        raise SettingsError(f"{key} must be an integer, got {raw!r}") from None


def _gpu_map(env: Mapping[str, str], key: str, count: int) -> list[tuple[int, ...]]:
    entries = [e.strip() for e in env.get(key, "").split(";") if e.strip()]
    if len(entries) != count:
        raise SettingsError(f"{key} names {len(entries)} workers but the count is {count}")
    out = []
    for entry in entries:
        try:
            gpus = tuple(int(g) for g in entry.split(","))
        except ValueError:
            raise SettingsError(f"{key}: {entry!r} is not a comma-separated list of GPU ids") from None
        if any(g < 0 for g in gpus) or len(set(gpus)) != len(gpus):
            raise SettingsError(f"{key}: {entry!r} must list distinct non-negative GPU ids")
        out.append(gpus)
    return out


def _api_mode(raw: str) -> ApiMode:
    if raw == "scale-out":
        return "scale-out"
    if raw == "tokens-only":
        return "tokens-only"
    raise SettingsError(f"API_MODE must be one of {sorted(API_FLAGS)}, got {raw!r}")


def _bind(env: Mapping[str, str], key: str) -> str:
    raw = env.get(key, "") or DEFAULT_BIND
    try:
        return str(ipaddress.ip_address(raw))
    except ValueError:
        raise SettingsError(f"{key} must be an IP address to listen on (127.0.0.1, 0.0.0.0, ...), "
                            f"got {raw!r}") from None


def local_url(bind: str, port: int) -> str:
    """The URL a process on the host reaches a listener bound to ``bind`` with (the health check and
    Prometheus's target): loopback for a wildcard or loopback bind, the address itself otherwise."""
    address = ipaddress.ip_address(bind)
    if address.is_unspecified or address.is_loopback:
        return f"http://127.0.0.1:{port}"
    return f"http://[{address}]:{port}" if address.version == 6 else f"http://{address}:{port}"


def settings_from_env(env: Mapping[str, str]) -> Settings:
    n, m = _int(env, "PREFILL_COUNT"), _int(env, "DECODE_COUNT")
    if n < 1 or m < 1:
        raise SettingsError("PREFILL_COUNT and DECODE_COUNT must be at least 1")
    layout: tuple[tuple[Role, int, int, int], ...] = (
        (
            "prefill",
            n,
            _int(env, "PREFILL_BASE_PORT", 8100),
            _int(env, "PREFILL_SIDE_CHANNEL_BASE_PORT", 5600),
        ),
        ("decode", m, _int(env, "DECODE_BASE_PORT", 8200), _int(env, "DECODE_SIDE_CHANNEL_BASE_PORT", 5700)),
    )
    # Prefill worker i publishes its KV events on EVENTS + 2i and serves their replay on EVENTS + 2i + 1.
    events = _int(env, "PREFILL_KV_EVENTS_BASE_PORT", 5557)
    pools: dict[Role, tuple[Worker, ...]] = {}
    for role, count, base, side in layout:
        gpu_map = _gpu_map(env, f"{role.upper()}_GPUS", count)
        pools[role] = tuple(
            Worker(role, i, gpus, base + i, side + i, events + 2 * i if role == "prefill" else None)
            for i, gpus in enumerate(gpu_map)
        )
    workers = pools["prefill"] + pools["decode"]
    all_gpus = [g for w in workers for g in w.gpus]
    if len(set(all_gpus)) != len(all_gpus):
        raise SettingsError("a GPU is given to two workers: each worker needs its own GPUs")
    settings = Settings(
        prefill=pools["prefill"],
        decode=pools["decode"],
        api_mode=_api_mode(env.get("API_MODE", "scale-out")),
        extra_args=tuple(shlex.split(env.get("VLLM_EXTRA_ARGS", ""))),
        lease_seconds=_int(env, "KV_LEASE_SECONDS") if env.get("KV_LEASE_SECONDS") else None,
        side_channel_host=env.get("SIDE_CHANNEL_HOST", "127.0.0.1") or "127.0.0.1",
        proxy_port=_int(env, "PROXY_PORT", 8000),
        prometheus_port=_int(env, "PROMETHEUS_PORT", 9090),
        grafana_port=_int(env, "GRAFANA_PORT", 3000),
        proxy_bind=_bind(env, "PROXY_BIND"),
        grafana_bind=_bind(env, "GRAFANA_BIND"),
    )
    ports = [p for w in workers for p in (w.port, w.side_channel_port, *w.kv_event_ports)]
    ports += [settings.proxy_port, settings.prometheus_port, settings.grafana_port]
    if len(set(ports)) != len(ports):
        raise SettingsError("two services would listen on the same host port; change the base ports")
    if any(not 0 < p < 65536 for p in ports):
        raise SettingsError("ports must be between 1 and 65535")
    return settings


# GPU vLLM's KV block (CPU's is 128), set explicitly on every worker. pd-proxy reads each worker's
# block from its /metrics (vllm:cache_config_info): no --kv-block-size to keep in step.
GPU_BLOCK_SIZE = 16


# pd-proxy's own default prefill policy: the compose file keeps it unless PREFILL_POLICY is set at
# `up` time (kv_events routes by the prefill workers' KV events).
DEFAULT_PREFILL_POLICY: Final = "least_loaded"
PREFILL_POLICY_FROM_ENV: Final = "${PREFILL_POLICY:-" + DEFAULT_PREFILL_POLICY + "}"


def proxy_args(prefill: Sequence[str], decode: Sequence[str], port: int, host: str, *,
               kv_events: Sequence[str] = (), prefill_policy: str | None = None) -> list[str]:
    """pd-proxy's command line for a set of workers: one process per CPU the container may use
    (``--workers auto``, capped by the service's ``cpus``: PROXY_CPUS in .env); ``kv_events`` the
    prefill workers' KV-event endpoints, one per ``prefill`` URL in the same order."""
    if kv_events and len(kv_events) != len(prefill):
        raise ValueError("--kv-events takes one endpoint per --prefill URL")
    args = ["--prefill", *prefill, "--decode", *decode, "--host", host, "--port", str(port),
            "--workers", "auto"]
    if kv_events:
        args += ["--kv-events", *kv_events]
    if prefill_policy is not None:
        args += ["--prefill-policy", prefill_policy]
    return args


def _q(value: str) -> str:
    """A YAML scalar (JSON strings are valid YAML and keep every character literal)."""
    return json.dumps(value)


def _flow(items: Sequence[str]) -> str:
    return "[" + ", ".join(_q(i) for i in items) + "]"


def _health(url: str, interval: str, start_period: str, path: str = "/health") -> list[str]:
    probe = f"import urllib.request; urllib.request.urlopen('{url}{path}', timeout=5)"
    return [
        "    healthcheck:",
        f"      test: {_flow(['CMD', 'python3', '-c', probe])}",
        f"      interval: {interval}",
        "      timeout: 6s",
        "      retries: 3",
        f"      start_period: {start_period}",
    ]


def _worker_service(w: Worker, s: Settings) -> list[str]:
    connector = kv_transfer_config(w.role, device="cuda", lease_seconds=s.lease_seconds)
    assert connector is not None  # prefill/decode always have a connector
    args = [
        "${MODEL}",
        "--served-model-name",
        "${SERVED_MODEL_NAME}",
        "--host",
        "127.0.0.1",
        "--port",
        str(w.port),
        API_FLAGS[s.api_mode],
        "--tensor-parallel-size",
        str(len(w.gpus)),
        "--block-size",
        str(GPU_BLOCK_SIZE),
        *connector.cli_args(),
    ]
    events = w.kv_events_config()
    if events is not None:
        args += ["--kv-events-config", events.to_json()]
    args += s.extra_args
    lines = [
        f"  {w.name}:",
        f"    image: {VLLM_IMAGE}",
        '    entrypoint: ["vllm", "serve"]',
        f"    command: {_flow(args)}",
        "    network_mode: host",
        "    ipc: host",
        "    restart: unless-stopped",
        "    labels:",
        f'      pd-proxy.pool: "{w.role}"',
        "    environment:",
        f"      VLLM_NIXL_SIDE_CHANNEL_HOST: {_q(s.side_channel_host)}",
        f'      VLLM_NIXL_SIDE_CHANNEL_PORT: "{w.side_channel_port}"',
        "      HF_TOKEN: ${HF_TOKEN:-}",
        "    volumes:",
        "      - ${HF_CACHE:-~/.cache/huggingface}:/root/.cache/huggingface",
        "    deploy:",
        "      resources:",
        "        reservations:",
        "          devices:",
        "            - driver: nvidia",
        f"              device_ids: {_flow([str(g) for g in w.gpus])}",
        "              capabilities: [gpu]",
        *_health(w.url, "15s", "900s"),
    ]
    return lines


def render_compose(s: Settings) -> str:
    proxy = proxy_args([w.url for w in s.prefill], [w.url for w in s.decode], s.proxy_port, s.proxy_bind,
                       kv_events=[w.kv_events_endpoint or "" for w in s.prefill],
                       prefill_policy=PREFILL_POLICY_FROM_ENV)
    proxy_url = local_url(s.proxy_bind, s.proxy_port)
    lines = [
        "# GENERATED by `python -m deploy.render_compose` from deploy/compose/.env: edit .env, re-render.",
        f"# {len(s.prefill)} prefill (KV events on) + {len(s.decode)} decode vLLM workers (NixlConnector),",
        "# pd-proxy, Prometheus and Grafana, all on the host network (NIXL moves KV between the GPUs",
        "# directly).",
        "#     docker compose -f deploy/compose/docker-compose.yml up -d --build",
        "name: pd-proxy",
        "",
        "services:",
    ]
    for w in s.workers:
        lines += _worker_service(w, s)
        lines.append("")
    lines += [
        "  pd-proxy:",
        f"    image: {PROXY_IMAGE}",
        "    build:",
        "      context: ../..",
        "      dockerfile: Dockerfile",
        f"    command: {_flow(proxy)}",
        # --workers auto runs one process per CPU of this quota (the host's GPU workers keep the rest).
        '    cpus: "${PROXY_CPUS:-4}"',
        "    network_mode: host",
        "    restart: unless-stopped",
        "    environment:",
        f'      PD_PROXY_PORT: "{s.proxy_port}"',
        # The key clients send (Authorization: Bearer ...): required, from the environment at `up`.
        "      PD_PROXY_API_KEY: ${PD_PROXY_API_KEY:?set PD_PROXY_API_KEY to the key clients must send}",
        "    depends_on:",
    ]
    for w in s.workers:
        lines += [f"      {w.name}:", "        condition: service_healthy"]
    lines += [
        # /livez: the process serves (/health is 503 while a pool has no worker).
        *_health(proxy_url, "10s", "20s", "/livez"),
        "",
        "  prometheus:",
        f"    image: {PROMETHEUS_IMAGE}",
        "    command:",
        '      - "--config.file=/etc/prometheus/prometheus.yml"',
        '      - "--storage.tsdb.path=/prometheus"',
        f'      - "--web.listen-address=127.0.0.1:{s.prometheus_port}"',
        "    network_mode: host",
        "    restart: unless-stopped",
        "    volumes:",
        "      - ../prometheus/prometheus.yml:/etc/prometheus/prometheus.yml:ro",
        "      - ../prometheus/alerts.yml:/etc/prometheus/alerts.yml:ro",
        f"      - ./{TARGETS_DIR}:/etc/prometheus/targets:ro",
        "      - prometheus-data:/prometheus",
        "",
        "  grafana:",
        f"    image: {GRAFANA_IMAGE}",
        "    network_mode: host",
        "    restart: unless-stopped",
        "    environment:",
        f'      GF_SERVER_HTTP_ADDR: "{s.grafana_bind}"',
        f'      GF_SERVER_HTTP_PORT: "{s.grafana_port}"',
        "      GF_SECURITY_ADMIN_USER: ${GRAFANA_ADMIN_USER:-admin}",
        "      GF_SECURITY_ADMIN_PASSWORD: ${GRAFANA_ADMIN_PASSWORD:?set GRAFANA_ADMIN_PASSWORD}",
        '      GF_AUTH_ANONYMOUS_ENABLED: "false"',
        '      GF_USERS_ALLOW_SIGN_UP: "false"',
        "      GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH:"
        ' "/var/lib/grafana/dashboards/pd-proxy/pd-proxy-latency.json"',
        f'      PROMETHEUS_URL: "http://127.0.0.1:{s.prometheus_port}"',
        "    volumes:",
        "      - ../grafana/provisioning:/etc/grafana/provisioning:ro",
        "      - ../grafana/dashboards:/var/lib/grafana/dashboards/pd-proxy:ro",
        "      - grafana-data:/var/lib/grafana",
        "    depends_on:",
        "      - prometheus",
        "",
        "volumes:",
        "  prometheus-data: {}",
        "  grafana-data: {}",
        "",
    ]
    return "\n".join(lines)


def render_all(s: Settings) -> dict[str, str]:
    """Every generated file, keyed by its path relative to the compose directory."""
    endpoints = Endpoints(
        proxies=[local_url(s.proxy_bind, s.proxy_port)],
        prefill=[w.url for w in s.prefill],
        decode=[w.url for w in s.decode],
    )
    files = {COMPOSE_FILE: render_compose(s)}
    for name, text in render_targets(endpoints).items():
        files[f"{TARGETS_DIR}/{name}"] = text
    return files


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m deploy.render_compose", description="Render deploy/compose from its .env."
    )
    parser.add_argument("--env-file", type=Path, default=COMPOSE_DIR / ".env")
    parser.add_argument("--out-dir", type=Path, default=COMPOSE_DIR)
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 when a file is stale")
    args = parser.parse_args(argv)
    try:
        settings = settings_from_env(parse_env(args.env_file.read_text(encoding="utf-8")))
    except (OSError, SettingsError) as exc:
        print(f"render_compose: {exc}", file=sys.stderr)
        return 2
    stale = []
    for rel, text in render_all(settings).items():
        path = args.out_dir / rel
        current = path.read_text(encoding="utf-8") if path.exists() else None
        if current == text:
            continue
        if args.check:
            stale.append(str(path))
        else:
            write_atomic(path, text)
            print(f"wrote {path}")
    if stale:
        print("stale (run python -m deploy.render_compose): " + ", ".join(stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
