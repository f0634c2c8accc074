"""``pd-proxy --config FILE``: settings from a YAML file keyed by the long flag names, and ``--help``
with every default. Command-line flags win over the file, whole; secrets are never read from it."""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from proxy.config.table import secret_keys

CONFIG_FLAG = "--config"

_HELP_FLAGS = ("-h", "--help")
SWITCHES = (argparse._StoreTrueAction, argparse._StoreFalseAction)
"""Flags that take no value: ``--x`` sets a setting, ``--no-x`` clears one; off unless given."""


class ConfigFileError(ValueError):
    """The file cannot be read, is not a mapping, or names a setting pd-proxy cannot take from it."""


class HelpFormatter(argparse.HelpFormatter):
    """argparse's help with each flag's default; never a secret read from the environment."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "%(default)" in text or "(default" in text or action.default is argparse.SUPPRESS \
                or not action.option_strings:
            return text
        if isinstance(action, SWITCHES):
            shown = "off"
        elif action.default is None or action.default == []:
            shown = "none"
        else:
            shown = "%(default)s"
        return f"{text} (default: {shown})" if text else f"(default: {shown})"


def long_flags(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {opt[2:]: action for action in parser._actions for opt in action.option_strings
            if opt.startswith("--")}


def load(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigFileError(f"cannot read the config file {path}: {e.strerror or e}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigFileError(f"the config file {path} is not valid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict) or not all(isinstance(k, str) for k in data):
        raise ConfigFileError(f"the config file {path} must be a mapping of flag names to values")
    return data


def _tokens(flag: str, action: argparse.Action, value: Any, path: Path) -> list[str]:
    """``--flag=value`` tokens, so that a value starting with a dash stays a value."""
    if isinstance(action, SWITCHES):
        if not isinstance(value, bool):
            raise ConfigFileError(f"{path}: {flag[2:]} is a switch: true or false, got {value!r}")
        return [flag] if value else []
    if value is None:
        raise ConfigFileError(f"{path}: {flag[2:]} has no value")
    several = action.nargs in ("+", "*") or isinstance(action, argparse._AppendAction)
    values = value if isinstance(value, list) else [value]
    if not several and len(values) != 1:
        raise ConfigFileError(f"{path}: {flag[2:]} takes one value, got {len(values)}")
    for v in values:
        if isinstance(v, (dict, list)) or v is None:
            raise ConfigFileError(f"{path}: {flag[2:]} takes plain values, got {v!r}")
    return [f"{flag}={str(v).lower() if isinstance(v, bool) else v}" for v in values]


def file_argv(parser: argparse.ArgumentParser, data: Mapping[str, Any], path: Path,
              given: set[str]) -> list[str]:
    """Tokens for every setting of the file whose dest is not in ``given``."""
    flags = long_flags(parser)
    secrets = secret_keys()
    out: list[str] = []
    for raw_key, value in data.items():
        key = raw_key.strip().lstrip("-").replace("_", "-")
        if key in secrets:
            raise ConfigFileError(f"{path}: {key} is a secret and is not read from a config file: "
                                  f"give it in {secrets[key]}")
        if key == CONFIG_FLAG[2:]:
            raise ConfigFileError(f"{path}: a config file cannot name another one ({key})")
        action = flags.get(key)
        if action is None or key in ("help",):
            close = difflib.get_close_matches(key, [k for k in flags if k not in secrets], n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ConfigFileError(f"{path}: unknown setting {raw_key!r}{hint}; the keys are pd-proxy's "
                                  "long flag names (pd-proxy --help)")
        if action.dest in given:
            continue  # the command line wins
        out += _tokens(f"--{key}", action, value, path)
    return out


def _given(parser: argparse.ArgumentParser, argv: Sequence[str]) -> set[str]:
    """The dests the command line sets (every default hidden for one parse)."""
    saved = [(a, a.default) for a in parser._actions]
    try:
        for action in parser._actions:
            action.default = argparse.SUPPRESS
        namespace, _ = parser.parse_known_args(list(argv))
    finally:
        for action, default in saved:
            action.default = default
    return set(vars(namespace))


def with_config_file(parser: argparse.ArgumentParser, argv: Sequence[str]) -> list[str]:
    """``argv`` with its ``--config FILE``'s settings in front; a bad file is a parser error."""
    argv = list(argv)
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument(CONFIG_FLAG, type=Path, default=None)
    known, _ = pre.parse_known_args(argv)
    path: Path | None = known.config
    if path is None or any(a in _HELP_FLAGS for a in argv):
        return argv
    try:
        return [*file_argv(parser, load(path), path, _given(parser, argv)), *argv]
    except ConfigFileError as e:
        parser.error(str(e))
