"""Security: constant-time key checks, no secrets or prompt contents in logs, no client-chosen
upstream, the admin API on its own key, and TLS on both sides (self-signed certificates made at
test time with the ``openssl`` command line)."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import shutil
import ssl
import subprocess
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from proxy.app import build_app
from proxy.cli import parse_args, serve
from proxy.pools.runtime import PoolSettings
from proxy.settings import ProxySettings
from proxy.tls import server_context, upstream_context
from proxy.upstream import Upstream
from tests.reliability.harness import GENERATE, start_sim, start_world
from tests.reliability.harness import serve as serve_app
from workers.sim import SimSettings
from workers.sim import build_app as build_sim_app

pytestmark = pytest.mark.timeout(60)

KEY = "client-key-7Hq2"
UPSTREAM_KEY = "upstream-key-Zp81"
ADMIN_KEY = "admin-key-Lm40"
SALT = "salt-SECRET-3141"
# A prompt with a recognisable run of ids (never logged, in any separator).
PROMPT = [417, 419, 421, 423, 425, 427, 429, 431] * 5
PROMPT_MARKS = ("417, 419, 421", "417,419,421", "417 419 421")


def req(*, stream: bool = False, max_tokens: int = 6, **kw: Any) -> dict[str, Any]:
    return {"token_ids": PROMPT, "stream": stream, "cache_salt": SALT,
            "sampling_params": {"temperature": 0, "max_tokens": max_tokens, "ignore_eos": True}, **kw}


# ------------------------------------------------------------------ constant-time comparisons

async def test_client_key_is_checked_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: Any, b: Any) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)  # what proxy.app calls
    w = await start_world(api_key=KEY)
    try:
        async with w.session.post(w.url + GENERATE, json=req(),
                                  headers={"Authorization": "Bearer nope"}) as r:
            assert r.status == 401
        async with w.session.post(w.url + GENERATE, json=req(),
                                  headers={"Authorization": f"Bearer {KEY}"}) as r:
            assert r.status == 200
        assert len(calls) == 2, "every key check goes through hmac.compare_digest"
    finally:
        await w.close()


async def test_admin_api_has_its_own_key_checked_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Any] = []
    real = hmac.compare_digest

    def spy(a: Any, b: Any) -> bool:
        calls.append(1)
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)  # what proxy.pools.admin calls
    w = await start_world(api_key=KEY, pools=PoolSettings(admin_key=ADMIN_KEY))
    try:
        for auth, want in ((None, 401), (KEY, 401), ("x" + ADMIN_KEY, 401), (ADMIN_KEY, 200)):
            headers = {"Authorization": f"Bearer {auth}"} if auth else {}
            async with w.session.get(w.url + "/admin/workers", headers=headers) as r:
                assert r.status == want, (auth, await r.text())
        assert len(calls) == 4
        # ...and the admin key opens nothing of the client API.
        async with w.session.post(w.url + GENERATE, json=req(),
                                  headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as r:
            assert r.status == 401
    finally:
        await w.close()


# ------------------------------------------------------------------ nothing secret in the logs

async def test_keys_and_prompt_contents_never_logged(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    w = await start_world(api_key=KEY, upstream_api_key=UPSTREAM_KEY, prefill=[{"api_key": UPSTREAM_KEY}],
                          decode=[{"api_key": UPSTREAM_KEY, "zero_latency": False, "itl_ms": 20.0,
                                   "prefill_base_ms": 0.0, "prefill_per_token_ms": 0.0}],
                          log_format="json")
    auth = {"Authorization": f"Bearer {KEY}"}
    try:
        for stream in (False, True):
            async with w.session.post(w.url + GENERATE, json=req(stream=stream), headers=auth) as r:
                assert r.status == 200
        # an invalid request, a wrong key, an upstream error, an abort and a disconnect
        async with w.session.post(w.url + GENERATE, json={**req(), "token_ids": [*PROMPT, -1]},
                                  headers=auth) as r:
            assert r.status == 400
        async with w.session.post(w.url + GENERATE, json=req(),
                                  headers={"Authorization": "Bearer " + KEY[::-1]}) as r:
            assert r.status == 401
        await w.p.set_faults(fail_next=100, fail_status=500)
        async with w.session.post(w.url + GENERATE, json=req(), headers=auth) as r:
            assert r.status == 502
        await w.p.set_faults(reset=True)
        await w.d.set_faults(error_after_tokens=2)
        async with w.session.post(w.url + GENERATE, json=req(stream=True), headers=auth) as r:
            assert b'"error"' in await r.read()
        await w.d.set_faults(reset=True)
        rid = uuid.uuid4().hex
        async with w.session.post(w.url + GENERATE, json=req(stream=True, max_tokens=200), headers={
                **auth, "X-Request-Id": rid}) as r:
            await r.content.readuntil(b"\n\n")
            async with w.session.post(w.url + "/inference/v1/abort_requests", headers=auth,
                                      json={"request_ids": [f"generate-tokens-{rid}"]}) as a:
                assert a.status == 200
            await r.read()
        async with w.session.post(w.url + GENERATE, json=req(stream=True, max_tokens=200), headers=auth) as r:
            await r.content.readuntil(b"\n\n")
            r.close()
        await w.wait_clean()
    finally:
        await w.close()
    proxy_records = [rec for rec in caplog.records if not rec.name.startswith("pd_sim")]
    assert any(rec.name == "pd_proxy.access" for rec in proxy_records), "the access log was captured"
    assert any(rec.name == "pd_proxy" for rec in proxy_records), "the error log was captured"
    text = "\n".join(rec.getMessage() + (rec.exc_text or "") for rec in proxy_records)
    for secret in (KEY, UPSTREAM_KEY, SALT, KEY[::-1], *PROMPT_MARKS):
        assert secret not in text, secret


# ------------------------------------------------------------------ no client-chosen upstream

class Recorder:
    """Every upstream call the proxy makes: (worker URL, body)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []
        real = Upstream.open

        async def open_(upstream: Upstream, hop: str, worker: str, body: dict[str, Any], **kw: Any) -> Any:
            self.calls.append((worker, body))
            return await real(upstream, hop, worker, body, **kw)

        monkeypatch.setattr(Upstream, "open", open_)


@pytest.mark.parametrize("prompt_len", [40, 4], ids=["p-d", "decode-only-bypass"])
@pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
async def test_clients_can_never_choose_an_upstream(monkeypatch: pytest.MonkeyPatch, stream: bool,
                                                    prompt_len: int) -> None:
    rec = Recorder(monkeypatch)
    # A listener standing for an address the client would like the workers to reach.
    hits: list[str] = []

    async def trap(request: web.Request) -> web.Response:
        hits.append(request.path)
        return web.Response(status=404)

    trap_app = web.Application()
    trap_app.router.add_route("*", "/{tail:.*}", trap)
    trap_runner, trap_url = await serve_app(trap_app)
    trap_host, trap_port = "127.0.0.1", int(trap_url.rsplit(":", 1)[1])
    w = await start_world()
    w.extra_runners.append(trap_runner)
    try:
        evil = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[1, 2]],
                "remote_engine_id": "evil", "remote_request_id": "evil-1", "remote_host": trap_host,
                "remote_port": trap_port, "remote_num_tokens": 32}
        body = {**req(stream=stream), "token_ids": PROMPT[:prompt_len], "kv_transfer_params": evil,
                "ec_transfer_params": {"remote_host": trap_host, "remote_port": trap_port}}
        headers = {"Host": f"{trap_host}:{trap_port}", "X-Prefill-Url": trap_url, "X-Decode-Url": trap_url,
                   "X-Forwarded-Host": f"{trap_host}:{trap_port}", "X-Target-Worker": trap_url,
                   "X-Upstream": trap_url, "Forwarded": f"host={trap_host}:{trap_port}"}
        async with w.session.post(w.url + GENERATE, json=body, headers=headers) as r:
            raw = await r.read()
            assert r.status == 200, raw[:300]
        await w.wait_clean()
        workers = {s.url for s in w.sims}
        assert rec.calls and all(url in workers for url, _ in rec.calls)
        for _, sent in rec.calls:
            assert str(trap_port) not in json.dumps(sent), "a client-chosen address was forwarded"
        assert hits == [], "a worker was sent to the client's address"
    finally:
        await w.close()


# ------------------------------------------------------------------ TLS

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


def test_cli_wires_listening_tls(monkeypatch: pytest.MonkeyPatch, certs: dict[str, Path]) -> None:
    seen: dict[str, Any] = {}
    monkeypatch.setattr(web, "run_app", lambda app, **kw: seen.update(kw))
    monkeypatch.setattr(asyncio, "set_event_loop", lambda loop: None)
    serve(parse_args(["--prefill", "http://127.0.0.1:1", "--decode", "https://127.0.0.1:2",
                      "--tls-cert-file", str(certs["server"]), "--tls-key-file", str(certs["server_key"])]))
    seen["loop"].close()
    ctx = seen["ssl_context"]
    assert isinstance(ctx, ssl.SSLContext) and ctx.minimum_version >= ssl.TLSVersion.TLSv1_2


async def test_https_listener(certs: dict[str, Path]) -> None:
    w = await start_world(server_kwargs={"ssl_context": server_context(str(certs["server"]),
                                                                      str(certs["server_key"]))})
    try:
        assert w.url.startswith("https://")
        trust = ssl.create_default_context(cafile=str(certs["server"]))
        async with w.session.post(w.url + GENERATE, json=req(), ssl=trust) as r:
            assert r.status == 200
        with pytest.raises(aiohttp.ClientConnectorCertificateError):
            async with w.session.post(w.url + GENERATE, json=req()):  # the system CAs do not know it
                pass
        await w.wait_clean()
    finally:
        await w.close()


@pytest.mark.parametrize("mutual", [False, True], ids=["verify-server", "mutual-tls"])
async def test_tls_toward_the_workers(certs: dict[str, Path], mutual: bool) -> None:
    session = aiohttp.ClientSession()
    ctx = server_context(str(certs["server"]), str(certs["server_key"]))
    if mutual:
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_verify_locations(cafile=str(certs["client"]))
    # Decode over HTTPS; prefill in plain HTTP (pd-sim's KV side channel is plain HTTP).
    d_runner, d_url = await serve_app(build_sim_app(SimSettings(role="decode", zero_latency=True)),
                                      ssl_context=ctx)
    p = await start_sim(session, role="prefill", zero_latency=True)
    try:
        client_cert = {"upstream_cert_file": str(certs["client"]),
                       "upstream_key_file": str(certs["client_key"])}
        trusted = {"upstream_ca_file": str(certs["server"]), **(client_cert if mutual else {})}
        cases: list[tuple[dict[str, Any], int]] = [(trusted, 200), ({}, 502)]
        if mutual:
            cases.append(({"upstream_ca_file": str(certs["server"])}, 502))  # no client certificate
        for extra, want in cases:
            app = build_app(ProxySettings(prefill_urls=(p.url,), decode_urls=(d_url,), kv_block_size=16,
                                          pools=PoolSettings.plain(), **extra))
            runner, url = await serve_app(app)
            try:
                async with session.post(url + GENERATE, json=req()) as r:
                    body = await r.read()
                    assert r.status == want, (extra, body[:300])
            finally:
                await runner.cleanup()
    finally:
        await d_runner.cleanup()
        await p.close()
        await session.close()


def test_upstream_context_rules(certs: dict[str, Path]) -> None:
    assert upstream_context() is None
    ctx = upstream_context(str(certs["server"]))
    assert ctx is not None and ctx.verify_mode == ssl.CERT_REQUIRED and ctx.check_hostname
    with pytest.raises(ValueError, match="key file needs"):
        upstream_context(key_file=str(certs["client_key"]))
