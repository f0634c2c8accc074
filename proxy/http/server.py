"""One pd-proxy server process: the app on its event loop until SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

from aiohttp import web

from proxy.config.logs import configure_access_log
from proxy.config.settings import ProxySettings
from proxy.http.app import build_app
from proxy.http.tls import server_context


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
    app = build_app(settings)
    web.run_app(app, **where, ssl_context=ssl_context,
                keepalive_timeout=settings.header_timeout,
                shutdown_timeout=settings.drain_timeout, handler_cancellation=True,
                access_log=None, loop=loop)
