"""proxy.config.table: every setting is declared once, on its dataclass field, and its flag, its
``--config`` key, its environment variables and its field agree. Each test goes through the parser
``pd-proxy`` uses; nothing listens."""

from __future__ import annotations

import argparse
import logging
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args, get_origin

import pytest
import yaml

from proxy import cli
from proxy.config.config_file import with_config_file
from proxy.config.settings import ProxySettings
from proxy.config.table import Row, argument, rows, settings_from_args, table
from proxy.pools import PoolSettings
from proxy.pools.options import K8sSelector
from proxy.pools.setting import setting

ADMIN = "admin-key-Base71"
ENV = {"PD_PROXY_ADMIN_KEY": ADMIN}
"""The admin key lets the settings start with no workers, so that each row can be tried alone."""


def settings(argv: list[str], env: dict[str, str] = ENV) -> ProxySettings:
    p = cli.build_parser()
    return settings_from_args(p.parse_args(with_config_file(p, argv)), env)


def field_value(s: ProxySettings, row: Row) -> Any:
    return getattr(s.pools if row.owner is PoolSettings else s, row.name)


def test_every_setting_is_one_row_and_one_flag() -> None:
    names = [row.name for row in table()]
    assert len(names) == len(set(names))  # the parsed values are keyed by field name
    keys = [row.key.replace("_", "-") for row in table()]
    assert len(keys) == len(set(keys))
    parser = cli.build_parser()
    key_files = {row.spec.key_file[0] for row in table() if row.spec.key_file}
    by_dest = {a.dest: a for a in parser._actions if a.dest not in ("help", "config")
               and not set(a.option_strings) & key_files}
    assert sorted(by_dest) == sorted(names)  # no flag outside the table, no row without its flag
    for row in table():
        assert by_dest[row.name].option_strings == [row.option]


def sample(row: Row) -> tuple[list[str], Any, Any]:
    """A value for the row other than its default: (command-line values, YAML value, field value)."""
    if row.kind == "switch":
        return [], True, True
    if row.kind == "off-switch":
        return [], True, False
    if row.kind == "on-off":
        return ["off"], "off", False
    if row.name == "k8s":
        return ["decode:ns:app=x:80"], ["decode:ns:app=x:80"], (K8sSelector("decode", "ns", "app=x", 80),)
    if row.name == "kv_events":
        return ["tcp://127.0.0.1:9"], ["tcp://127.0.0.1:9"], ("tcp://127.0.0.1:9",)
    if row.kind == "list":
        return ["http://127.0.0.1:9"], ["http://127.0.0.1:9"], ("http://127.0.0.1:9",)
    hint = row.hint
    if isinstance(hint, types.UnionType):  # X | None
        hint = next(t for t in get_args(hint) if t is not type(None))
    if row.spec.choices or get_origin(hint) is not None:
        choice = next(c for c in (row.spec.choices or get_args(hint)) if c != row.default)
        return [choice], choice, choice
    if hint is Path:
        return ["/tmp/sample"], "/tmp/sample", Path("/tmp/sample")
    if hint in (int, float):
        n = (row.default or 0) + (3 if hint is int else 0.5)
        return [str(n)], n, n
    return ["sample-value"], "sample-value", "sample-value"


NEEDS = {"admin_host": ["--admin-port", "9"], "kv_events": ["--prefill", "http://127.0.0.1:1"]}
"""Flags a row is only taken with."""
PLAIN = [row for row in table() if row.spec.resolve is None or row.name in NEEDS]


@pytest.mark.parametrize("row", PLAIN, ids=[row.option for row in PLAIN])
def test_the_flag_and_the_config_key_set_the_field(row: Row, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    values, in_file, expected = sample(row)
    assert expected != row.default
    assert field_value(settings([*NEEDS.get(row.name, []), row.option, *values]), row) == expected
    for key in (row.key, row.key.replace("-", "_")):
        path = tmp_path / f"{key}.yaml"
        path.write_text(yaml.safe_dump({key: in_file}))
        if row.spec.secret:
            with pytest.raises(SystemExit):
                settings(["--config", str(path)])
            assert f"{row.key} is a secret" in capsys.readouterr().err
        else:
            assert field_value(settings([*NEEDS.get(row.name, []), "--config", str(path)]), row) == expected


SECRETS = [row for row in table() if row.spec.secret]


@pytest.mark.parametrize("row", SECRETS, ids=[row.option for row in SECRETS])
def test_a_secret_is_read_from_its_environment_never_from_the_file(
        row: Row, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert row.spec.env
    for name in row.spec.env:
        assert name in row.spec.help or (row.spec.key_file and name in row.spec.key_file[1])
        value = field_value(settings([], {**ENV, name: "env-key-Vb27"}), row)
        assert "env-key-Vb27" in (value if isinstance(value, str) else str(value))
    path = tmp_path / "pd.yaml"
    path.write_text(f"{row.key}: file-key-Hy34\n")
    with pytest.raises(SystemExit):
        settings(["--config", str(path)])
    err = capsys.readouterr().err
    assert "is not read from a config file" in err and row.instead in err and "file-key-Hy34" not in err


def test_a_key_on_the_command_line_is_pointed_where_it_is_read(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The warning names only sources pd-proxy reads the key from (a config file refuses it)."""
    monkeypatch.setattr(cli, "serve", lambda settings, sock=None: None)
    with caplog.at_level(logging.WARNING):
        cli.main(["--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2",
                  "--upstream-api-key", "flag-key-Ab12"])
    (message,) = [r.getMessage() for r in caplog.records if "on the command line" in r.getMessage()]
    assert "PD_PROXY_UPSTREAM_API_KEY" in message and "config file" not in message


@dataclass(frozen=True, slots=True)
class _Demo:
    speed: float = setting(1.5, "how fast, in 100% units")
    slow: bool = setting(True, "go fast", flag="--no-slow")


def test_one_field_is_one_flag_with_its_default_and_help() -> None:
    parser = argparse.ArgumentParser()
    for row in rows(_Demo):
        parser.add_argument(row.option, **argument(row))
    help_text = " ".join(parser.format_help().split())
    assert "--speed SPEED how fast, in 100% units" in help_text and "--no-slow go fast" in help_text
    assert vars(parser.parse_args([])) == {"speed": 1.5, "slow": True}
    assert vars(parser.parse_args(["--speed", "2", "--no-slow"])) == {"speed": 2.0, "slow": False}
