"""TLS for pd-proxy, both ways (TLS 1.2+). Verification of the workers is never turned off."""

from __future__ import annotations

import ssl


def server_context(cert_file: str, key_file: str | None = None) -> ssl.SSLContext:
    """The listening socket's context; ``key_file`` None: the key is in ``cert_file``."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cert_file, key_file)
    return ctx


def upstream_context(ca_file: str | None = None, cert_file: str | None = None,
                     key_file: str | None = None) -> ssl.SSLContext | None:
    """The context for connections to workers; None (system CAs) when nothing is configured."""
    if ca_file is None and cert_file is None:
        if key_file is not None:
            raise ValueError("an upstream key file needs an upstream certificate file")
        return None
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca_file)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if cert_file is not None:
        ctx.load_cert_chain(cert_file, key_file)
    elif key_file is not None:
        raise ValueError("an upstream key file needs an upstream certificate file")
    return ctx


__all__ = ["server_context", "upstream_context"]
