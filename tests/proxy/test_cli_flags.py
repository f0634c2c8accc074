"""``pd-proxy``'s command line: worker flags given either way, every flag documented with its default."""

from __future__ import annotations

import pytest

from proxy.cli import parse_args

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
    from proxy.metrics import ProxyMetrics  # noqa: PLC0415
    from proxy.serving import Serving  # noqa: PLC0415

    serving = Serving(parse_args(["--prefill", P1, "--prefill", P2, "--decode", D1, "--decode", D2]),
                      ProxyMetrics())
    assert [w.url for w in serving.prefill_pool] == [P1, P2]
    assert [w.url for w in serving.decode_pool] == [D1, D2]
