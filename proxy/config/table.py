"""The settings' table: each ``setting(...)`` field of ``ProxySettings`` and ``PoolSettings`` is one
row, from which come the flags, config keys, secrets, environment variables and the settings."""

from __future__ import annotations

import argparse
import types
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from proxy.config.settings import ProxySettings
from proxy.pools import PoolSettings
from proxy.pools.setting import Flag, flag_of

Kind = Literal["switch", "off-switch", "on-off", "list", "value"]
POOLS_GROUP = "pools"


@dataclass(frozen=True, slots=True)
class Row:

    owner: type
    name: str
    hint: Any
    default: Any
    spec: Flag

    @property
    def option(self) -> str:
        """The long flag; its dest is the field's name."""
        return self.spec.flag or "--" + self.name.replace("_", "-")

    @property
    def key(self) -> str:
        """Its key in a ``--config`` file (``_`` for ``-`` is taken too: ``proxy.config.config_file``)."""
        return self.option[2:]

    @property
    def kind(self) -> Kind:
        if self.hint is bool:
            if self.option.startswith("--no-"):
                return "off-switch"
            return "on-off" if self.default else "switch"
        return "list" if get_origin(self.hint) is tuple else "value"

    @property
    def instead(self) -> str:
        """A secret: where it comes from instead of the command line or a config file."""
        sources = [*self.spec.env, *([self.spec.key_file[0]] if self.spec.key_file else [])]
        return " or ".join([", ".join(sources[:-1]), sources[-1]] if len(sources) > 1 else sources)


def rows(owner: type) -> tuple[Row, ...]:
    """The settings of one dataclass, in its fields' (and ``--help``'s) order."""
    hints = get_type_hints(owner)
    return tuple(Row(owner, f.name, hints[f.name], f.default, spec)
                 for f in fields(owner) if (spec := flag_of(f.metadata)) is not None)


def table() -> tuple[Row, ...]:
    return (*rows(ProxySettings), *rows(PoolSettings))


def _plain(hint: Any) -> Any:
    if get_origin(hint) in (Union, types.UnionType):
        return next(t for t in get_args(hint) if t is not type(None))
    return hint


def on_off(value: str) -> str:
    """A config file's YAML reads a bare ``on`` as true, so true/false are taken as on/off."""
    return {"true": "on", "false": "off"}.get(value.lower(), value.lower())


def argument(row: Row) -> dict[str, Any]:
    s = row.spec
    kw: dict[str, Any] = {"dest": row.name,
                          "help": s.help if s.help == argparse.SUPPRESS else s.help.replace("%", "%%")}
    kind = row.kind
    if kind == "switch":
        return {**kw, "action": "store_true"}
    if kind == "off-switch":
        return {**kw, "action": "store_false"}
    if kind == "on-off":
        return {**kw, "type": on_off, "choices": ["on", "off"], "default": "on"}
    item = _plain(get_args(row.hint)[0] if kind == "list" else row.hint)
    choices = s.choices or (get_args(item) if get_origin(item) is Literal else ())
    kw.update(type=s.parse or (item if item in (int, float, Path) else None),
              metavar=s.metavar or (None if choices else row.key.replace("-", "_").upper()))
    if choices:
        kw["choices"] = list(choices)
    if kind == "list":
        return {**kw, "default": [], "action": "extend" if s.nargs else "append",
                **({"nargs": s.nargs} if s.nargs else {})}
    return {**kw, "default": None if s.resolve else row.default}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Every setting's flag; ``PoolSettings``' in their own group."""
    pools = parser.add_argument_group(POOLS_GROUP)
    for row in table():
        target = pools if row.owner is PoolSettings else parser
        target.add_argument(row.option, **argument(row))
        if row.spec.key_file is not None:
            flag, text = row.spec.key_file
            target.add_argument(flag, type=Path, default=None, metavar="PATH", help=text)


def value(row: Row, a: argparse.Namespace, env: Mapping[str, str]) -> Any:
    s = row.spec
    if s.resolve is not None:
        return s.resolve(a, env)
    v = getattr(a, row.name)
    if row.kind == "on-off":
        v = v == "on"
    elif row.kind == "list":
        v = tuple(v)
    for name in s.env:
        if v is None or v == "":
            v = env.get(name)
    return v if s.convert is None else s.convert(v)


def settings_from_args(a: argparse.Namespace, env: Mapping[str, str]) -> ProxySettings:
    """The settings from the parsed flags and the environment; ``ValueError`` for a bad value."""
    proxy = {row.name: value(row, a, env) for row in rows(ProxySettings)}
    pools = PoolSettings(**{row.name: value(row, a, env) for row in rows(PoolSettings)})
    return ProxySettings(**proxy, pools=pools)


def secret_keys() -> dict[str, str]:
    return {row.key: row.instead for row in table() if row.spec.secret}


def secret_flags() -> tuple[tuple[str, str], ...]:
    """Flags that take a secret on the command line, each with where it belongs instead."""
    return tuple((row.option, row.instead) for row in table()
                 if row.spec.secret and row.spec.help != argparse.SUPPRESS)
