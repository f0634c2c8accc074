"""The body-cost benchmark: its two bodies carry the same request, one with an escape."""

from __future__ import annotations

import json

import pytest

from benchmarks.internals.body_cost import client_body, main, measure, worker_reply


def test_the_two_bodies_differ_by_an_escape() -> None:
    plain, escaped = client_body(16, escaped=False), client_body(16, escaped=True)
    assert b"\\u" not in plain and b"\\u" in escaped
    assert json.loads(plain)["token_ids"] == json.loads(escaped)["token_ids"]


def test_the_replies_are_what_a_worker_sends() -> None:
    prefill, decode = json.loads(worker_reply(1)), json.loads(worker_reply(32))
    assert prefill["kv_transfer_params"]["do_remote_prefill"] is True
    assert decode["kv_transfer_params"] is None and len(decode["choices"][0]["token_ids"]) == 32
    assert decode["usage"]["completion_tokens"] == 32


def test_it_reports_cpu_per_call_for_each_length_and_variant(capsys: pytest.CaptureFixture[str]) -> None:
    report = measure([8, 64], calls=3, rounds=2)
    for n in (8, 64):
        for variant in ("client_text", "escaped"):
            figures = report[f"{variant}_{n}_us_per_call"]
            assert len(figures) == 2 and all(f >= 0 for f in figures)
    for tokens in (1, 32, 256):
        assert len(report[f"reply_{tokens}_us_per_call"]) == 2
    assert main(["--prompt-lens", "8", "--calls", "2", "--rounds", "1"]) == 0
    assert "client_text_8_us_per_call" in json.loads(capsys.readouterr().out)
    with pytest.raises(SystemExit):
        main(["--prompt-lens", "0"])
