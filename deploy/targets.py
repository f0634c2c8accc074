"""Prometheus file-based service discovery for pd-proxy and its workers.

``deploy/prometheus/prometheus.yml`` reads two files next to it, ``targets/proxy.json`` and
``targets/workers.json``; this module writes them for the local stack and the compose renderer.
Each worker target carries the labels ``pool`` (``prefill`` | ``decode``) and ``worker`` (the URL the
proxy knows it by), so dashboards can join the workers' own metrics with the proxy's per-worker ones.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final
from urllib.parse import urlsplit

DEPLOY_DIR: Final = Path(__file__).resolve().parent
SCRAPE_CONFIG: Final = DEPLOY_DIR / "prometheus" / "prometheus.yml"
ALERT_RULES: Final = DEPLOY_DIR / "prometheus" / "alerts.yml"
"""The alert rules ``SCRAPE_CONFIG`` loads (``rule_files``, next to it)."""
DASHBOARDS_DIR: Final = DEPLOY_DIR / "grafana" / "dashboards"
PROXY_TARGETS: Final = "proxy.json"
WORKER_TARGETS: Final = "workers.json"

TargetGroup = dict[str, list[str] | dict[str, str]]


@dataclass(frozen=True)
class Endpoints:
    """Base URLs (``http://host:port``) of everything Prometheus should scrape."""

    proxies: Sequence[str]
    prefill: Sequence[str]
    decode: Sequence[str]
    extra_labels: Mapping[str, str] = field(default_factory=dict)


def host_port(url: str) -> str:
    """``http://127.0.0.1:8100/`` -> ``127.0.0.1:8100`` (the form Prometheus wants)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.port is None:
        raise ValueError(f"expected http://host:port, got {url!r}")
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"{host}:{parts.port}"


def target_groups(endpoints: Endpoints) -> dict[str, list[TargetGroup]]:
    """The contents of each targets file, keyed by file name."""
    proxy: list[TargetGroup] = [
        {"targets": [host_port(u)], "labels": dict(endpoints.extra_labels)} for u in endpoints.proxies
    ]
    workers: list[TargetGroup] = []
    for pool, urls in (("prefill", endpoints.prefill), ("decode", endpoints.decode)):
        for url in urls:
            labels = {**endpoints.extra_labels, "pool": pool, "worker": url.rstrip("/")}
            workers.append({"targets": [host_port(url)], "labels": labels})
    return {PROXY_TARGETS: proxy, WORKER_TARGETS: workers}


def render_targets(endpoints: Endpoints) -> dict[str, str]:
    """The targets files as text (stable formatting, so generated files diff cleanly)."""
    return {name: json.dumps(groups, indent=2) + "\n" for name, groups in target_groups(endpoints).items()}


def write_atomic(path: Path, text: str) -> None:
    """Replace ``path`` in one step: Prometheus never reads a half-written targets file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_targets(directory: Path, endpoints: Endpoints) -> list[Path]:
    """Write ``proxy.json`` and ``workers.json`` into ``directory``; returns their paths."""
    written = []
    for name, text in render_targets(endpoints).items():
        path = directory / name
        write_atomic(path, text)
        written.append(path)
    return written
