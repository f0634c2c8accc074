"""``--first-token-from-prefill on|off``: off by default, on the command line or in a config file."""

from __future__ import annotations

from pathlib import Path

import pytest

from proxy.cli import parse_args

P1, D1 = "http://127.0.0.1:8101", "http://127.0.0.1:8201"


def test_first_token_from_prefill_is_on_unless_turned_off() -> None:
    base = ["--prefill", P1, "--decode", D1]
    assert parse_args(base).first_token_from_prefill is True
    assert parse_args([*base, "--first-token-from-prefill", "on"]).first_token_from_prefill is True
    assert parse_args([*base, "--first-token-from-prefill", "off"]).first_token_from_prefill is False


@pytest.mark.parametrize(("value", "on"), [("on", True), ("off", False), ("true", True), ("false", False)])
def test_first_token_from_prefill_in_the_config_file(tmp_path: Path, value: str, on: bool) -> None:
    """YAML reads a bare ``on`` / ``off`` as a boolean: both spellings work."""
    f = tmp_path / "pd.yaml"
    f.write_text(f"prefill: {P1}\ndecode: {D1}\nfirst-token-from-prefill: {value}\n")
    assert parse_args(["--config", str(f)]).first_token_from_prefill is on


def test_a_bad_value_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--prefill", P1, "--decode", D1, "--first-token-from-prefill", "maybe"])
    assert "--first-token-from-prefill" in capsys.readouterr().err
