"""proxy.wire.known_bodies: a body that differs from one that passed only in its token ids (and its
request id) skips the parse and the model validation, and gets what the full path would give:
the same model and parse, or, when it does not pass, the full path's own error. What it shares
with the requests before it is never changed by them."""

from __future__ import annotations

import json
from typing import Any, cast

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.config.settings import ProxySettings
from proxy.http.app import SERVING
from proxy.walk.validation import Validation
from proxy.wire.errors import ClientError
from proxy.wire.known_bodies import KnownBodies, cut
from proxy.wire.protocol import GenerateRequest
from proxy.wire.token_ids import TokenIds
from tests.proxy.conftest import ProxyFactory
from tests.proxy.scripted import KV_PARAMS, Scripted, ScriptedFactory, prefill_reply

JSON = "application/json"
IDS, RID = "@@IDS@@", "@@RID@@"  # placeholders: their JSON strings are replaced by the texts

TEMPLATES: list[dict[str, Any]] = [
    {"token_ids": IDS, "sampling_params": {"max_tokens": 8, "temperature": 0.0}},
    {"request_id": RID, "token_ids": IDS, "sampling_params": {"max_tokens": 8}, "stream": True},
    {"sampling_params": {"max_tokens": 3, "stop": ["token_ids"], "seed": 7}, "token_ids": IDS,
     "output_mode": "text", "request_id": RID, "stream_options": {"include_usage": True}},
    {"token_ids": IDS, "features": {"request_id": RID}, "sampling_params": {}},  # not top-level
    {"token_ids": IDS, "sampling_params": {"max_tokens": 2}, "request_id": RID, "cache_salt": "s",
     "model": "m", "priority": -3, "whatever": [1, {"a": None}]},
    {"token_ids": IDS, "sampling_params": {"max_tokens": 2, "n": 3, "temperature": 1.0}},
    {"token_ids": IDS, "sampling_params": {"detokenize": False}, "output_mode": "text"},  # refused
    {"token_ids": IDS, "sampling_params": {"max_tokens": 2}, "note": "caf\\u00e9"},  # an escape
    {"token_ids": IDS, "sampling_params": {"max_tokens": 2}, "kv_transfer_params": {"a": 1}},  # refused
    {"features": {"token_ids": IDS, "request_id": RID}, "token_ids": [9], "request_id": "top",
     "sampling_params": {}},  # the keys once more, nested: neither is cut
]
IDS_TEXTS = ["[1]", "[0]", "[1,2,3]", "[ 5 , 6 ]", "[99999999999999999999999]", "[]", "[-1]", "[1.0]",
             "[01]", "[1,,2]", "[1,]", "[,1]", "[1 2]", '["1"]', "[true]", "[\t1]", "[1e2]", "[null]"]
RID_TEXTS = ['"a"', '""', '"x y-z_0"', '"caf\\u00e9"', '"\\""', 'null', "7", '"\u00e9"', '"a/b"']


def body_text(template: dict[str, Any], ids: str, rid: str) -> bytes:
    return json.dumps(template).replace(f'"{IDS}"', ids).replace(f'"{RID}"', rid).encode()


class Forgets:
    """A ``KnownBodies`` that knows nothing: the full path every time (the oracle)."""

    def probe(self, body: bytes, content_type: str) -> None:
        return None

    def get(self, probe: Any) -> None:
        return None

    def add(self, probe: Any, req: Any, data: Any) -> None:
        pass


def validation(**settings: Any) -> Validation:
    return Validation(ProxySettings(prefill_urls=("http://127.0.0.1:1",), decode_urls=("http://127.0.0.1:2",),
                                    **settings))


def outcome(srv: Validation, body: bytes, content_type: str = JSON) -> Any:
    try:
        req, data = srv.validate(body, content_type)
    except ClientError as e:
        return ("error", type(e), e.status, e.message, e.param)
    ids = data["token_ids"]
    assert type(ids) is TokenIds and json.loads(ids.json()) == list(ids)  # its text is its value
    dump = req.model_dump()
    dump["sampling_params"] = req.sampling_params.values
    return ("ok", dump, req.model_fields_set, {**data, "token_ids": list(ids)})


ORACLE = validation(max_prompt_tokens=4)
ORACLE.known = cast(KnownBodies, Forgets())


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(template=st.sampled_from(TEMPLATES),
       first=st.tuples(st.sampled_from(["[1,2]", "[3]"]), st.sampled_from(['"a"', '"b c"'])),
       ids=st.one_of(st.sampled_from(IDS_TEXTS),
                     st.lists(st.integers(0, 2**70), min_size=1, max_size=6).map(
                         lambda xs: "[" + ", ".join(map(str, xs)) + "]")),
       rid=st.one_of(st.sampled_from(RID_TEXTS), st.text(st.characters(min_codepoint=32, max_codepoint=126),
                                                         max_size=8).map(json.dumps)),
       content_type=st.sampled_from([JSON, JSON, "application/json; charset=utf-8", "text/plain"]))
def test_a_known_shape_answers_what_the_full_path_answers(
        template: dict[str, Any], first: tuple[str, str], ids: str, rid: str, content_type: str) -> None:
    srv = validation(max_prompt_tokens=4)  # the ids' number is still checked on a known shape
    known = body_text(template, *first)
    srv.validate(known, content_type) if outcome(ORACLE, known, content_type)[0] == "ok" else None
    body = body_text(template, ids, rid)
    assert outcome(srv, body, content_type) == outcome(ORACLE, body, content_type)


def test_a_body_is_known_by_all_but_its_ids_and_request_id() -> None:
    srv = validation()
    a = body_text(TEMPLATES[1], "[1,2]", '"a"')
    assert srv.validate(a, JSON) and len(srv.known) == 1
    b = body_text(TEMPLATES[1], "[3, 4, 5]", '"bb"')
    req, data = srv.validate(b, JSON)
    assert len(srv.known) == 1  # known: not added again
    assert req.token_ids == [3, 4, 5] and req.request_id == "bb" and data["request_id"] == "bb"
    assert data["token_ids"].json() == b"[3, 4, 5]"  # the body's own text, forwarded as it came
    for other in (body_text({**TEMPLATES[1], "stream": False}, "[1]", '"a"'),
                  a.replace(b'"max_tokens": 8', b'"max_tokens": 9')):
        srv.validate(other, JSON)
    assert len(srv.known) == 3


def test_what_cannot_be_told_apart_is_not_cut() -> None:
    assert cut(b'{"token_ids": [1], "x": "token_ids"}', JSON) is None  # two occurrences
    assert cut(b'{"token_ids": [1], "x": "\\u0041"}', JSON) is None  # an escape could spell a key
    assert cut(b'{"token_ids": [1.5]}', JSON) is None
    probe = cut(b'{"token_ids": [1], "request_id": "a\\"b"}', JSON)
    assert probe is not None and probe[2] is None  # an escaped request id: not cut
    probe = cut(b'{"token_ids": [1], "request_id": null}', JSON)
    assert probe is not None and probe[2] is None and b"null" in probe[0][3]


def test_a_request_id_that_is_not_the_top_level_one_is_not_kept() -> None:
    srv = validation()
    srv.validate(body_text(TEMPLATES[3], "[1]", '"a"'), JSON)
    assert len(srv.known) == 0
    req, data = srv.validate(body_text(TEMPLATES[3], "[2]", '"b"'), JSON)
    assert req.request_id is None and data["features"] == {"request_id": "b"}


def test_a_known_body_is_kept_without_its_ids() -> None:
    srv = validation()
    ids = list(range(1, 50001))
    srv.validate(json.dumps({"token_ids": ids, "sampling_params": {}}).encode(), JSON)
    (req, data), = srv.known._known.values()
    assert req.token_ids == [] and data["token_ids"] is None  # 50,000 ids are not held
    req, data = srv.validate(json.dumps({"token_ids": ids[:3], "sampling_params": {}}).encode(), JSON)
    assert req.token_ids == data["token_ids"] == [1, 2, 3]


def test_bodies_of_new_shapes_every_time_are_cut_one_in_16_until_a_shape_comes_back() -> None:
    srv = validation()
    srv.known = KnownBodies(size=8)
    cuts = 0
    probe = srv.known.probe

    def counted(body: bytes, content_type: str) -> Any:
        nonlocal cuts
        found = probe(body, content_type)
        cuts += found is not None
        return found

    srv.known.probe = counted  # type: ignore[method-assign]
    seeded = [body_text({**TEMPLATES[0], "sampling_params": {"seed": i}}, "[1]", "") for i in range(200)]
    for body in seeded[:8]:  # misses: each cut and kept
        srv.validate(body, JSON)
    assert cuts == 8
    for body in seeded[8:168]:  # resting: one in 16
        srv.validate(body, JSON)
    assert cuts == 8 + 10
    known = body_text({**TEMPLATES[0], "sampling_params": {"seed": 167}}, "[5, 6]", "")
    cuts = 0
    for _ in range(16):  # the last one kept comes back: once cut, it is known, and every body is cut
        srv.validate(known, JSON)
    assert cuts >= 1 and srv.known._misses == 0
    before = cuts
    for body in seeded[:5]:
        srv.validate(body, JSON)
    assert cuts == before + 5


def test_the_known_bodies_are_bounded() -> None:
    known = KnownBodies(size=4, max_key=200)
    srv = validation()
    srv.known = known
    for i in range(10):
        srv.validate(body_text({**TEMPLATES[0], "sampling_params": {"seed": i}}, "[1]", ""), JSON)
        assert 1 <= len(known) <= 4
        srv.validate(body_text({**TEMPLATES[0], "sampling_params": {"seed": i}}, "[2]", ""), JSON)  # a hit
    srv.validate(body_text({**TEMPLATES[0], "pad": "x" * 200}, "[1]", ""), JSON)
    assert len(known) == 2  # full: dropped, and the new shape is kept
    srv.validate(body_text({**TEMPLATES[0], "pad": "x" * 300}, "[1]", ""), JSON)
    assert len(known) == 2  # too long a key: not kept


async def test_a_known_shapes_hops_carry_their_own_ids_and_leave_the_known_parse_as_it_was(
        scripted_factory: ScriptedFactory, proxy_factory: ProxyFactory) -> None:
    p: Scripted = await scripted_factory(lambda b, r: prefill_reply(b))
    d: Scripted = await scripted_factory(lambda b, r: {**prefill_reply(b), "kv_transfer_params": None})
    client, app = await proxy_factory([p.url], [d.url])
    srv = app[SERVING].validation
    first = {"token_ids": [5, 6, 7], "request_id": "rid-a", "stream": False,
             "sampling_params": {"max_tokens": 9, "min_tokens": 2, "temperature": 0.5, "seed": 3,
                                 "prompt_logprobs": 1}}
    fresh = [srv.validate(json.dumps(first).encode(), JSON) for _ in range(2)][1]  # the second: known
    for i, ids in enumerate(([5, 6, 7], [8, 9], [10])):
        body = {**first, "token_ids": ids, "request_id": f"rid-{i}"}
        r = await client.post("/inference/v1/generate", data=json.dumps(body), headers={"Content-Type": JSON})
        assert r.status == 200, await r.text()
        assert p.received[i]["token_ids"] == ids and p.received[i]["request_id"] == f"rid-{i}"
        assert p.received[i]["sampling_params"] == {"max_tokens": 1, "temperature": 0.5, "seed": 3,
                                                    "prompt_logprobs": 1}
        want = {**body, "kv_transfer_params": KV_PARAMS}
        sp = cast(dict[str, Any], first["sampling_params"])
        want["sampling_params"] = {k: v for k, v in sp.items() if k != "prompt_logprobs"}
        assert d.received[i] == want
        assert p.headers[i]["x-request-id"] == d.headers[i]["x-request-id"] == f"rid-{i}"
    (req, data), = srv.known._known.values()
    assert isinstance(req, GenerateRequest)
    unshared = {"sampling_params", "token_ids"}
    assert req.model_dump(exclude=unshared) == fresh[0].model_dump(exclude=unshared)
    assert req.sampling_params.values == fresh[0].sampling_params.values
    assert {**data, "token_ids": fresh[1]["token_ids"]} == fresh[1]  # nothing changed in place


async def test_an_error_after_a_known_shape_is_the_full_paths(
        scripted_factory: ScriptedFactory, proxy_factory: ProxyFactory) -> None:
    p: Scripted = await scripted_factory(lambda b, r: prefill_reply(b))
    d: Scripted = await scripted_factory(lambda b, r: {**prefill_reply(b), "kv_transfer_params": None})
    client, app = await proxy_factory([p.url], [d.url], max_prompt_tokens=3)
    ok = {"token_ids": [1, 2], "sampling_params": {"max_tokens": 2}, "stream": False}
    assert (await client.post("/inference/v1/generate", json=ok)).status == 200
    for ids, status, message in (("[1, 2, 3, 4]", 400, "at most 3 tokens"), ("[-1]", 400, "negative"),
                                 ("[]", 400, "at least 1"), ("[1.5]", 400, "integer")):
        raw = json.dumps(ok).replace("[1, 2]", ids)
        r = await client.post("/inference/v1/generate", data=raw, headers={"Content-Type": JSON})
        got = await r.json()
        assert r.status == status and message in got["error"]["message"], got
    assert len(p.received) == 1 and len(app[SERVING].table) == 0
