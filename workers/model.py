"""The tiny local Llama that the real-vLLM CPU runs serve (docs/vllm.md, section 5; traces' ``tiny-llama``).

Nothing can be downloaded from a model hub here, so the model is built locally and deterministically:
the same recipe gives the same bytes in every file, on every run. The build needs only ``tokenizers``,
``safetensors`` and ``numpy`` (the project's ``model`` extra), not torch or transformers:

- tokenizer: byte-level BPE trained with ``tokenizers`` (ByteLevel pre-tokenizer and decoder, no prefix
  space) on generated English-like filler text. Ids 0-2 are ``<s>``, ``</s>``, ``<pad>``; ids 3-258 are
  the 256 single-byte symbols in GPT-2 byte-to-unicode order (3 = ``!``); ids 259-514 are merges.
- weights: ``LlamaForCausalLM`` with vocab 515, hidden 128, intermediate 256, 2 layers, 2 attention
  heads, 2 KV heads, head_dim 64 (the CPU attention kernels do not support 16), untied, float32, drawn
  from numpy's PCG64 with a fixed seed (normal with std 0.02 as in transformers' init, norms at 1).
- ``config.json``, ``generation_config.json``, ``tokenizer_config.json`` and ``special_tokens_map.json``
  are written by hand, in the shape transformers 5 would write them.

The token ids and greedy outputs differ from the recorded traces (those weights came from torch's RNG);
the shapes, special ids, byte-token ids and tokenizer behaviour match.

A finished build ends by writing ``pd-model.json`` (the recipe version and the SHA-256 of every file);
a later build into the same folder that finds it, and finds every file with its recorded hash, does
nothing.

``--max-position N`` builds the same model with a longer (or shorter) context: only
``max_position_embeddings`` and ``model_max_length`` change (the rotary embedding has no table), and
the manifest records ``max_position`` (left out at the default, so the default build is unchanged).

CLI: ``python -m workers.model build --out DIR [--force] [--max-position N]`` and
``python -m workers.model check --out DIR``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import numpy as np
from safetensors.numpy import save as save_safetensors
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SERVED_MODEL_NAME: Final = "tiny-llama"
RECIPE_VERSION: Final = 1
MANIFEST_NAME: Final = "pd-model.json"
SEED: Final = 0

VOCAB_SIZE: Final = 515
HIDDEN_SIZE: Final = 128
INTERMEDIATE_SIZE: Final = 256
NUM_LAYERS: Final = 2
NUM_HEADS: Final = 2
NUM_KV_HEADS: Final = 2
HEAD_DIM: Final = 64
MAX_POSITION: Final = 2048
ROPE_THETA: Final = 10000.0
RMS_NORM_EPS: Final = 1e-6
INIT_STD: Final = 0.02

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
SPECIAL_TOKENS: Final = (BOS, EOS, PAD)
BOS_ID, EOS_ID, PAD_ID = 0, 1, 2
CHAT_TEMPLATE: Final = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}assistant:"
)

FILES: Final = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
)

# Words for the filler corpus the BPE merges are trained on.
_FILLER_WORDS: Final = (
    "the quick brown fox jumps over lazy dog apple banana orange pony pond ponder upon a an and or of "
    "to in on at by for with from into under over after before while when where which who what this "
    "that these those there here is was are were be been being have has had do does did will would "
    "can could should may might must shall say said go went gone make made take took see saw know knew "
    "think thought time year people way day man woman child world life hand part place case week company "
    "system program question work government number night point home water room mother area money story "
    "fact month lot right study book eye job word business issue side kind head house service friend "
    "father power hour game line end member law car city community name president team minute idea kid "
    "body information back parent face others level office door health person art war history party "
    "result change morning reason research girl guy moment air teacher force education garden river "
    "little small large great good new old long high different important public able early young"
)


@dataclass(frozen=True)
class BuildResult:
    """What :func:`build_model` did: the folder, whether it built or found a complete build, the hashes."""

    out: Path
    built: bool
    sha256: dict[str, str]


def _filler_text(seed: int, sentences: int = 4000) -> list[str]:
    """English-like filler sentences, the same for the same seed."""
    rng = random.Random(seed)
    words_pool = _FILLER_WORDS.split()
    lines = []
    for _ in range(sentences):
        words = [rng.choice(words_pool) for _ in range(rng.randint(5, 16))]
        words[0] = words[0].capitalize()
        lines.append(" ".join(words) + rng.choice((".", ".", ".", "?", "!")))
    return lines


def _train_tokenizer_json() -> str:
    """The tokenizer.json text: byte-level BPE with the special tokens, byte symbols and 256 merges."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_filler_text(SEED), trainer=trainer)
    if tokenizer.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"tokenizer has {tokenizer.get_vocab_size()} tokens, expected {VOCAB_SIZE}")
    # Re-serialise with sorted keys so the bytes do not depend on the library's map ordering.
    data = json.loads(tokenizer.to_str())
    return json.dumps(data, ensure_ascii=False, indent=2, sort_keys=True) + "\n"


def _weights() -> dict[str, np.ndarray[Any, np.dtype[np.float32]]]:
    """HF Llama tensor names and shapes, random normal(0, 0.02) from a fixed seed, norms at 1."""
    rng = np.random.Generator(np.random.PCG64(SEED))

    def normal(*shape: int) -> np.ndarray[Any, np.dtype[np.float32]]:
        return rng.normal(0.0, INIT_STD, size=shape).astype(np.float32)

    def ones(n: int) -> np.ndarray[Any, np.dtype[np.float32]]:
        return np.ones(n, dtype=np.float32)

    q_out, kv_out = NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM
    tensors = {"model.embed_tokens.weight": normal(VOCAB_SIZE, HIDDEN_SIZE)}
    for i in range(NUM_LAYERS):
        p = f"model.layers.{i}"
        tensors[f"{p}.self_attn.q_proj.weight"] = normal(q_out, HIDDEN_SIZE)
        tensors[f"{p}.self_attn.k_proj.weight"] = normal(kv_out, HIDDEN_SIZE)
        tensors[f"{p}.self_attn.v_proj.weight"] = normal(kv_out, HIDDEN_SIZE)
        tensors[f"{p}.self_attn.o_proj.weight"] = normal(HIDDEN_SIZE, q_out)
        tensors[f"{p}.mlp.gate_proj.weight"] = normal(INTERMEDIATE_SIZE, HIDDEN_SIZE)
        tensors[f"{p}.mlp.up_proj.weight"] = normal(INTERMEDIATE_SIZE, HIDDEN_SIZE)
        tensors[f"{p}.mlp.down_proj.weight"] = normal(HIDDEN_SIZE, INTERMEDIATE_SIZE)
        tensors[f"{p}.input_layernorm.weight"] = ones(HIDDEN_SIZE)
        tensors[f"{p}.post_attention_layernorm.weight"] = ones(HIDDEN_SIZE)
    tensors["model.norm.weight"] = ones(HIDDEN_SIZE)
    tensors["lm_head.weight"] = normal(VOCAB_SIZE, HIDDEN_SIZE)
    return tensors


def _config(max_position: int = MAX_POSITION) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": BOS_ID,
        "dtype": "float32",
        "eos_token_id": EOS_ID,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "hidden_size": HIDDEN_SIZE,
        "initializer_range": INIT_STD,
        "intermediate_size": INTERMEDIATE_SIZE,
        "max_position_embeddings": max_position,
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": NUM_HEADS,
        "num_hidden_layers": NUM_LAYERS,
        "num_key_value_heads": NUM_KV_HEADS,
        "pad_token_id": PAD_ID,
        "pretraining_tp": 1,
        "rms_norm_eps": RMS_NORM_EPS,
        "rope_parameters": {"rope_theta": ROPE_THETA, "rope_type": "default"},
        "tie_word_embeddings": False,
        "use_cache": True,
        "vocab_size": VOCAB_SIZE,
    }


def _generation_config() -> dict[str, Any]:
    return {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}


def _tokenizer_config(max_position: int = MAX_POSITION) -> dict[str, Any]:
    return {
        "add_prefix_space": False,
        "bos_token": BOS,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS,
        "model_max_length": max_position,
        "pad_token": PAD,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


def _special_tokens_map() -> dict[str, str]:
    return {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}


def _json_bytes(obj: object) -> bytes:
    return (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()


def _file_bytes(max_position: int = MAX_POSITION) -> dict[str, bytes]:
    """Every file of the model folder, by name (the manifest excepted)."""
    return {
        "config.json": _json_bytes(_config(max_position)),
        "generation_config.json": _json_bytes(_generation_config()),
        "model.safetensors": save_safetensors(_weights(), metadata={"format": "pt"}),
        "special_tokens_map.json": _json_bytes(_special_tokens_map()),
        "tokenizer.json": _train_tokenizer_json().encode(),
        "tokenizer_config.json": _json_bytes(_tokenizer_config(max_position)),
    }


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def read_manifest(out: Path) -> dict[str, Any] | None:
    """The manifest of a finished build in ``out``, or None when there is none (or it is unreadable)."""
    try:
        data = json.loads((out / MANIFEST_NAME).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def max_position_of(manifest: dict[str, Any]) -> int:
    value = manifest.get("max_position", MAX_POSITION)
    return value if isinstance(value, int) else MAX_POSITION


def is_complete(out: Path, max_position: int = MAX_POSITION) -> bool:
    """True when ``out`` holds a finished build of this recipe (and context length) with every file
    matching its recorded hash."""
    manifest = read_manifest(out)
    if manifest is None or manifest.get("recipe_version") != RECIPE_VERSION:
        return False
    if max_position_of(manifest) != max_position:
        return False
    hashes = manifest.get("sha256")
    if not isinstance(hashes, dict) or set(hashes) != set(FILES):
        return False
    try:
        return all(_sha256(out / name) == digest for name, digest in hashes.items())
    except OSError:
        return False


def _write_atomic(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def build_model(out: Path | str, *, force: bool = False, max_position: int = MAX_POSITION) -> BuildResult:
    """Build the tiny Llama into ``out`` unless a complete build is already there (or ``force``)."""
    if max_position < 1:
        raise ValueError(f"max_position must be positive, got {max_position}")
    out = Path(out)
    if not force and is_complete(out, max_position):
        manifest = read_manifest(out)
        assert manifest is not None
        return BuildResult(out=out, built=False, sha256=dict(manifest["sha256"]))
    out.mkdir(parents=True, exist_ok=True)
    (out / MANIFEST_NAME).unlink(missing_ok=True)
    hashes: dict[str, str] = {}
    for name, data in _file_bytes(max_position).items():
        _write_atomic(out / name, data)
        hashes[name] = hashlib.sha256(data).hexdigest()
    written: dict[str, Any] = {
        "recipe_version": RECIPE_VERSION,
        "served_model_name": SERVED_MODEL_NAME,
        "sha256": hashes,
    }
    if max_position != MAX_POSITION:
        written["max_position"] = max_position
    _write_atomic(out / MANIFEST_NAME, _json_bytes(written))
    return BuildResult(out=out, built=True, sha256=hashes)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workers.model", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build", help="build the model folder (skipped when complete)")
    build.add_argument("--out", type=Path, required=True, help="model folder, e.g. .cache/tiny-llama")
    build.add_argument("--force", action="store_true", help="rebuild even when a complete build is there")
    build.add_argument("--max-position", type=int, default=MAX_POSITION, help="context length (tokens)")
    check = sub.add_parser("check", help="exit 0 when the folder holds a complete build, 1 otherwise")
    check.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.command == "check":
        ok = is_complete(args.out)
        print(f"{args.out}: {'complete' if ok else 'missing or incomplete'}")
        return 0 if ok else 1
    result = build_model(args.out, force=args.force, max_position=args.max_position)
    if result.built:
        print(f"built {SERVED_MODEL_NAME} into {result.out}")
    else:
        print(f"{result.out} already holds a complete {SERVED_MODEL_NAME} build; nothing to do")
    return 0


if __name__ == "__main__":
    sys.exit(main())
