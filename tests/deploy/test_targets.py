"""deploy/targets.py: the file-based service discovery the scrape config reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deploy.targets import Endpoints, host_port, target_groups, write_targets


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("http://127.0.0.1:8100", "127.0.0.1:8100"),
        ("http://127.0.0.1:8100/", "127.0.0.1:8100"),
        ("https://worker-0.pd.svc:8000", "worker-0.pd.svc:8000"),
        ("http://[::1]:9000", "[::1]:9000"),
    ],
)
def test_host_port(url: str, expected: str) -> None:
    assert host_port(url) == expected


@pytest.mark.parametrize("url", ["127.0.0.1:8100", "http://127.0.0.1", "ftp://h:1", "http://:80"])
def test_host_port_refuses_what_prometheus_cannot_scrape(url: str) -> None:
    with pytest.raises(ValueError, match="expected http://host:port"):
        host_port(url)


def test_workers_carry_pool_and_worker_labels_and_the_proxy_none() -> None:
    groups = target_groups(
        Endpoints(
            ["http://127.0.0.1:8000"], ["http://127.0.0.1:8100/"], ["http://127.0.0.1:8200", "http://h:8201"]
        )
    )
    assert groups["proxy.json"] == [{"targets": ["127.0.0.1:8000"], "labels": {}}]
    assert [(g["targets"], g["labels"]) for g in groups["workers.json"]] == [
        (["127.0.0.1:8100"], {"pool": "prefill", "worker": "http://127.0.0.1:8100"}),
        (["127.0.0.1:8200"], {"pool": "decode", "worker": "http://127.0.0.1:8200"}),
        (["h:8201"], {"pool": "decode", "worker": "http://h:8201"}),
    ]


def test_write_targets_replaces_files_whole(tmp_path: Path) -> None:
    first = Endpoints(["http://127.0.0.1:8000"], ["http://127.0.0.1:8100"], ["http://127.0.0.1:8200"])
    write_targets(tmp_path, first)
    second = Endpoints(["http://127.0.0.1:8000"], ["http://127.0.0.1:8100"], ["http://127.0.0.1:8300"])
    paths = write_targets(tmp_path, second)
    assert sorted(p.name for p in paths) == ["proxy.json", "workers.json"]
    workers = json.loads((tmp_path / "workers.json").read_text())
    assert [g["targets"] for g in workers] == [["127.0.0.1:8100"], ["127.0.0.1:8300"]]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["proxy.json", "workers.json"]  # no temp files left
