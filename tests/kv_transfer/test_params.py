"""kv_transfer.params: a client body that carries transfer params anywhere is found (its path
named for the 400), whatever the spelling; a null at the top level names nothing. (The requests
refused before any hop, on the wire: ``tests/reliability/test_security.py``.)"""

from __future__ import annotations

import json
from typing import Any

import pytest

from kv_transfer.params import client_transfer_params

KV = {"remote_host": "10.0.0.9", "remote_port": 5600, "remote_block_ids": [[1]]}


def found(body: dict[str, Any], raw: bytes | None = None) -> str | None:
    text = json.dumps(body).encode() if raw is None else raw
    return client_transfer_params(json.loads(text))


@pytest.mark.parametrize(("body", "path"), [
    ({"kv_transfer_params": KV}, "kv_transfer_params"),
    ({"ec_transfer_params": {"x": 1}}, "ec_transfer_params"),
    ({"sampling_params": {"extra_args": {"kv_transfer_params": KV}}},
     "sampling_params.extra_args.kv_transfer_params"),
    ({"sampling_params": {"extra_args": {"kv_transfer_params": None}}},
     "sampling_params.extra_args.kv_transfer_params"),  # null counts below the top level
    ({"x": [{"y": 1}, [{"ec_transfer_params": 1}]]}, "x[1][0].ec_transfer_params"),
])
def test_transfer_params_are_found_at_any_depth(body: dict[str, Any], path: str) -> None:
    assert found({"token_ids": [1, 2], **body}) == path


def test_a_top_level_null_names_nothing() -> None:
    assert found({"token_ids": [1], "kv_transfer_params": None, "ec_transfer_params": None}) is None


def test_a_key_spelled_with_an_escape_is_found() -> None:
    raw = b'{"token_ids":[1],"sampling_params":{"extra_args":{"kv_\\u0074ransfer_params":{"a":1}}}}'
    assert b"transfer_params" not in raw
    assert found({}, raw) == "sampling_params.extra_args.kv_transfer_params"


def test_values_that_merely_mention_the_name_are_not_keys() -> None:
    assert found({"token_ids": [1], "note": "kv_transfer_params", "tags": ["ec_transfer_params"]}) is None
