"""``benchmarks/internals/server_floor.py``: every server mode answers every request of the load
with the fixed reply (the run itself is measured by hand; numbers in benchmarks/README.md)."""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks.internals import server_floor
from proxy.http.lean import LeanApplication


class _Transport:
    def __init__(self) -> None:
        self.written: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.written.append(data)


def _request() -> bytes:
    return (b"POST /inference/v1/generate HTTP/1.1\r\nHost: x\r\nContent-Length: "
            + str(len(server_floor.BODY)).encode() + b"\r\n\r\n" + server_floor.BODY)


def test_the_bare_server_answers_pipelined_and_split_requests_once_each() -> None:
    proto = server_floor.Bare()
    transport = _Transport()
    proto.connection_made(transport)  # type: ignore[arg-type]
    one = _request()
    proto.data_received(one + one[:40])  # one whole request, the next one's head cut
    assert len(transport.written) == 1
    proto.data_received(one[40:-1])  # all but the body's last byte
    assert len(transport.written) == 1
    proto.data_received(one[-1:])
    assert len(transport.written) == 2
    for answer in transport.written:
        assert answer.startswith(b"HTTP/1.1 200 OK\r\n")
        assert answer.endswith(b"\r\n\r\n" + server_floor.REPLY)
    assert proto.buf == b""


def test_the_lean_mode_is_pd_proxys_front() -> None:
    assert isinstance(server_floor.aiohttp_app("lean"), LeanApplication)
    assert not isinstance(server_floor.aiohttp_app("full"), LeanApplication)


@pytest.mark.parametrize("mode", server_floor.MODES)
def test_each_mode_answers_every_request_of_a_load(mode: str) -> None:
    # ``measure`` raises when an answer is not a 200 with the reply
    cpu, rate = server_floor.measure(mode, 200, 4)
    assert cpu >= 0
    assert rate > 0


@pytest.mark.parametrize(("argv", "said"), [(["--modes", "lean,fast"], "unknown modes: fast"),
                                            (["--requests", "0"], "--requests 1..1000000"),
                                            (["--concurrency", "5000"], "--concurrency 1..1024")])
def test_bad_arguments_are_refused(argv: list[str], said: str, capsys: Any) -> None:
    with pytest.raises(SystemExit) as e:
        server_floor.main(argv)
    assert e.value.code == 2
    assert said in capsys.readouterr().err
