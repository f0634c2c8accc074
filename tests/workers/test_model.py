"""The tiny Llama build: same bytes every time, skipped when complete, a working byte-level tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.numpy import load_file
from tokenizers import Tokenizer

from workers import model


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny-llama")
    assert model.build_model(out).built
    return out


def test_same_bytes_twice(built: Path, tmp_path: Path) -> None:
    other = model.build_model(tmp_path / "again")
    assert other.built
    for name in model.FILES:
        assert (built / name).read_bytes() == (tmp_path / "again" / name).read_bytes(), name
    assert (built / model.MANIFEST_NAME).read_bytes() == (
        tmp_path / "again" / model.MANIFEST_NAME
    ).read_bytes()


def test_second_build_is_skipped(built: Path) -> None:
    before = {name: (built / name).stat().st_mtime_ns for name in model.FILES}
    result = model.build_model(built)
    assert not result.built
    assert {name: (built / name).stat().st_mtime_ns for name in model.FILES} == before
    assert model.main(["check", "--out", str(built)]) == 0


def test_damaged_or_partial_build_is_rebuilt(built: Path, tmp_path: Path) -> None:
    out = tmp_path / "m"
    model.build_model(out)
    (out / "model.safetensors").write_bytes(b"truncated")
    assert not model.is_complete(out)
    assert model.build_model(out).built
    assert (out / "model.safetensors").read_bytes() == (built / "model.safetensors").read_bytes()
    (out / model.MANIFEST_NAME).unlink()  # an interrupted build never wrote its manifest
    assert not model.is_complete(out)
    assert model.main(["check", "--out", str(out)]) == 1
    assert model.build_model(out).built


def test_weights_have_llama_names_shapes_and_dtype(built: Path) -> None:
    tensors = load_file(built / "model.safetensors")
    assert tensors["model.embed_tokens.weight"].shape == (515, 128)
    assert tensors["lm_head.weight"].shape == (515, 128)
    assert tensors["model.layers.1.self_attn.q_proj.weight"].shape == (128, 128)
    assert tensors["model.layers.0.mlp.down_proj.weight"].shape == (128, 256)
    assert not (tensors["lm_head.weight"] == tensors["model.embed_tokens.weight"]).all()  # untied
    assert {t.dtype.name for t in tensors.values()} == {"float32"}
    assert len(tensors) == 2 + 1 + 2 * 9
    assert sum(t.size for t in tensors.values()) == 460_160  # the traces' "about 460k parameters"


def test_config_matches_the_traces_model(built: Path) -> None:
    cfg = json.loads((built / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["vocab_size"], cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]) == (
        515,
        128,
        256,
        64,
    )
    assert (cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (2, 2, 2)
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]) == (0, 1, 2)
    assert cfg["tie_word_embeddings"] is False
    gen = json.loads((built / "generation_config.json").read_text())
    assert gen == {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2}


def test_tokenizer_layout_and_round_trip(built: Path) -> None:
    tok = Tokenizer.from_file(str(built / "tokenizer.json"))
    assert tok.get_vocab_size() == 515
    assert [tok.id_to_token(i) for i in range(4)] == ["<s>", "</s>", "<pad>", "!"]
    # Byte ids quoted in the traces' README (GPT-2 byte-to-unicode order from id 3).
    for byte, token_id in {
        0xC3: 130,
        0xA9: 105,
        0xE2: 161,
        0x82: 227,
        0xAC: 108,
        0xF0: 175,
        0x9F: 256,
        0x98: 249,
        0x80: 225,
    }.items():
        assert tok.id_to_token(token_id) == _gpt2_char(byte)
    assert [tok.id_to_token(i) for i in range(3, 259)] == [_gpt2_char(b) for b in _gpt2_order()]
    text = "The lazy dog ponders an apple, héllo €😀\n\ttabs & 123"
    ids = tok.encode(text).ids
    assert tok.decode(ids) == text
    assert len(ids) < len(text.encode())  # merges make it shorter than one token per byte
    assert max(ids) >= 259 and all(i >= 3 for i in ids)


_PRINTABLE = [*range(33, 127), *range(161, 173), *range(174, 256)]


def _gpt2_order() -> list[int]:
    """Bytes in GPT-2's byte-to-unicode order: the printable ones, then the rest."""
    return _PRINTABLE + [b for b in range(256) if b not in _PRINTABLE]


def _gpt2_char(byte: int) -> str:
    """GPT-2's byte-to-unicode symbol for a byte."""
    if byte in _PRINTABLE:
        return chr(byte)
    return chr(256 + [b for b in range(256) if b not in _PRINTABLE].index(byte))
