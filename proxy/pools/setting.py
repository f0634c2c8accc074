"""How one setting of pd-proxy is declared: a field of ``PoolSettings`` or ``ProxySettings`` whose
default is ``setting(default, help, ...)``. The field is the one row of the setting: its name, type
and default; the ``Flag`` in its metadata gives the rest. ``proxy.config.table`` derives from the rows
the command line's flags, the ``--config`` file's keys (the long flag names), the environment variables,
``--help`` and the value each field gets. (It sits here, below ``proxy.config``, because
``PoolSettings`` is declared with it.)"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")

SETTING = "pd_proxy.setting"
"""The key of a field's metadata holding its ``Flag``."""

Resolve = Callable[[argparse.Namespace, Mapping[str, str]], Any]


@dataclass(frozen=True, slots=True)
class Flag:
    """One setting's command-line side. A field with no ``Flag`` is not a setting of the CLI."""

    help: str
    """``--help``'s line (plain text; the default is added after it unless it says ``(default``);
    ``argparse.SUPPRESS`` hides the flag."""
    flag: str = ""
    """The long flag, ``--`` and the field's name with dashes unless given. A bool field whose flag
    starts with ``--no-`` is a switch that turns it off; a bool field on by default otherwise takes
    ``on|off``; one off by default is a switch that turns it on."""
    metavar: str | None = None
    choices: tuple[str, ...] = ()
    """The values taken (a ``Literal`` field's own values unless given)."""
    parse: Callable[[str], Any] | None = None
    """Turns one command-line value into the field's (or its items'); default: the field's type."""
    nargs: str | None = None
    """A tuple field: ``"+"`` takes several values per flag; else one per flag, the flag repeated."""
    env: tuple[str, ...] = ()
    """Environment variables the value may come from: read when the flag is not given (or by
    ``resolve``); each is named in ``help``."""
    secret: bool = False
    """Never read from a ``--config`` file (refused, naming ``env`` and ``key_file`` instead); on the
    command line, a warning that ``ps`` shows it."""
    key_file: tuple[str, str] | None = None
    """(flag, help) of a flag naming a file the value is read from, for ``resolve``."""
    resolve: Resolve | None = None
    """The field's value from all the parsed flags and the environment, when it is more than its own
    flag's value (the flag's own default is then None, or an empty list: not given)."""
    convert: Callable[[Any], Any] | None = None
    """Turns the flag's parsed value into the field's (e.g. 0 into None)."""


def setting(default: T, help: str, *, flag: str = "", metavar: str | None = None,
            choices: tuple[str, ...] = (), parse: Callable[[str], Any] | None = None,
            nargs: str | None = None, env: tuple[str, ...] = (), secret: bool = False,
            key_file: tuple[str, str] | None = None, resolve: Resolve | None = None,
            convert: Callable[[Any], Any] | None = None) -> T:
    """A dataclass field's default that declares the field a setting (the keywords: ``Flag``'s)."""
    return field(default=default, metadata={SETTING: Flag(
        help, flag, metavar, choices, parse, nargs, env, secret, key_file, resolve, convert)})


def flag_of(metadata: Mapping[str, Any]) -> Flag | None:
    """The ``Flag`` of a field's metadata, None for a field that is not a setting."""
    found = metadata.get(SETTING)
    return found if isinstance(found, Flag) else None
