"""proxy.http.sockets: the listening socket every ``--workers`` child binds to the same port."""

from __future__ import annotations

import socket

import pytest

from proxy.http.sockets import reuseport_socket


def test_reuseport_sockets_share_one_port() -> None:
    a = reuseport_socket("127.0.0.1", 0)
    try:
        port = a.getsockname()[1]
        b = reuseport_socket("127.0.0.1", port)
        try:
            a.listen(8)
            b.listen(8)
            assert b.getsockname()[1] == port
        finally:
            b.close()
        # a plain socket (no SO_REUSEPORT) cannot take the port meanwhile
        with socket.socket() as c, pytest.raises(OSError):
            c.bind(("127.0.0.1", port))
    finally:
        a.close()


def test_a_socket_that_cannot_bind_is_closed_and_the_error_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[socket.socket] = []
    real = socket.socket

    def recording(*args: object) -> socket.socket:
        s = real(*args)  # type: ignore[arg-type]
        made.append(s)
        return s

    with socket.socket() as taken:  # no SO_REUSEPORT: the port is not shared
        taken.bind(("127.0.0.1", 0))
        monkeypatch.setattr(socket, "socket", recording)
        with pytest.raises(OSError):
            reuseport_socket("127.0.0.1", taken.getsockname()[1])
    assert len(made) == 1 and made[0].fileno() == -1
