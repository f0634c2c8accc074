"""``certs`` — self-signed certificates made at test time with the ``openssl`` command line (one set
per test module): a server certificate for 127.0.0.1 and a client certificate."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A self-signed server certificate for 127.0.0.1 and a self-signed client certificate."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command line is needed to make test certificates")
    d = tmp_path_factory.mktemp("certs")
    out: dict[str, Path] = {}
    for name, cn, san in (("server", "127.0.0.1", "IP:127.0.0.1"), ("client", "pd-proxy", "DNS:pd-proxy")):
        cert, key = d / f"{name}.pem", d / f"{name}.key"
        subprocess.run(["openssl", "req", "-x509", "-newkey", "ec",
                        "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", str(key),
                        "-out", str(cert), "-days", "1", "-subj", f"/CN={cn}",
                        "-addext", f"subjectAltName={san}"], check=True, capture_output=True, timeout=30)
        out[name], out[f"{name}_key"] = cert, key
    return out
