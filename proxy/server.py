"""One pd-proxy server process: the app on its event loop until SIGTERM/SIGINT.

``pd-proxy`` (``proxy.cli``) runs one; ``--workers N`` (``proxy.multiproc``) runs one per child
process on a shared socket.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

from aiohttp import web

from proxy.app import build_app
from proxy.logs import configure_access_log
from proxy.settings import ProxySettings
from proxy.tls import server_context


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop when installed, else the default loop."""
    try:
        import uvloop  # noqa: PLC0415
    except ImportError:
        return asyncio.new_event_loop()
    loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    return loop


def serve(settings: ProxySettings, sock: socket.socket | None = None) -> None:
    """Run one server process until SIGTERM/SIGINT, on ``sock`` when given (``--workers``)."""
    configure_access_log(settings.log_format)
    loop = new_event_loop()
    asyncio.set_event_loop(loop)
    where: dict[str, Any] = {"sock": sock} if sock is not None else \
        {"host": settings.host, "port": settings.port}
    ssl_context = server_context(settings.tls_cert_file, settings.tls_key_file) \
        if settings.tls_cert_file else None
    web.run_app(build_app(settings), **where, ssl_context=ssl_context,
                keepalive_timeout=settings.header_timeout,
                shutdown_timeout=settings.drain_timeout, handler_cancellation=True,
                access_log=None, loop=loop)
