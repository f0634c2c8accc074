"""The simulated model: deterministic next-token choice from the whole token sequence.

The state ``h`` is a 64-bit fold over every token of the sequence, so the k-th output token is a
pure function of (prompt + outputs before it, seed): an aggregated run, a P/D run and a
continuation (prompt + first j outputs as the new prompt) produce the same tokens.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

MASK64 = (1 << 64) - 1
_FOLD_MUL = 0x100000001B3
_FOLD_ADD = 0x9E3779B97F4A7C15
FIRST_REGULAR_TOKEN = 3  # 0 <s>, 1 </s>, 2 <pad>
EOS_TOKEN_ID = 1


def fold(h: int, token: int) -> int:
    return ((h ^ (token + _FOLD_ADD)) * _FOLD_MUL) & MASK64


def fold_all(tokens: Iterable[int], h: int = 0xCBF29CE484222325) -> int:
    for t in tokens:
        h = ((h ^ (t + _FOLD_ADD)) * _FOLD_MUL) & MASK64
    return h


def mix(x: int) -> int:
    """splitmix64 finaliser."""
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def choice_seed(seed: int, index: int) -> int:
    """The per-choice salt: 0 for greedy single choices, so greedy output ignores the seed."""
    return mix((seed & MASK64) ^ mix(index + 1))


def next_token(h: int, salt: int, vocab_size: int, allowed: Sequence[int] | None = None) -> int:
    r = mix(h ^ salt)
    if allowed:
        return allowed[r % len(allowed)]
    return FIRST_REGULAR_TOKEN + r % (vocab_size - FIRST_REGULAR_TOKEN)


def redraw(h: int, salt: int, vocab_size: int, banned: set[int], allowed: Sequence[int] | None) -> int:
    """A deterministic alternative when the first choice is banned (min_tokens masking)."""
    pool = [t for t in allowed if t not in banned] if allowed else None
    if allowed and not pool:
        return next_token(h, salt, vocab_size, allowed)
    for attempt in range(1, 64):
        t = next_token(mix(h + attempt), salt, vocab_size, pool)
        if t not in banned:
            return t
    return next_token(h, salt, vocab_size, pool)


def logprob_of(h: int, salt: int, token: int) -> float:
    """A deterministic, plausible log-probability for ``token`` in state ``h``."""
    r = mix(h ^ salt ^ (token * 0x2545F4914F6CDD1D & MASK64))
    return -((r % 100000) / 10000.0)
