"""Listening sockets shared by several processes (``--workers N``: the main port and the admin
port, each bound by every child with ``SO_REUSEPORT``)."""

from __future__ import annotations

import socket

LISTEN_BACKLOG = 1024


def reuseport_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port) with ``SO_REUSEADDR`` and ``SO_REUSEPORT`` (not listening)."""
    family, kind, proto, _, addr = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(addr)
    except OSError:
        sock.close()
        raise
    return sock


__all__ = ["LISTEN_BACKLOG", "reuseport_socket"]
