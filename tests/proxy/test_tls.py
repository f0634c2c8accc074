"""proxy.http.tls: the listening side's context and the context toward the workers (verification never
off; a key needs its certificate). (HTTPS end to end, both ways: ``tests/reliability/test_security.py``.)"""

from __future__ import annotations

import ssl
from pathlib import Path

import pytest

from proxy.http.tls import server_context, upstream_context


def test_upstream_context_rules(certs: dict[str, Path]) -> None:
    assert upstream_context() is None
    ctx = upstream_context(str(certs["server"]))
    assert ctx is not None and ctx.verify_mode == ssl.CERT_REQUIRED and ctx.check_hostname
    with pytest.raises(ValueError, match="key file needs"):
        upstream_context(key_file=str(certs["client_key"]))


def test_the_upstream_context_may_carry_a_client_certificate(certs: dict[str, Path]) -> None:
    ctx = upstream_context(cert_file=str(certs["client"]), key_file=str(certs["client_key"]))
    assert ctx is not None and ctx.verify_mode == ssl.CERT_REQUIRED  # the system's CAs, still verified
    assert ctx.minimum_version >= ssl.TLSVersion.TLSv1_2
    with pytest.raises(ssl.SSLError):  # the certificate is loaded with its key
        upstream_context(cert_file=str(certs["client"]), key_file=str(certs["server_key"]))


def test_the_listening_context_serves_the_certificate_over_tls_1_2_at_least(
        certs: dict[str, Path]) -> None:
    ctx = server_context(str(certs["server"]), str(certs["server_key"]))
    assert ctx.minimum_version >= ssl.TLSVersion.TLSv1_2
    assert ctx.get_ca_certs() == [] and ctx.verify_mode == ssl.CERT_NONE  # no client certificate asked
    with pytest.raises(ssl.SSLError):
        server_context(str(certs["server"]), str(certs["client_key"]))  # not this certificate's key
