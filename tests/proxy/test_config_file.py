"""proxy.config.config_file: ``--config FILE`` (YAML, keys the long flag names, as ``vllm serve --config``):
flags win over the file, a bad file is a clear error, secrets are never read from it."""

from __future__ import annotations

from pathlib import Path

import pytest

from proxy.cli import parse_args

P1, P2, P3 = "http://127.0.0.1:8101", "http://127.0.0.1:8102", "http://127.0.0.1:8103"
D1 = "http://127.0.0.1:8201"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "pd-proxy.yaml"
    path.write_text(text)
    return path


CONFIG = f"""
# what `vllm serve --config` takes: long flag names as keys
prefill: [{P1}, {P2}]
decode: {D1}
decode-timeout: 900
stream_idle_timeout: 45.5        # underscores as well
prefill-policy: prefix
no-active-health: true
no-migrate: false
k8s-endpointslices: ["decode:serving:pd-proxy.io/pool=decode:http"]
log-format: json
"""


def test_settings_come_from_the_file(tmp_path: Path) -> None:
    s = parse_args(["--config", str(write(tmp_path, CONFIG))])
    assert s.prefill_urls == (P1, P2) and s.decode_urls == (D1,)
    assert s.decode_timeout == 900.0 and s.stream_idle_timeout == 45.5 and s.log_format == "json"
    assert s.pools.prefill_policy == "prefix" and s.pools.active_health is False and s.pools.migrate
    assert [k.namespace for k in s.pools.k8s] == ["serving"]
    assert s.prefill_timeout == 300.0  # not in the file: the flag's default


def test_flags_override_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, CONFIG)
    s = parse_args(["--decode-timeout", "5", "--config", str(path), "--prefill", P3, "--prefill-pol",
                    "round_robin"])
    assert s.decode_timeout == 5.0
    assert s.prefill_urls == (P3,)  # the file's list is replaced, not extended
    assert s.pools.prefill_policy == "round_robin"  # an abbreviated flag counts too
    assert s.decode_urls == (D1,) and s.stream_idle_timeout == 45.5


def parse_error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exit_:
        parse_args(argv)
    assert exit_.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("decode-timeoot: 5\n", "unknown setting 'decode-timeoot' (did you mean decode-timeout?)"),
        ("prefill: [a\n", "is not valid YAML"),
        ("- --prefill\n- x\n", "must be a mapping of flag names to values"),
        ("no-active-health: yes please\n", "no-active-health is a switch: true or false"),
        ("decode-timeout: soon\n", "argument --decode-timeout: invalid float value: 'soon'"),
        ("port: [1, 2]\n", "port takes one value, got 2"),
        ("prefill-policy: fastest\n", "argument --prefill-policy: invalid choice: 'fastest'"),
        ("config: other.yaml\n", "a config file cannot name another one"),
        ("decode: ~\n", "decode has no value"),
    ],
)
def test_a_bad_file_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str,
                                     message: str) -> None:
    err = parse_error(capsys, ["--prefill", P1, "--config", str(write(tmp_path, text))])
    assert message in err and err.startswith("usage: pd-proxy")


@pytest.mark.parametrize(("key", "where"), [("api-key", "PD_PROXY_API_KEY"), ("api_key", "--api-key-file"),
                                            ("upstream-api-key", "PD_PROXY_UPSTREAM_API_KEY"),
                                            ("admin-key", "PD_PROXY_ADMIN_KEY")])
def test_secrets_are_refused_in_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str], key: str,
                                         where: str) -> None:
    path = write(tmp_path, f"prefill: {P1}\ndecode: {D1}\n{key}: file-secret-Hy34\n")
    err = parse_error(capsys, ["--config", str(path)])
    assert "is a secret and is not read from a config file" in err and where in err
    assert "file-secret-Hy34" not in err


def test_a_missing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = parse_error(capsys, ["--config", str(tmp_path / "nope.yaml")])
    assert "cannot read the config file" in err


def test_an_empty_file_and_keys_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PD_PROXY_API_KEY", "client-key-Lm55")
    s = parse_args(["--config", str(write(tmp_path, "# nothing yet\n")), "--prefill", P1, "--decode", D1])
    assert s.client_keys() == [(None, "client-key-Lm55")]
