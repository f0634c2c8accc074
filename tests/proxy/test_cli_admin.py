"""``pd-proxy``'s admin flags: the admin key from ``PD_PROXY_ADMIN_KEY`` or ``--admin-key-file`` (one
source; never on the command line, where ``ps`` shows it), its own listener, and ``--help`` saying
which limits hold per process with ``--workers N``. Nothing listens here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from proxy.cli import parse_args

WORKERS = ["--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"]
ADMIN = "admin-key-Pq58"
CLIENT = "client-key-Tz04"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("PD_PROXY_ADMIN_KEY", "PD_PROXY_API_KEY", "PD_PROXY_API_KEYS"):
        monkeypatch.delenv(name, raising=False)


def refused(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    with pytest.raises(SystemExit) as e:
        parse_args([*WORKERS, *args])
    assert e.value.code == 2
    return capsys.readouterr().err


def test_admin_key_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse_args(WORKERS).pools.admin_key is None
    monkeypatch.setenv("PD_PROXY_ADMIN_KEY", ADMIN + "\n")  # a Secret's trailing newline
    assert parse_args(WORKERS).pools.admin_key == ADMIN


def test_admin_key_from_a_file(tmp_path: Path) -> None:
    f = tmp_path / "admin.key"
    f.write_text(f"  {ADMIN}\n")
    assert parse_args([*WORKERS, "--admin-key-file", str(f)]).pools.admin_key == ADMIN


def test_admin_key_on_the_command_line_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    err = refused(capsys, "--admin-key", ADMIN)
    assert "ps" in err and "PD_PROXY_ADMIN_KEY" in err and "--admin-key-file" in err
    assert ADMIN not in err


def test_both_sources_are_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "admin.key"
    f.write_text(ADMIN)
    monkeypatch.setenv("PD_PROXY_ADMIN_KEY", "other-" + ADMIN)
    err = refused(capsys, "--admin-key-file", str(f))
    assert "not both" in err and ADMIN not in err


@pytest.mark.parametrize(("content", "why"), [("", "empty"), ("\n  \n", "empty"),
                                              (f"{ADMIN} second", "one word"),
                                              (f"{ADMIN}\n{ADMIN}", "one word")])
def test_a_bad_key_file_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str,
                                   why: str) -> None:
    f = tmp_path / "admin.key"
    f.write_text(content)
    err = refused(capsys, "--admin-key-file", str(f))
    assert why in err and ADMIN not in err


def test_a_missing_key_file_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert "cannot read" in refused(capsys, "--admin-key-file", str(tmp_path / "nope"))


def test_the_admin_key_must_not_be_a_client_key(monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("PD_PROXY_ADMIN_KEY", CLIENT)
    monkeypatch.setenv("PD_PROXY_API_KEYS", f"{CLIENT},other-{CLIENT}")
    err = refused(capsys)
    assert "also a client API key" in err and CLIENT not in err


def test_admin_listener_flags(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    assert "needs an admin key" in refused(capsys, "--admin-port", "9000")
    monkeypatch.setenv("PD_PROXY_ADMIN_KEY", ADMIN)
    s = parse_args([*WORKERS, "--admin-port", "9000"])
    assert (s.pools.admin_host, s.pools.admin_port) == ("127.0.0.1", 9000)  # loopback by default
    s = parse_args([*WORKERS, "--admin-host", "10.0.0.5", "--admin-port", "0"])
    assert (s.pools.admin_host, s.pools.admin_port) == ("10.0.0.5", 0)
    assert "--admin-host needs --admin-port" in refused(capsys, "--admin-host", "10.0.0.5")
    assert "must differ from --port" in refused(capsys, "--port", "9000", "--admin-port", "9000")
    assert "0..65535" in refused(capsys, "--admin-port", "70000")


def test_help_says_which_limits_are_per_process(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    text = re.sub(r"\s+", " ", capsys.readouterr().out.partition("options:")[2])  # past the usage
    assert "--admin-key-file" in text and "PD_PROXY_ADMIN_KEY" in text and "--admin-port" in text
    assert "--admin-key " not in text.replace("--admin-key-file", "")  # not offered
    for flag in ("--max-inflight ", "--max-inflight-per-worker", "--max-queue"):
        at = text.index(flag)
        assert "PER PROCESS" in text[at:at + 200], flag
    at = text.index("--workers N")
    assert "PER PROCESS" in text[at:at + 300] and "Admin changes reach every process" in text[at:at + 300]
