"""TLS for pd-proxy, both ways, with the standard library's ``ssl`` (no extra dependency).

* Listening side: ``--tls-cert-file`` / ``--tls-key-file`` make the proxy serve HTTPS
  (``server_context``). Without them it serves plain HTTP, as vLLM does.
* Toward the workers: ``https://`` worker URLs are verified against the system's CAs, or
  against ``--upstream-ca-file`` when given (a private CA); ``--upstream-cert-file`` /
  ``--upstream-key-file`` add a client certificate for workers behind mutual TLS
  (``upstream_context``). Verification is never turned off.
"""

from __future__ import annotations

import ssl


def server_context(cert_file: str, key_file: str | None = None) -> ssl.SSLContext:
    """The listening socket's context (TLS 1.2+). ``key_file`` may be None when the key is
    in ``cert_file``."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cert_file, key_file)
    return ctx


def upstream_context(ca_file: str | None = None, cert_file: str | None = None,
                     key_file: str | None = None) -> ssl.SSLContext | None:
    """The context for connections to workers, or None (aiohttp's default: system CAs, full
    verification) when nothing is configured."""
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
