"""Request sets: prompts as token ids (no tokenizer) and exact output lengths.

Every generator is deterministic for a given seed. Token ids are drawn from
``[vocab_min, vocab_max]`` (inclusive); the default 3..514 is safe for the project's tiny model
and for pd-sim.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

DEFAULT_VOCAB_MIN: Final = 3
DEFAULT_VOCAB_MAX: Final = 514
DATASETS: Final = ("random", "shared-prefix", "lengths-file", "trace")

_INPUT_KEYS: Final = ("input_len", "input_length", "prompt_len", "prompt_tokens", "input_tokens")
_OUTPUT_KEYS: Final = ("output_len", "output_length", "completion_len", "completion_tokens", "output_tokens")


class DatasetError(ValueError):
    """A dataset option or file that cannot be used."""


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request to send: the prompt's token ids, the exact output length, and for a trace
    replay the arrival time in seconds since the first request."""

    prompt: list[int]
    output_len: int
    arrival_s: float | None = None


@dataclass(frozen=True, slots=True)
class DatasetConfig:
    name: str = "random"
    num_requests: int = 100
    input_len: int = 256
    output_len: int = 64
    range_ratio: float = 0.0
    seed: int = 0
    vocab_min: int = DEFAULT_VOCAB_MIN
    vocab_max: int = DEFAULT_VOCAB_MAX
    # shared-prefix: num_prefixes prefixes of prefix_len tokens; input_len is the suffix length
    num_prefixes: int = 4
    prefix_len: int = 128
    # lengths-file / trace
    path: str | None = None
    # trace: timestamps are in this unit; replay runs speedup times faster; hash_ids blocks
    trace_time_unit: str = "s"
    trace_speedup: float = 1.0
    trace_block_size: int = 512


def _check(cfg: DatasetConfig) -> None:
    if cfg.name not in DATASETS:
        raise DatasetError(f"unknown dataset {cfg.name!r}; choose from {', '.join(DATASETS)}")
    if cfg.num_requests < 1:
        raise DatasetError("num_requests must be at least 1")
    if not 0.0 <= cfg.range_ratio < 1.0:
        raise DatasetError("range_ratio must be in [0, 1)")
    if cfg.vocab_min < 0 or cfg.vocab_max < cfg.vocab_min:
        raise DatasetError("need 0 <= vocab_min <= vocab_max")
    if cfg.input_len < 1 or cfg.output_len < 1:
        raise DatasetError("input_len and output_len must be at least 1")
    if cfg.name in ("lengths-file", "trace") and not cfg.path:
        raise DatasetError(f"dataset {cfg.name} needs a file (--dataset-path)")
    if cfg.trace_speedup <= 0:
        raise DatasetError("trace_speedup must be positive")


def _length(rng: random.Random, mean: int, ratio: float) -> int:
    """A length uniform in [mean*(1-ratio), mean*(1+ratio)], at least 1 (vllm's --random-range-ratio)."""
    lo = max(1, int(mean * (1.0 - ratio)))
    hi = max(lo, int(mean * (1.0 + ratio)))
    return rng.randint(lo, hi)


def _tokens(rng: random.Random, n: int, cfg: DatasetConfig) -> list[int]:
    return [rng.randint(cfg.vocab_min, cfg.vocab_max) for _ in range(n)]


def random_dataset(cfg: DatasetConfig) -> list[RequestSpec]:
    rng = random.Random(cfg.seed)
    out: list[RequestSpec] = []
    for _ in range(cfg.num_requests):
        n_in = _length(rng, cfg.input_len, cfg.range_ratio)
        n_out = _length(rng, cfg.output_len, cfg.range_ratio)
        out.append(RequestSpec(_tokens(rng, n_in, cfg), n_out))
    return out


def shared_prefix_dataset(cfg: DatasetConfig) -> list[RequestSpec]:
    """``num_prefixes`` fixed prefixes of ``prefix_len`` tokens, used round-robin, each followed by
    a fresh random suffix of about ``input_len`` tokens: exercises prefix caching."""
    if cfg.num_prefixes < 1 or cfg.prefix_len < 1:
        raise DatasetError("shared-prefix needs num_prefixes >= 1 and prefix_len >= 1")
    rng = random.Random(cfg.seed)
    prefixes = [_tokens(rng, cfg.prefix_len, cfg) for _ in range(cfg.num_prefixes)]
    out: list[RequestSpec] = []
    for i in range(cfg.num_requests):
        suffix = _tokens(rng, _length(rng, cfg.input_len, cfg.range_ratio), cfg)
        out.append(
            RequestSpec(
                prefixes[i % cfg.num_prefixes] + suffix, _length(rng, cfg.output_len, cfg.range_ratio)
            )
        )
    return out


def _read_json_records(path: str) -> list[Any]:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise DatasetError(f"cannot read {path}: {exc.strerror}") from exc
    stripped = text.lstrip()
    try:
        if stripped.startswith("["):
            data = json.loads(text)
            if not isinstance(data, list):
                raise DatasetError(f"{path}: expected a JSON list")
            return data
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    except json.JSONDecodeError as exc:
        raise DatasetError(f"{path}: not JSON or JSONL ({exc.msg} at line {exc.lineno})") from exc


def _pick(obj: dict[str, Any], keys: Sequence[str], what: str, where: str) -> int:
    for k in keys:
        if k in obj:
            v = obj[k]
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise DatasetError(f"{where}: {k} must be a positive integer")
            return v
    raise DatasetError(f"{where}: no {what} (one of {', '.join(keys)})")


def parse_length_pair(item: Any, where: str) -> tuple[int, int]:
    """``[in, out]`` or an object with input/output length keys."""
    if isinstance(item, list | tuple):
        if len(item) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in item):
            raise DatasetError(f"{where}: expected [input_len, output_len] of positive integers")
        return int(item[0]), int(item[1])
    if isinstance(item, dict):
        return _pick(item, _INPUT_KEYS, "input length", where), _pick(
            item, _OUTPUT_KEYS, "output length", where
        )
    raise DatasetError(f"{where}: expected a pair or an object")


def lengths_file_dataset(cfg: DatasetConfig) -> list[RequestSpec]:
    """(input, output) length pairs from a JSON list or JSONL file, in file order, cycled if the
    file has fewer than ``num_requests``; prompts are random token ids of those lengths."""
    assert cfg.path is not None
    pairs = [parse_length_pair(x, f"{cfg.path} item {i}") for i, x in enumerate(_read_json_records(cfg.path))]
    if not pairs:
        raise DatasetError(f"{cfg.path}: no length pairs")
    rng = random.Random(cfg.seed)
    return [
        RequestSpec(_tokens(rng, n_in, cfg), n_out)
        for n_in, n_out in (pairs[i % len(pairs)] for i in range(cfg.num_requests))
    ]


def trace_dataset(cfg: DatasetConfig) -> list[RequestSpec]:
    """Replay a JSONL/JSON trace: ``timestamp`` plus input/output lengths per request (the Mooncake
    trace's ``input_length``/``output_length``/``hash_ids`` also work: equal hash ids give equal
    ``trace_block_size``-token blocks, so shared prefixes replay as shared). Arrival times are
    relative to the earliest timestamp, divided by ``trace_speedup``; at most ``num_requests``."""
    assert cfg.path is not None
    if cfg.trace_time_unit not in ("s", "ms"):
        raise DatasetError("trace_time_unit must be s or ms")
    scale = (0.001 if cfg.trace_time_unit == "ms" else 1.0) / cfg.trace_speedup
    rows = _read_json_records(cfg.path)[: cfg.num_requests]
    if not rows:
        raise DatasetError(f"{cfg.path}: empty trace")
    rng = random.Random(cfg.seed)
    blocks: dict[int, list[int]] = {}
    parsed: list[tuple[float, list[int], int]] = []
    for i, row in enumerate(rows):
        where = f"{cfg.path} line {i + 1}"
        if not isinstance(row, dict):
            raise DatasetError(f"{where}: expected an object")
        ts = row.get("timestamp")
        if isinstance(ts, bool) or not isinstance(ts, int | float):
            raise DatasetError(f"{where}: timestamp must be a number")
        n_in, n_out = parse_length_pair(row, where)
        hash_ids = row.get("hash_ids")
        if isinstance(hash_ids, list) and hash_ids:
            prompt: list[int] = []
            for h in hash_ids:
                if not isinstance(h, int):
                    raise DatasetError(f"{where}: hash_ids must be integers")
                if h not in blocks:
                    blocks[h] = _tokens(random.Random(f"{cfg.seed}:{h}"), cfg.trace_block_size, cfg)
                prompt.extend(blocks[h])
            prompt = (prompt + _tokens(rng, max(0, n_in - len(prompt)), cfg))[:n_in]
        else:
            prompt = _tokens(rng, n_in, cfg)
        parsed.append((float(ts), prompt, n_out))
    t_first = min(p[0] for p in parsed)
    parsed.sort(key=lambda p: p[0])
    return [RequestSpec(prompt, n_out, (ts - t_first) * scale) for ts, prompt, n_out in parsed]


def build_dataset(cfg: DatasetConfig) -> list[RequestSpec]:
    _check(cfg)
    if cfg.name == "random":
        return random_dataset(cfg)
    if cfg.name == "shared-prefix":
        return shared_prefix_dataset(cfg)
    if cfg.name == "lengths-file":
        return lengths_file_dataset(cfg)
    return trace_dataset(cfg)


def total_prompt_tokens(specs: Iterable[RequestSpec]) -> int:
    return sum(len(s.prompt) for s in specs)
