"""Large generate bodies parsed in slices (``proxy.wire.large_body``): the same request, the same hop
bytes and the same client errors as the one-go parse (vLLM's route), the loop given back between
slices; what the slices cannot decide exactly is parsed in one go; a prompt over the cap refused
with its count once the rest of the body passed, as the proxy's own check refuses it."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from proxy.wire.large_body import PackedTokenIds, parse_large_generate_body
from proxy.wire.protocol import parse_generate_body
from proxy.wire.token_ids import encode_body
from proxy.wire.validation_errors import RequestValidationError, VLLMValidationError

SLICE = 16  # bytes of array text per slice: every body below is cut in many slices


def ids_json(ids: list[Any], sep: str = ",") -> str:
    return "[" + sep.join(json.dumps(i) for i in ids) + "]"


def body(ids: str, *, before: str = "", after: str = "", sp: str = '{"max_tokens":4}') -> bytes:
    return ('{' + before + '"sampling_params":' + sp + ',"token_ids":' + ids + after + '}').encode()


def outcome(fn: Any) -> Any:
    try:
        req, data = fn()
    except RequestValidationError as e:
        return ("invalid", e.message, e.param)
    except VLLMValidationError as e:
        return ("bad", str(e), e.parameter)
    ids = list(data["token_ids"])
    rest = {k: v for k, v in data.items() if k != "token_ids"}
    return ("ok", ids, list(req.token_ids), rest, req.model_dump(exclude={"token_ids", "sampling_params"}),
            req.sampling_params.values)


async def both(raw: bytes, content_type: str = "application/json", *, sliced: bool | None = None,
               **kw: Any) -> Any:
    """The slicer's outcome for ``raw``, which must be the one-go parse's; ``sliced``: whether the
    ids must come packed (parsed in slices) or as the one-go parse's list."""
    want = outcome(lambda: parse_generate_body(raw, content_type))
    result: Any = None

    async def run() -> None:
        nonlocal result
        try:
            result = ("value", await parse_large_generate_body(raw, content_type, slice_bytes=SLICE, **kw))
        except (RequestValidationError, VLLMValidationError) as e:
            result = ("error", e)

    await run()
    kind, value = result

    def replay() -> Any:
        if kind == "error":
            raise value
        return value

    got = outcome(replay)
    assert got == want
    if sliced is not None:
        assert kind == "value" and (type(value[1]["token_ids"]) is PackedTokenIds) is sliced
    return got


IDS = [300 + (i * 37) % 200 for i in range(60)]


@pytest.mark.parametrize("raw", [
    body(ids_json(IDS)),
    body(ids_json(IDS, ",\n        ")),
    body(ids_json(IDS, " , "), before='"request_id":"r1",', after=',"stream":true'),
    body(ids_json(IDS), sp='{"max_tokens":4,"stop":["\\u00e9"]}'),  # an escape elsewhere
    body(ids_json(IDS), before='"extra":"caf\u00e9 ]",'),  # non-ASCII and a bracket in a string
    body(ids_json([0, *IDS, 0])),
    body("[" + " " * 100 + ",".join(map(str, IDS)) + " " * 100 + "]"),  # long runs of blanks
    body("[" + ",".join(map(str, IDS)) + ",  7" + "\n" * 100 + "]"),
    body("[" + ", ".join(map(str, IDS)) + "\n" * 100 + "]"),  # ids, then blanks, in one slice
    body(ids_json(IDS, ",\n    ")[:-1] + " " * 300 + "]"),  # written with indent=, padded
    body("[" + ", ".join(map(str, IDS)) + " " * 100 + ", 5" + " " * 100 + "]"),
])
async def test_valid_bodies_parse_as_in_one_go(raw: bytes) -> None:
    got = await both(raw, sliced=True)
    assert got[0] == "ok"


async def test_packed_ids_give_the_same_hop_json() -> None:
    raw = body(ids_json(IDS, ",\n  "), before='"request_id":"r1",')
    req, data = await parse_large_generate_body(raw, "application/json", slice_bytes=SLICE)
    assert type(data["token_ids"]) is PackedTokenIds and req.token_ids is data["token_ids"]  # type: ignore[comparison-overlap]
    _, normal = parse_generate_body(raw, "application/json")
    for d in (data, normal):
        d["request_id"] = "hop"
    assert json.loads(encode_body(data)) == json.loads(encode_body(normal))
    ids = data["token_ids"]
    assert len(ids) == len(IDS) and ids[:5] == IDS[:5] and ids[-1] == IDS[-1] and list(ids) == IDS


@pytest.mark.parametrize("raw", [
    body(ids_json([*IDS, None, *IDS, 1.5])),  # element errors in several slices
    body(ids_json([None] * 30)),  # more than ten errors: the first ten, and the count
    body(ids_json([*IDS, -1])),  # negative: the model's own check, once every element passed
    body(ids_json([*IDS, -1, None])),  # an element error hides the negative one
    body(ids_json([*IDS, float("nan"), float("inf")])),
    body(ids_json([None, *IDS]), before='"request_id":5,', after=',"priority":"z"'),  # field order
    body(ids_json([None, *IDS]), after=',"output_mode":"text"', sp='{"detokenize":false}'),
    body(ids_json(IDS), after=',"output_mode":"text"', sp='{"detokenize":false}'),
    body(ids_json([None, *IDS]), sp='{"temperature":5}'),  # SamplingParams' error wins
    body(ids_json([None, *IDS]), after=',"cache_salt":"a/b"'),
    body("[" + " " * 80 + "]"),  # empty
])
async def test_validation_errors_match_the_one_go_parse(raw: bytes) -> None:
    got = await both(raw)
    assert got[0] in ("invalid", "bad")


@pytest.mark.parametrize("raw", [
    body("[" + ",".join(map(str, IDS)) + ",,1]"),
    body("[" + ",".join(map(str, IDS)) + ", ,1]"),
    body("[" + ",".join(map(str, IDS)) + ",]"),
    body("[," + ",".join(map(str, IDS)) + "]"),
    body("[" + ",".join(map(str, IDS)) + ",1 2]"),
    body("[" + ",".join(map(str, IDS)) + ",01]"),
    body("[" + ",".join(map(str, IDS)) + ",1.]"),
    body("[" + ",".join(map(str, IDS)) + ",-]"),
    body("[" + ",".join(map(str, IDS)) + ",tru]"),
    body("[" + ",".join(map(str, IDS)) + ",\u00e9]", before='"x":"\u00e9\u00e9",'),  # char positions
    body(ids_json(IDS), before='"x":1 "y":2,'),  # the rest's error comes first
    body("[" + ",".join(map(str, IDS)) + ",x]", after=',"x":}'),  # the array's error comes first
    body(ids_json(IDS), after=',"x":}'),  # the rest's error, after the array
    body(ids_json(IDS)) + b"garbage",
    body(ids_json(IDS)).replace(b",337,", b",3\xff7,", 1),  # invalid UTF-8 in the array
    body(ids_json(IDS), before='"x":"\xff",').replace(b"\xc3\xbf", b"\xff"),  # invalid UTF-8 in the rest
    body("[" + ",".join(map(str, IDS)) + "," + "9" * 5000 + "]"),  # past the int digit limit
    # no comma for a long way (more than two slices): only what decides the error is parsed
    body("[" + ",".join(map(str, IDS)) + ",1" + " " * 100 + "2]"),
    body("[" + ",".join(map(str, IDS)) + ",  1x" + " " * 100 + "2]"),
    body("[" + ",".join(map(str, IDS)) + ",1" + " \n" * 50 + "tru  2 3]"),
    body("[" + ",".join(map(str, IDS)) + ",1" + " " * 100 + "\f 2]"),
    body("[" + ",".join(map(str, IDS)) + ",-" + " " * 100 + "2]"),
    body("[" + ",".join(map(str, IDS)) + "," + "9" * 5000 + " " * 100 + "2]"),
    body("[" + ", ".join(map(str, IDS)) + " 4" + " " * 100 + "]"),  # ids, then a missing comma
    body("[" + ", ".join(map(str, IDS)) + " " * 100 + " 4]"),
    body("[" + ",".join(map(str, IDS)) + "," + " " * 100 + ",1]"),  # a long run with no value
    body("[" + ",".join(map(str, IDS)) + "," + " " * 100 + "1x" + " " * 100 + "]"),  # one bad value in it
])
async def test_json_errors_match_the_one_go_parse(raw: bytes) -> None:
    got = await both(raw)
    assert got[0] == "invalid"


@pytest.mark.parametrize("raw", [
    # the array is not the body's own token_ids: parsed in one go
    body(ids_json([1]), after=',"extra_args":{"token_ids":' + ids_json(IDS) + '}'),
    ('{"token\\u005fids":' + ids_json(IDS[:3]) + ',"sampling_params":{},"x":{"token_ids":'
     + ids_json(IDS) + '}}').encode(),
    b"not json at all " * 10,
])
async def test_bodies_whose_bulk_is_elsewhere_parse_in_one_go(raw: bytes) -> None:
    await both(raw)


async def test_wrong_media_type_is_refused_as_before() -> None:
    got = await both(body(ids_json(IDS)), "text/plain")
    assert got[0] == "invalid" and "Unsupported Media Type" in got[1]


@pytest.mark.parametrize("raw", [
    body(ids_json([*IDS, "5"])),  # numeric strings, lax ints and ids past 2**63, as vLLM takes them
    body(ids_json([*IDS, 1.0, True, 2e2])),
    body(ids_json([*IDS, 2**63, 2**64])),
    body("[" + ",".join(map(str, IDS)) + ',"\\u0035"]'),
    # the array is not the body's own token_ids, even with a JSON error after it
    ('{"x\\"token_ids":' + ids_json(IDS) + ',"token_ids":[1],"sampling_params":{}}').encode(),
    ('{"\\u0078\\"token_ids":' + ids_json(IDS) + ',"token_ids":[1],"sampling_params":{}}').encode(),
    ('{"token_ids":' + ids_json(IDS) + ',"token_ids":[1],"sampling_params":{}}').encode(),  # the last counts
])
async def test_ids_the_slices_do_not_take_are_read_in_one_go(raw: bytes) -> None:
    await both(raw, sliced=False)


@pytest.mark.parametrize("raw", [
    body(ids_json([*IDS, [1]])),  # not flat: vLLM's validation errors, in its order
    body(ids_json([*IDS, {"a": 1}]), sp='{"temperature":5}'),
    body(ids_json([*IDS, "x"]), before='"request_id":5,'),
    body(ids_json([*IDS, "5"]), after=',"x":}'),  # the JSON error after the array
    body(ids_json([*IDS, 2**64]), after=',"x":}'),
    body(ids_json([1]), after=',"x":{"token_ids":' + ids_json(IDS) + '},"y":}'),  # nested, then an error
    ('{"x\\"token_ids":' + ids_json(IDS) + ',"token_ids":[1],"sampling_params":{},}').encode(),
])
async def test_errors_the_slices_do_not_take_are_the_one_go_parse_s(raw: bytes) -> None:
    got = await both(raw, max_tokens=len(IDS) - 1)
    assert got[0] in ("invalid", "bad")


async def test_a_prompt_over_the_cap_is_refused_with_its_count_once_the_rest_passed() -> None:
    raw = body(ids_json(IDS))
    req, _ = await parse_large_generate_body(raw, "application/json", slice_bytes=SLICE, max_tokens=len(IDS))
    assert len(req.token_ids) == len(IDS) and type(req.token_ids) is PackedTokenIds  # type: ignore[comparison-overlap]
    with pytest.raises(VLLMValidationError) as e:
        await parse_large_generate_body(raw, "application/json", slice_bytes=SLICE, max_tokens=len(IDS) - 1)
    assert e.value.parameter == "token_ids"
    assert str(e.value).startswith(
        f"token_ids must have at most {len(IDS) - 1} tokens (this server's limit), got {len(IDS)}.")
    # Another error of the body comes first, as in the one-go parse: a JSON error past the cap, a
    # model error anywhere.
    for broken in (body("[" + ",".join(map(str, IDS)) + "," + "1 " * 50 + "]"),
                   body(ids_json(IDS), after=',"x":}'),
                   body(ids_json(IDS), sp='{"temperature":5}'),
                   body(ids_json(IDS), after=',"output_mode":"text"', sp='{"detokenize":false}')):
        got = await both(broken, max_tokens=len(IDS) - 1)
        assert got[0] in ("invalid", "bad") and "at most" not in got[1]


@pytest.mark.parametrize("max_tokens", [None, 10])
async def test_the_loop_runs_other_work_between_slices(max_tokens: int | None) -> None:
    """A large array is parsed in many steps: another task gets the loop between them (a body
    parsed in one go gives it no turn at all until the parse is over), a prompt over the cap
    too (counted to its end, then refused)."""
    raw = body(ids_json(IDS * 20))
    turns = 0
    stop = False

    async def other() -> None:
        nonlocal turns
        while not stop:
            turns += 1
            await asyncio.sleep(0)

    task = asyncio.get_running_loop().create_task(other())
    await asyncio.sleep(0)
    start = turns
    try:
        await parse_large_generate_body(raw, "application/json", slice_bytes=256, max_tokens=max_tokens)
    except VLLMValidationError:
        assert max_tokens is not None
    during = turns - start
    stop = True
    await task
    slices = len(raw) // 256
    assert during >= slices - 2
