"""``pd-proxy``'s command line: worker flags given either way, every flag documented with its default,
secrets from the environment (``--config FILE``: ``test_config_file.py``)."""

from __future__ import annotations

import pytest

from proxy.cli import build_parser, parse_args

P1, P2, P3 = "http://127.0.0.1:8101", "http://127.0.0.1:8102", "http://127.0.0.1:8103"
D1, D2 = "http://127.0.0.1:8201", "http://127.0.0.1:8202"


@pytest.mark.parametrize(
    "argv",
    [
        ["--prefill", P1, "--prefill", P2, "--prefill", P3, "--decode", D1, "--decode", D2],  # vllm-router
        ["--prefill", P1, P2, P3, "--decode", D1, D2],  # space-separated
        ["--prefill", P1, P2, "--decode", D1, "--prefill", P3, "--decode", D2],  # both, interleaved
    ],
)
def test_worker_flags_repeated_or_space_separated_keep_every_url(argv: list[str]) -> None:
    s = parse_args(argv)
    assert s.prefill_urls == (P1, P2, P3)
    assert s.decode_urls == (D1, D2)


def test_repeated_worker_flags_reach_the_pools() -> None:
    from proxy.http.serving import Serving  # noqa: PLC0415
    from proxy.observe.metrics import ProxyMetrics  # noqa: PLC0415

    serving = Serving(parse_args(["--prefill", P1, "--prefill", P2, "--decode", D1, "--decode", D2]),
                      ProxyMetrics())
    assert [w.url for w in serving.prefill_pool] == [P1, P2]
    assert [w.url for w in serving.decode_pool] == [D1, D2]


# --------------------------------------------------------------------------- --help


def test_every_flag_has_a_help_line_and_shows_its_default() -> None:
    parser = build_parser()
    formatter = parser._get_formatter()
    missing = []
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        text = formatter._expand_help(action) if action.help else ""
        if not action.help or "default" not in text:
            missing.append(action.option_strings[-1])
    assert missing == []


def test_help_output_names_defaults(capsys: pytest.CaptureFixture[str],
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PD_PROXY_UPSTREAM_API_KEY", "upstream-secret-Zr81")
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--help"])
    assert exit_.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    for fragment in ("--decode-timeout DECODE_TIMEOUT seconds a whole non-streaming decode hop may take "
                     "(default: 600.0)", "--host HOST address to listen on (default: 127.0.0.1)",
                     "--no-active-health no active probes: breakers and draining only (default: off)",
                     "--config FILE"):
        assert fragment in out
    assert "upstream-secret-Zr81" not in out  # a default read from the environment is never shown


def test_secrets_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PD_PROXY_UPSTREAM_API_KEY", "upstream-secret-Zr81")
    monkeypatch.setenv("PD_PROXY_ADMIN_KEY", "admin-secret-Kq20")
    s = parse_args(["--prefill", P1, "--decode", D1])
    assert s.upstream_api_key == "upstream-secret-Zr81" and s.pools.admin_key == "admin-secret-Kq20"
    s = parse_args(["--prefill", P1, "--decode", D1, "--upstream-api-key", "flag-key-Ab12"])
    assert s.upstream_api_key == "flag-key-Ab12"


def test_max_model_len_reaches_the_pools() -> None:
    from proxy.http.serving import Serving  # noqa: PLC0415
    from proxy.observe.metrics import ProxyMetrics  # noqa: PLC0415

    s = parse_args(["--prefill", P1, "--decode", D1, "--max-model-len", "4096"])
    assert s.max_model_len == 4096 and parse_args(["--prefill", P1, "--decode", D1]).max_model_len is None
    pools = Serving(s, ProxyMetrics()).pools
    assert pools.one_token_left(4095) and not pools.one_token_left(4094)
