"""proxy.config.tenants: keys to tenants, constant-time identification, key files, and the CLI's sources."""

from __future__ import annotations

import hmac
from pathlib import Path
from typing import Any

import pytest

from proxy.cli import parse_args
from proxy.config.tenants import OPEN, Tenants, key_tag, read_key_file


def test_identify() -> None:
    t = Tenants([(None, "k1"), ("team-b", "k2")])
    assert t.enabled and t.namespaced and len(t) == 2
    a, b = t.identify("Bearer k1"), t.identify("bearer k2")
    assert a is not None and b is not None
    assert (a.tag, b.name) == (key_tag("k1"), "team-b") and a.tag != b.tag
    for header in (None, "", "k1", "Basic k1", "Bearer k3", "Bearer k1 ", "Bearer "):
        assert t.identify(header) is None, header
    single = Tenants([(None, "k1")])
    one = single.identify("Bearer k1")
    assert not single.namespaced and one is not None and one.tag == ""  # vLLM's behaviour: no namespace
    assert not Tenants([]).enabled and OPEN.tag == ""


def test_every_key_is_compared_every_time(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[Any, Any]] = []
    real = hmac.compare_digest

    def spy(a: Any, b: Any) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    t = Tenants([(None, "k1"), (None, "k2"), (None, "k3")])
    for header in ("Bearer k1", "Bearer nope", "Bearer a-much-longer-key-than-any"):
        calls.clear()
        t.identify(header)
        assert len(calls) == 3  # no early exit on a match
        assert all(len(a) == len(b) == 32 for a, b in calls)  # digests: no key length shows


def test_bad_key_sets() -> None:
    with pytest.raises(ValueError, match="empty"):
        Tenants([(None, "")])
    with pytest.raises(ValueError, match="twice"):
        Tenants([(None, "k"), ("x", "k")])


def test_key_file(tmp_path: Path) -> None:
    f = tmp_path / "keys"
    f.write_text("# tenants\n\nk1\nteam-b k2\n  team-c   k3  \n")
    assert read_key_file(f) == [(None, "k1"), ("team-b", "k2"), ("team-c", "k3")]
    f.write_text("a b c\n")
    with pytest.raises(ValueError, match=":1:"):
        read_key_file(f)


def test_cli_gathers_keys_from_flags_file_and_environment(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "keys"
    f.write_text("team-f kf\n")
    monkeypatch.setenv("PD_PROXY_API_KEY", "ke")
    monkeypatch.setenv("PD_PROXY_API_KEYS", "kx, ky,")
    s = parse_args(["--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2",
                    "--api-key", "ka", "--api-key", "kb", "--api-key-file", str(f)])
    assert s.client_keys() == [(None, "ka"), (None, "kb"), ("team-f", "kf"), (None, "ke"), (None, "kx"),
                               (None, "ky")]
    monkeypatch.delenv("PD_PROXY_API_KEYS")
    with pytest.raises(SystemExit):  # the same key twice is an error at start-up
        parse_args(["--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2", "--api-key", "ke"])


@pytest.mark.parametrize("content", [None, b"\xff\xfe not text\n"])
def test_an_unreadable_key_file_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                  content: bytes | None) -> None:
    """A missing or undecodable --api-key-file ends start-up with the usage error naming the file
    (exit 2), not a traceback."""
    f = tmp_path / "keys"
    if content is not None:
        f.write_bytes(content)
    with pytest.raises(SystemExit) as e:
        parse_args(["--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2",
                    "--api-key-file", str(f)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"--api-key-file {f}: cannot read it" in err and "Traceback" not in err
