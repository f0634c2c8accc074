"""Request sets: prompts as token ids and output lengths.

Every generator is deterministic for a given seed. Synthetic prompts (``random``,
``shared-prefix``, ``lengths-file``, ``trace``) are token ids drawn from ``[vocab_min, vocab_max]``
(inclusive; the default 3..514 is safe for the project's tiny model and for pd-sim): no tokenizer.
The text datasets a user brings as files are tokenized with a local tokenizer (``tokenizer_path``,
:mod:`benchmarks.tokenizer`), as ``vllm bench serve`` samples them:

- ``sharegpt``: a JSON list (or JSONL) of ``{"conversations": [{"value": prompt}, {"value":
  completion}, ...]}``; shuffled with the seed, the first turn is the prompt, the output length is
  the second turn's token count unless ``sharegpt_output_len`` is set; pairs with a prompt under 4
  tokens, an output under 4 (unless the length is set), a prompt over 1,024 or a total over 2,048
  tokens are skipped (vLLM's pruning).
- ``custom``: a JSONL file of ``{"prompt": ..., "output_tokens": N}`` rows (``output_tokens`` is read
  only when ``custom_output_len`` is None or -1; the default 256 applies to every row otherwise);
  shuffled with the seed; the tokenizer's chat template wraps each prompt unless
  ``skip_chat_template``.

Both oversample (repeat rows picked with the seed) when the file has fewer usable rows than
``num_requests``, unless ``no_oversample``.
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
DATASETS: Final = ("random", "sharegpt", "custom", "shared-prefix", "lengths-file", "trace")
TEXT_DATASETS: Final = ("sharegpt", "custom")
FILE_DATASETS: Final = ("sharegpt", "custom", "lengths-file", "trace")
DEFAULT_CUSTOM_OUTPUT_LEN: Final = 256
# vLLM's is_valid_sequence bounds for ShareGPT pairs
_MIN_LEN: Final = 4
_MAX_PROMPT_LEN: Final = 1024
_MAX_TOTAL_LEN: Final = 2048

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
    # random: a fixed prefix of this many tokens before every prompt (vLLM's --random-prefix-len)
    random_prefix_len: int = 0
    # sharegpt / custom: text tokenized locally
    tokenizer_path: str | None = None
    sharegpt_output_len: int | None = None
    custom_output_len: int | None = DEFAULT_CUSTOM_OUTPUT_LEN
    skip_chat_template: bool = False
    disable_shuffle: bool = False
    no_oversample: bool = False


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
    if cfg.name in FILE_DATASETS and not cfg.path:
        raise DatasetError(f"dataset {cfg.name} needs a file (--dataset-path)")
    if cfg.name not in FILE_DATASETS and cfg.path:
        # vLLM's check: a file given with a synthetic dataset is most likely a mistake
        raise DatasetError(
            f"Cannot use '{cfg.name}' dataset with --dataset-path. Please specify the appropriate "
            f"--dataset-name (e.g., 'sharegpt', 'custom') for your dataset file: {cfg.path}"
        )
    if cfg.name in TEXT_DATASETS and not cfg.tokenizer_path:
        raise DatasetError(
            f"dataset {cfg.name} is text: give a local tokenizer (--tokenizer DIR with tokenizer.json)"
        )
    if cfg.trace_speedup <= 0:
        raise DatasetError("trace_speedup must be positive")
    if cfg.random_prefix_len < 0:
        raise DatasetError("random_prefix_len must be >= 0")
    if cfg.sharegpt_output_len is not None and cfg.sharegpt_output_len < 1:
        raise DatasetError("sharegpt_output_len must be at least 1")
    if cfg.custom_output_len is not None and cfg.custom_output_len < 1 and cfg.custom_output_len != -1:
        raise DatasetError("custom_output_len must be at least 1 (or -1: each row's output_tokens)")


def _length(rng: random.Random, mean: int, ratio: float) -> int:
    """A length uniform in [mean*(1-ratio), mean*(1+ratio)], at least 1 (vllm's --random-range-ratio)."""
    lo = max(1, int(mean * (1.0 - ratio)))
    hi = max(lo, int(mean * (1.0 + ratio)))
    return rng.randint(lo, hi)


def _tokens(rng: random.Random, n: int, cfg: DatasetConfig) -> list[int]:
    return [rng.randint(cfg.vocab_min, cfg.vocab_max) for _ in range(n)]


def random_dataset(cfg: DatasetConfig) -> list[RequestSpec]:
    rng = random.Random(cfg.seed)
    prefix = _tokens(random.Random(f"{cfg.seed}:prefix"), cfg.random_prefix_len, cfg)
    out: list[RequestSpec] = []
    for _ in range(cfg.num_requests):
        n_in = _length(rng, cfg.input_len, cfg.range_ratio)
        n_out = _length(rng, cfg.output_len, cfg.range_ratio)
        out.append(RequestSpec(prefix + _tokens(rng, n_in, cfg), n_out))
    return out


def _oversample(specs: list[RequestSpec], cfg: DatasetConfig, what: str) -> list[RequestSpec]:
    """Up to ``num_requests`` by repeating rows picked with the seed (vLLM's oversampling)."""
    if not specs:
        raise DatasetError(f"{cfg.path}: no usable {what}")
    if cfg.no_oversample or len(specs) >= cfg.num_requests:
        return specs[: cfg.num_requests]
    rng = random.Random(cfg.seed)
    return specs + [rng.choice(specs) for _ in range(cfg.num_requests - len(specs))]


def _shuffled(rows: list[Any], cfg: DatasetConfig) -> list[Any]:
    if not cfg.disable_shuffle:
        random.Random(cfg.seed).shuffle(rows)  # the order vLLM's random.seed + random.shuffle give
    return rows


def sharegpt_dataset(cfg: DatasetConfig) -> list[RequestSpec]:
    """ShareGPT conversations: the first turn is the prompt; see the module docstring."""
    from benchmarks.tokenizer import load_tokenizer  # noqa: PLC0415

    assert cfg.path is not None and cfg.tokenizer_path is not None
    tok = load_tokenizer(cfg.tokenizer_path)
    rows = [
        r
        for r in _read_json_records(cfg.path)
        if isinstance(r, dict) and isinstance(r.get("conversations"), list) and len(r["conversations"]) >= 2
    ]
    fixed = cfg.sharegpt_output_len
    specs: list[RequestSpec] = []
    for row in _shuffled(rows, cfg):
        if len(specs) >= cfg.num_requests:
            break
        turns = row["conversations"]
        prompt, completion = _turn_text(turns[0]), _turn_text(turns[1])
        if prompt is None or completion is None:
            continue
        ids = tok.encode(prompt)
        n_out = len(tok.encode(completion)) if fixed is None else fixed
        too_short = len(ids) < _MIN_LEN or (fixed is None and n_out < _MIN_LEN)
        if too_short or len(ids) > _MAX_PROMPT_LEN or len(ids) + n_out > _MAX_TOTAL_LEN:
            continue
        specs.append(RequestSpec(ids, n_out))
    return _oversample(specs, cfg, "conversations (two turns, within vLLM's length bounds)")


def _turn_text(turn: Any) -> str | None:
    value = turn.get("value") if isinstance(turn, dict) else None
    return value if isinstance(value, str) else None


def custom_dataset(cfg: DatasetConfig) -> list[RequestSpec]:
    """JSONL prompts (vLLM's custom dataset); see the module docstring."""
    from benchmarks.tokenizer import TokenizerError, load_tokenizer  # noqa: PLC0415

    assert cfg.path is not None and cfg.tokenizer_path is not None
    if not cfg.path.endswith(".jsonl"):
        raise DatasetError(f"{cfg.path}: the custom dataset is a JSONL file (name ending in .jsonl)")
    tok = load_tokenizer(cfg.tokenizer_path)
    rows = _read_json_records(cfg.path)
    for i, row in enumerate(rows):
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            raise DatasetError(f"{cfg.path} line {i + 1}: every row needs a string 'prompt'")
    from_file = cfg.custom_output_len is None or cfg.custom_output_len == -1
    specs: list[RequestSpec] = []
    for row in _shuffled(rows, cfg):
        if len(specs) >= cfg.num_requests:
            break
        if from_file:
            n_out = row.get("output_tokens")
            if isinstance(n_out, bool) or not isinstance(n_out, int) or n_out < 1:
                raise DatasetError(
                    f"{cfg.path}: without an output length (--custom-output-len -1) every row needs "
                    f"a positive integer 'output_tokens', got {n_out!r}"
                )
        else:
            assert cfg.custom_output_len is not None
            n_out = cfg.custom_output_len
        prompt = row["prompt"]
        if not cfg.skip_chat_template:
            try:
                prompt = tok.apply_chat_template([{"role": "user", "content": prompt}])
            except TokenizerError as exc:
                raise DatasetError(str(exc)) from None
        specs.append(RequestSpec(tok.encode(prompt), n_out))
    return _oversample(specs, cfg, "prompts")


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
    from benchmarks.tokenizer import TokenizerError  # noqa: PLC0415

    _check(cfg)
    try:
        if cfg.name == "sharegpt":
            return sharegpt_dataset(cfg)
        if cfg.name == "custom":
            return custom_dataset(cfg)
    except TokenizerError as exc:
        raise DatasetError(str(exc)) from None
    if cfg.name == "random":
        return random_dataset(cfg)
    if cfg.name == "shared-prefix":
        return shared_prefix_dataset(cfg)
    if cfg.name == "lengths-file":
        return lengths_file_dataset(cfg)
    return trace_dataset(cfg)


def total_prompt_tokens(specs: Iterable[RequestSpec]) -> int:
    return sum(len(s.prompt) for s in specs)


@dataclass(frozen=True, slots=True)
class Conversation:
    """One multi-turn conversation: turn k's prompt is turn k-1's prompt + its answer + ``users[k]``,
    turn 0's is ``system + users[0]``. The answers are known only once each turn is done."""

    index: int
    system: list[int]
    users: list[list[int]]
    output_len: int


def multi_turn_dataset(
    num_conversations: int,
    turns: int,
    user_len: int,
    output_len: int,
    *,
    system_len: int = 0,
    seed: int = 0,
    vocab_min: int = DEFAULT_VOCAB_MIN,
    vocab_max: int = DEFAULT_VOCAB_MAX,
) -> list[Conversation]:
    """``num_conversations`` conversations of ``turns`` turns, ``user_len`` new user tokens a turn,
    all after one shared system prompt of ``system_len`` tokens (0: none)."""
    if num_conversations < 1 or turns < 1 or user_len < 1 or output_len < 1 or system_len < 0:
        raise DatasetError("multi-turn needs conversations, turns, user and output lengths >= 1, system >= 0")
    if vocab_min < 0 or vocab_max < vocab_min:
        raise DatasetError("need 0 <= vocab_min <= vocab_max")
    rng = random.Random(f"{seed}:multi-turn")

    def toks(n: int) -> list[int]:
        return [rng.randint(vocab_min, vocab_max) for _ in range(n)]

    system = toks(system_len)
    return [
        Conversation(i, system, [toks(user_len) for _ in range(turns)], output_len)
        for i in range(num_conversations)
    ]


def interleaved_turns(conversations: Sequence[Conversation]) -> list[tuple[int, int]]:
    """(conversation, turn) in the order they are issued when nothing waits: every conversation's
    turn 0, then every conversation's turn 1, and so on."""
    most = max((len(c.users) for c in conversations), default=0)
    return [(c.index, t) for t in range(most) for c in conversations if t < len(c.users)]


def next_turn_prompt(previous_prompt: list[int] | None, answer: Sequence[int], conv: Conversation,
                     turn: int) -> list[int]:
    """Turn ``turn``'s prompt from the previous turn's prompt and its actual answer."""
    if turn == 0:
        return conv.system + conv.users[0]
    if previous_prompt is None:
        raise DatasetError("a later turn needs the previous turn's prompt")
    return previous_prompt + list(answer) + conv.users[turn]
