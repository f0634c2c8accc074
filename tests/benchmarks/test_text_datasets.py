"""The datasets a user brings as files (ShareGPT JSON, JSONL prompts), tokenized with the tiny
model's local tokenizer, sampled as ``vllm bench serve`` samples them."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import random
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestServer

from benchmarks.cli import main
from benchmarks.datasets import DatasetConfig, DatasetError, build_dataset
from benchmarks.tokenizer import load_tokenizer
from tests.benchmarks.scripted import SEEN, echo_stream, make_app

ServerFactory = Callable[..., Awaitable[TestServer]]

WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "apple", "banana", "pony", "pond")


def _text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _sharegpt(path: Path, n: int) -> list[dict[str, Any]]:
    rng = random.Random(1)
    rows: list[dict[str, Any]] = [
        {
            "id": f"c{i}",
            "conversations": [
                {"from": "human", "value": _text(rng, 6 + i)},
                {"from": "gpt", "value": _text(rng, 5 + i % 7)},
            ],
        }
        for i in range(n)
    ]
    rows.append({"id": "one-turn", "conversations": [{"from": "human", "value": "lonely"}]})  # skipped
    rows.append(
        {
            "id": "short",
            "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": _text(rng, 9)}],
        }
    )  # prompt < 4
    path.write_text(json.dumps(rows), encoding="utf-8")
    return rows


def _cfg(name: str, path: Path, tok: Path, **kw: Any) -> DatasetConfig:
    return DatasetConfig(name=name, path=str(path), tokenizer_path=str(tok), **kw)


def test_sharegpt_is_sampled_as_vllm_samples_it(tmp_path: Path, tiny_model_dir: Path) -> None:
    rows = _sharegpt(tmp_path / "sg.json", 10)
    tok = load_tokenizer(tiny_model_dir)
    specs = build_dataset(_cfg("sharegpt", tmp_path / "sg.json", tiny_model_dir, num_requests=5, seed=3))
    # vLLM: keep two-turn conversations, random.seed(seed) + random.shuffle, first turn the prompt,
    # the second turn's token count the output length, prompts under 4 tokens skipped
    kept = [r for r in rows if len(r["conversations"]) >= 2]
    random.Random(3).shuffle(kept)
    expected = []
    for r in kept:
        prompt = tok.encode(r["conversations"][0]["value"])
        out = len(tok.encode(r["conversations"][1]["value"]))
        if len(prompt) >= 4 and out >= 4:
            expected.append((prompt, out))
    assert [(s.prompt, s.output_len) for s in specs] == expected[:5]
    assert all(max(s.prompt) < 515 for s in specs)  # the tiny model's vocabulary


def test_sharegpt_output_length_override_and_oversampling(tmp_path: Path, tiny_model_dir: Path) -> None:
    _sharegpt(tmp_path / "sg.json", 3)
    cfg = _cfg("sharegpt", tmp_path / "sg.json", tiny_model_dir, num_requests=7, sharegpt_output_len=2)
    specs = build_dataset(cfg)
    assert len(specs) == 7 and {s.output_len for s in specs} == {2}
    assert len({tuple(s.prompt) for s in specs}) == 3  # the 3 usable rows, repeated
    assert len(build_dataset(replace(cfg, no_oversample=True))) == 3


def test_custom_jsonl(tmp_path: Path, tiny_model_dir: Path) -> None:
    path = tmp_path / "prompts.jsonl"
    lines = [{"prompt": f"the quick brown fox number {i}", "output_tokens": 3 + i} for i in range(4)]
    path.write_text("\n".join(json.dumps(x) for x in lines), encoding="utf-8")
    tok = load_tokenizer(tiny_model_dir)
    fixed = build_dataset(
        _cfg("custom", path, tiny_model_dir, num_requests=4, skip_chat_template=True, disable_shuffle=True)
    )
    assert [s.prompt for s in fixed] == [tok.encode(str(x["prompt"])) for x in lines]
    assert {s.output_len for s in fixed} == {256}  # vLLM's --custom-output-len default
    from_file = build_dataset(
        _cfg(
            "custom",
            path,
            tiny_model_dir,
            num_requests=4,
            skip_chat_template=True,
            custom_output_len=-1,
            disable_shuffle=True,
        )
    )
    assert [s.output_len for s in from_file] == [3, 4, 5, 6]
    with pytest.raises(DatasetError, match="JSONL"):
        build_dataset(_cfg("custom", tmp_path / "prompts.json", tiny_model_dir))
    (tmp_path / "bad.jsonl").write_text('{"text": "no prompt"}\n', encoding="utf-8")
    with pytest.raises(DatasetError, match="'prompt'"):
        build_dataset(_cfg("custom", tmp_path / "bad.jsonl", tiny_model_dir, skip_chat_template=True))


def test_custom_applies_the_chat_template(tmp_path: Path, tiny_model_dir: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "hello there"}\n', encoding="utf-8")
    cfg = _cfg("custom", path, tiny_model_dir, num_requests=1)
    if importlib.util.find_spec("jinja2") is None:
        with pytest.raises(DatasetError, match="jinja2"):  # said, not a traceback
            build_dataset(cfg)
        return
    (spec,) = build_dataset(cfg)  # pragma: no cover (jinja2 is not installed here)
    assert spec.prompt == load_tokenizer(tiny_model_dir).encode("user: hello there\nassistant:")


def test_no_tokenizer_nothing_downloaded(tmp_path: Path) -> None:
    _sharegpt(tmp_path / "sg.json", 2)
    with pytest.raises(DatasetError, match="downloads nothing"):
        build_dataset(_cfg("sharegpt", tmp_path / "sg.json", Path("meta-llama/Llama-3-8B")))


async def test_cli_sends_the_tokenized_prompts(
    aiohttp_server: ServerFactory, tmp_path: Path, tiny_model_dir: Path
) -> None:
    path = tmp_path / "sg.json"
    await asyncio.to_thread(_sharegpt, path, 6)
    app = make_app(echo_stream)
    server = await aiohttp_server(app)
    argv = [
        "--base-url", f"http://127.0.0.1:{server.port}", "--dataset-name", "sharegpt", "--dataset-path",
        str(path), "--tokenizer", str(tiny_model_dir), "--num-prompts", "4", "--sharegpt-output-len", "3",
        "--disable-tqdm",
    ]  # fmt: skip
    assert await asyncio.to_thread(main, argv) == 0
    want = build_dataset(_cfg("sharegpt", path, tiny_model_dir, num_requests=4, sharegpt_output_len=3))
    # all four go at once: the server's arrival order is any; the ids end with the dataset index
    bodies = sorted(app[SEEN].bodies, key=lambda b: int(str(b["request_id"]).rsplit("-", 1)[1]))
    assert [b["token_ids"] for b in bodies] == [s.prompt for s in want]
    assert {b["sampling_params"]["max_tokens"] for b in bodies} == {3}
    assert {b["sampling_params"]["ignore_eos"] for b in bodies} == {False}  # vLLM: only with --ignore-eos
