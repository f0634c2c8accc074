"""Security: constant-time key checks, no secrets or prompt contents in logs, no client-chosen
upstream, the admin API on its own key, and TLS on both sides (self-signed certificates made at
test time with the ``openssl`` command line)."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import ssl
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from proxy.config.settings import ProxySettings
from proxy.http.app import build_app
from proxy.http.tls import server_context
from proxy.pools import PoolSettings
from proxy.upstream.client import Upstream
from tests import sse
from tests.reliability.harness import GENERATE, start_sim, start_world, world
from tests.reliability.harness import serve as serve_app
from workers.sim import SimSettings
from workers.sim import build_app as build_sim_app

pytestmark = pytest.mark.timeout(60)

ABORT_PATH = "/inference/v1/abort_requests"

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

    monkeypatch.setattr(hmac, "compare_digest", spy)  # what proxy.http.app calls
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

    monkeypatch.setattr(hmac, "compare_digest", spy)  # what proxy.fleet.admin calls
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


async def start_trap() -> tuple[web.AppRunner, str, int, list[str]]:
    """A listener standing for an address a client would like a worker to reach (a NIXL side
    channel, pd-sim's ``/sim/kv/pull``): every request it gets is recorded."""
    hits: list[str] = []

    async def trap(request: web.Request) -> web.Response:
        hits.append(request.path)
        return web.Response(status=404)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", trap)
    runner, url = await serve_app(app)
    return runner, "127.0.0.1", int(url.rsplit(":", 1)[1]), hits


def evil_params(host: str, port: int) -> dict[str, Any]:
    return {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[1, 2]],
            "remote_engine_id": "evil", "remote_request_id": "evil-1", "remote_host": host,
            "remote_port": port, "remote_num_tokens": 32}


def with_transfer_params(body: dict[str, Any], place: str, params: dict[str, Any]) -> bytes:
    """``body`` carrying ``params`` at ``place`` (every place a client could put them), as bytes."""
    body = json.loads(json.dumps(body))
    sp = body["sampling_params"]
    if place in ("kv_transfer_params", "ec_transfer_params"):
        body[place] = params
    elif place.startswith("extra_args."):
        sp["extra_args"] = {"logits_processor_arg": 1, place.split(".", 1)[1]: params}
    elif place == "nested":
        sp["extra_args"] = {"connector": {"kv_transfer_params": params}}
    elif place == "escaped":  # the key spelled with a JSON escape
        sp["extra_args"] = {"KEY": params}
        return json.dumps(body).replace('"KEY"', '"\\u006bv_transfer_params"').encode()
    else:
        raise AssertionError(place)
    return json.dumps(body).encode()


PLACES = ["kv_transfer_params", "ec_transfer_params", "extra_args.kv_transfer_params",
          "extra_args.ec_transfer_params", "nested", "escaped"]
# Every hop kind a request can take: (world settings, sims' faults, prompt length, stream).
HOP_KINDS: dict[str, dict[str, Any]] = {
    "two-hop": {"prompt": 40},
    "decode-only-bypass": {"prompt": 4},
    "prefill-failure-decode-only": {"prompt": 40, "p_faults": {"fail_next": 1, "fail_status": 500},
                                    "settings": {"prefill_failure_policy": "decode-only",
                                                 "pools": PoolSettings(prefill_attempts=1)}},
    "decode-retry": {"prompt": 40, "decodes": 2, "d_faults": {"fail_next": 1, "fail_status": 503}},
    "migration": {"prompt": 40, "decodes": 2, "stream": True, "max_tokens": 12,
                  "d_faults": {"reset_after_tokens": 3}},
}


@pytest.mark.parametrize("kind", list(HOP_KINDS))
async def test_clients_can_never_choose_an_upstream(monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    """Transfer params from a client, anywhere in the body, are refused (400, nothing sent
    anywhere, the trap listener never reached) on every hop kind; the same request without them
    takes that hop kind and reaches only the configured workers with the proxy's own params."""
    spec = HOP_KINDS[kind]
    rec = Recorder(monkeypatch)
    trap_runner, trap_host, trap_port, hits = await start_trap()
    w = await start_world(decode=[{}] * spec.get("decodes", 1), **spec.get("settings", {}))
    w.extra_runners.append(trap_runner)
    try:
        base = {**req(stream=spec.get("stream", False), max_tokens=spec.get("max_tokens", 6)),
                "token_ids": PROMPT[:spec["prompt"]]}
        where = f"{trap_host}:{trap_port}"
        headers = {"Content-Type": "application/json", "X-Prefill-Url": f"http://{where}",
                   "X-Forwarded-Host": where, "Forwarded": f"host={where}"}
        for place in PLACES:
            raw = with_transfer_params(base, place, evil_params(trap_host, trap_port))
            async with w.session.post(w.url + GENERATE, data=raw, headers=headers) as r:
                answer = await r.json()
                assert r.status == 400, (place, answer)
            assert answer["error"]["type"] == "BadRequestError" and "client" in answer["error"]["message"]
            assert rec.calls == [], f"{place}: a worker was called"
        # The control: the same request without them takes this hop kind.
        if "p_faults" in spec:
            await w.p.set_faults(**spec["p_faults"])
        if "d_faults" in spec:
            await w.sims[1].set_faults(**spec["d_faults"])  # the first decode worker picked
        async with w.session.post(w.url + GENERATE, json=base, headers=headers) as r:
            raw = await r.read()
            assert r.status == 200, raw[:300]
            decode_only = r.headers.get("X-PD-Decode-Only")
        await w.wait_clean()
        decode_urls = {d.url for d in w.sims[1:]}
        decode_calls = [url for url, _ in rec.calls if url in decode_urls]
        if kind.endswith("decode-only") or kind.endswith("bypass"):
            assert decode_only is not None
        if kind in ("decode-retry", "migration"):
            assert len(set(decode_calls)) == 2, rec.calls  # retried / migrated to the other worker
        workers = {s.url for s in w.sims}
        assert rec.calls and all(url in workers for url, _ in rec.calls)
        for _, sent in rec.calls:
            assert str(trap_port) not in json.dumps(sent), "a client-chosen address was forwarded"
            assert "ec_transfer_params" not in sent
            assert "extra_args" not in sent["sampling_params"]
        assert hits == [], "a worker was sent to the client's address"
    finally:
        await w.close()


# ------------------------------------------------------------------ TLS

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


# ------------------------------------------------------------------ request ids

BAD_IDS = ["a" * 129, "two words", "line\r\nrequest_id=forged", "tab\tid", "quote\"id", "näive",
           "nul\x00id", "tilde~id", "del\x7fid"]


@pytest.mark.parametrize("where", ["header", "body"])
async def test_request_ids_are_bounded_and_plain(monkeypatch: pytest.MonkeyPatch, where: str,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    rec = Recorder(monkeypatch)
    async with world() as w:
        for bad in BAD_IDS:
            if where == "body":
                status, raw = await w.post({**req(), "request_id": bad})
            else:
                if any(c in bad for c in "\r\n\x00\x7f") or not bad.isascii():
                    continue  # not sendable through aiohttp's client: the raw socket test below
                status, raw = await w.post(req(), headers={"X-Request-Id": bad})
            assert status == 400, (bad, raw)
            err = json.loads(raw)["error"]
            assert err["type"] == "BadRequestError" and err["code"] == 400, err
            assert err["param"] == ("request_id" if where == "body" else "X-Request-Id")
        assert rec.calls == []
        good = "req-1_a.b:c@d+e=f/g"
        status, raw = await w.post({**req(), "request_id": good} if where == "body" else req(),
                                   headers={"X-Request-Id": good} if where == "header" else None)
        assert status == 200 and json.loads(raw)["request_id"] == f"generate-tokens-{good}"
        await w.wait_clean()
    lines = [r.getMessage() for r in caplog.records if r.name == "pd_proxy.access"]
    assert lines and all("\n" not in line and "\r" not in line for line in lines)
    assert not any(line.startswith("request_id=forged") or " request_id=forged" in line for line in lines)


async def test_raw_header_bytes_in_a_request_id_are_a_400_not_a_500() -> None:
    """Bytes aiohttp's client would not send: non-UTF-8, a bare CR, control characters."""
    async with world() as w:
        host, port = w.url.removeprefix("http://").split(":")
        body = json.dumps(req()).encode()
        for value in (b"\xff\xfe-id", b"id\x01x", b"caf\xc3\xa9", b"a" * 300):
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(b"POST " + GENERATE.encode() + b" HTTP/1.1\r\nHost: x\r\n"
                         b"Content-Type: application/json\r\nX-Request-Id: " + value
                         + b"\r\nContent-Length: " + str(len(body)).encode()
                         + b"\r\nConnection: close\r\n\r\n" + body)
            await writer.drain()
            head = await asyncio.wait_for(reader.read(65536), 30)
            writer.close()
            status = int(head.split(b" ", 2)[1])
            assert status == 400, (value, head[:300])
        await w.wait_clean()


def test_text_access_lines_escape_what_they_print() -> None:
    from proxy.config.logs import EscapingFormatter, format_access  # noqa: PLC0415

    line = format_access({"request_id": "x\r\noutcome=ok", "worker": "http://p:1", "n": 3}, "text")
    assert "\n" not in line and "\r" not in line
    assert line == 'request_id="x\\r\\noutcome=ok" worker=http://p:1 n=3'
    record = logging.LogRecord("pd_proxy", logging.WARNING, __file__, 1, "request %s failed: %s",
                               ("id\n2026-01-01 INFO forged", "reason\r"), None)
    out = EscapingFormatter("%(levelname)s %(message)s").format(record)
    assert out == "WARNING request id\\n2026-01-01 INFO forged failed: reason\\r"


# ------------------------------------------------------------------ tenants

TENANT_A, TENANT_B = "tenant-a-key-Qx1", "tenant-b-key-Wz2"


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def test_a_tenant_aborts_only_its_own_requests() -> None:
    """Two tenants use the same request id at once. A's abort by that id ends A's request only;
    the broadcast of an id A's proxy does not know (B's request runs on another proxy in front of
    the same workers, as another process or replica would) does not touch B's request either.
    Each client sees its own id in every chunk."""
    slow = {"zero_latency": False, "prefill_base_ms": 1.0, "itl_ms": 40.0}
    w = await start_world(prefill=[slow], decode=[slow], api_keys=((None, TENANT_A), ("b", TENANT_B)))
    other = build_app(ProxySettings(prefill_urls=(w.p.url,), decode_urls=(w.d.url,),
                                    lease_duration=w.p.settings.lease_seconds, kv_block_size=16,
                                    api_keys=((None, TENANT_A), ("b", TENANT_B))))
    runner2, url2 = await serve_app(other)
    try:
        body = {**req(stream=True, max_tokens=40), "request_id": "shared-1"}

        async def run(url: str, key: str) -> list[Any]:
            async with w.session.post(url + GENERATE, json=body, headers=bearer(key)) as r:
                assert r.status == 200
                return list(sse.json_events(await r.read(), comments=True))

        a = asyncio.create_task(run(w.url, TENANT_A))
        b_same = asyncio.create_task(run(w.url, TENANT_B))
        b_other = asyncio.create_task(run(url2, TENANT_B))
        for _ in range(400):  # bounded: every request is decoding
            if len((await w.d.state())["inflight"]) == 3:
                break
            await asyncio.sleep(0.02)
        async with w.session.post(w.url + ABORT_PATH, json={"request_ids": ["generate-tokens-shared-1"]},
                                  headers=bearer(TENANT_A)) as r:
            assert r.status == 200
        events_a = await asyncio.wait_for(a, 30)
        assert events_a[-1]["choices"][0]["finish_reason"] == "abort"
        events_b, events_b2 = await asyncio.wait_for(asyncio.gather(b_same, b_other), 30)
        for events in (events_b, events_b2):
            assert events[-1]["choices"][0]["finish_reason"] == "length", events[-1]
            assert sum(len(e["choices"][0]["token_ids"]) for e in events if e["choices"]) == 40
        for events in (events_a, events_b, events_b2):
            assert {e["request_id"] for e in events} == {"generate-tokens-shared-1"}
        # The workers knew three different ids; none of them is the client's bare id.
        assert "generate-tokens-shared-1" not in json.dumps(await w.d.state())
        await runner2.cleanup()
        await w.wait_clean()
    finally:
        await runner2.cleanup()
        await w.close()


async def test_unknown_id_broadcast_is_namespaced_to_the_caller(monkeypatch: pytest.MonkeyPatch) -> None:
    sent: list[list[str]] = []

    async def abort(self: Upstream, worker: str, request_ids: list[str], **kw: Any) -> bool:
        sent.append(list(request_ids))
        return True

    monkeypatch.setattr(Upstream, "abort", abort)
    async with world(api_keys=((None, TENANT_A), (None, TENANT_B))) as w:
        ids = ["generate-tokens-x1", "generate-tokens-x1", "x2", "generate-tokens-bad id",
               "generate-tokens-" + "a" * 200, "generate-tokens-x3"]
        async with w.session.post(w.url + ABORT_PATH, json={"request_ids": ids},
                                  headers=bearer(TENANT_A)) as r:
            assert r.status == 200
        for _ in range(200):
            if len(sent) == 2:
                break
            await asyncio.sleep(0.01)
    from proxy.config.tenants import key_tag  # noqa: PLC0415

    tag = key_tag(TENANT_A)
    # Deduplicated; only ids that can be generate ids; the caller's namespace; one call per worker.
    assert sent == [[f"generate-tokens-{tag}~x1", f"generate-tokens-{tag}~x3"]] * 2


async def test_abort_calls_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    release = asyncio.Event()
    running = 0
    most = 0

    async def abort(self: Upstream, worker: str, request_ids: list[str], **kw: Any) -> bool:
        nonlocal running, most
        running += 1
        most = max(most, running)
        await release.wait()
        running -= 1
        return True

    monkeypatch.setattr(Upstream, "abort", abort)
    async with world(max_abort_ids=4, abort_broadcast_concurrency=2, abort_broadcast_queue=3) as w:
        r = await w.session.post(w.url + ABORT_PATH,
                                 json={"request_ids": [f"generate-tokens-{i}" for i in range(5)]})
        assert r.status == 400 and (await r.json())["error"]["param"] == "request_ids"
        # Repeats count once: 5 names, 4 distinct ids.
        r = await w.session.post(w.url + ABORT_PATH, json={"request_ids": ["generate-tokens-a"] * 5 + [
            "generate-tokens-b", "generate-tokens-c", "generate-tokens-d"]})
        assert r.status == 200
        statuses = []
        for i in range(4):
            r = await w.session.post(w.url + ABORT_PATH, json={"request_ids": [f"generate-tokens-q{i}"]})
            statuses.append(r.status)
            if r.status == 429:
                assert r.headers.get("Retry-After")
        assert statuses == [200, 200, 429, 429]  # 3 waiting broadcasts at most
        for _ in range(100):
            await asyncio.sleep(0.01)
        assert most == 2 * 2  # two broadcasts at once, each one call per worker (2 workers)
        release.set()


# ------------------------------------------------------------------ /health and /debug

async def test_health_calls_no_worker_and_shows_urls_only_to_the_admin(
        monkeypatch: pytest.MonkeyPatch) -> None:
    probes: list[str] = []
    real = Upstream.health

    async def health(self: Upstream, worker: str, **kw: Any) -> bool:
        probes.append(worker)
        return await real(self, worker, **kw)

    monkeypatch.setattr(Upstream, "health", health)
    async with world(api_key=KEY, pools=PoolSettings(active_health=False, admin_key=ADMIN_KEY)) as w:
        for _ in range(20):
            async with w.session.get(w.url + "/health") as r:
                body = await r.json()
                assert r.status == 200 and body["status"] == "ok"
                assert "pools" not in body and w.p.url not in json.dumps(body)
                assert body["workers"] == {"prefill": {"total": 1, "available": 1},
                                           "decode": {"total": 1, "available": 1}}
        for headers in (bearer(KEY), bearer("wrong")):
            async with w.session.get(w.url + "/health", headers=headers) as r:
                assert "pools" not in await r.json()
        async with w.session.get(w.url + "/health", headers=bearer(ADMIN_KEY)) as r:
            body = await r.json()
            assert body["pools"]["prefill"][0]["url"] == w.p.url and "requests_in_flight" in body
        assert probes == [], "GET /health called a worker"


async def test_debug_is_behind_the_admin_key() -> None:
    async with world(api_key=KEY, pools=PoolSettings(admin_key=ADMIN_KEY)) as w:
        for path in ("/debug/requests", "/debug/kv-leases", "/debug/runtime"):
            async with w.session.get(w.url + path, headers=bearer(KEY)) as r:
                assert r.status == 401, path  # a client key sees no other client's requests
            async with w.session.get(w.url + path, headers=bearer(ADMIN_KEY)) as r:
                assert r.status == 200, path
    async with world(api_keys=((None, TENANT_A), (None, TENANT_B))) as w:
        r = await w.session.get(w.url + "/debug/requests", headers=bearer(TENANT_A))
        assert r.status == 403  # several tenants and no admin key: shut
    async with world(api_key=KEY) as w:  # one key, no admin key: as before
        r = await w.session.get(w.url + "/debug/requests", headers=bearer(KEY))
        assert r.status == 200
