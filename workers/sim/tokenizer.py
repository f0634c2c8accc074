"""A built-in byte-level tokenizer with the traces' vocabulary layout.

Ids: 0 ``<s>``, 1 ``</s>``, 2 ``<pad>``; 3..258 the 256 single bytes in GPT-2 byte-to-unicode
order (3 = ``!``, 130 = 0xC3, 105 = 0xA9, ...); 259..514 deterministic multi-byte strings (a few
English-like pieces, some with a leading space, a few with non-ASCII characters).

Decoding is by bytes (invalid sequences become U+FFFD). Incremental decoding follows
``tokenizers``' ``DecodeStream`` as vLLM uses it: a token whose bytes leave a UTF-8 character
unfinished adds no text until the token that completes it (then the whole character).
"""

from __future__ import annotations

from collections.abc import Sequence

SPECIAL_TOKENS: tuple[str, ...] = ("<s>", "</s>", "<pad>")
NUM_SPECIAL = len(SPECIAL_TOKENS)

_NAMED_PIECES: tuple[str, ...] = (
    "the",
    " the",
    "apple",
    " apple",
    "pon",
    "lazy",
    " lazy",
    "anana",
    "refi",
    "refill",
    "ABCD",
    "klmn",
    "ache",
    "cache",
    "st",
    " fox",
    " dog",
    " jumps",
    " over",
    " quick",
    " brown",
    "ing",
    "ed",
    " and",
    " café",
    " naïve",
    "€",
    "😀",
    " über",
    "ñ",
)
_CONSONANTS = "bcdfghjklmnprstvwz"
_VOWELS = "aeiou"


def gpt2_byte_order() -> list[int]:
    """The bytes in GPT-2's ``bytes_to_unicode`` order (printable ranges first, then the rest)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    rest = [b for b in range(256) if b not in set(printable)]
    return printable + rest


def _generated_piece(i: int) -> str:
    """A pronounceable piece: 1-3 consonant-vowel syllables, every third with a leading space."""
    syllables = 1 + (i // 3) % 3
    out = []
    x = i
    for _ in range(syllables):
        out.append(_CONSONANTS[x % len(_CONSONANTS)] + _VOWELS[(x // len(_CONSONANTS)) % len(_VOWELS)])
        x = x // 5 + 7 * (x % 5) + 1
    word = "".join(out)
    return (" " + word) if i % 3 == 0 else word


class ByteTokenizer:
    """The vocabulary (``vocab_size`` >= 259) and decoding helpers."""

    def __init__(self, vocab_size: int = 515) -> None:
        if vocab_size < NUM_SPECIAL + 256:
            raise ValueError("vocab_size must be at least 259")
        self.vocab_size = vocab_size
        self.token_bytes: list[bytes] = [b""] * NUM_SPECIAL
        self.token_bytes += [bytes([b]) for b in gpt2_byte_order()]
        seen: set[str] = set()
        i = 0
        pieces: list[str] = []
        for p in _NAMED_PIECES:
            if p not in seen:
                seen.add(p)
                pieces.append(p)
        while len(pieces) < vocab_size - len(self.token_bytes):
            p = _generated_piece(i)
            i += 1
            if p not in seen:
                seen.add(p)
                pieces.append(p)
        self.token_bytes += [p.encode() for p in pieces[: vocab_size - len(self.token_bytes)]]
        self._byte_id = {
            tb[0]: i for i, tb in enumerate(self.token_bytes) if NUM_SPECIAL <= i < NUM_SPECIAL + 256
        }
        self._single_text: list[str] = [
            SPECIAL_TOKENS[i] if i < NUM_SPECIAL else tb.decode("utf-8", errors="replace")
            for i, tb in enumerate(self.token_bytes)
        ]

    def is_special(self, token_id: int) -> bool:
        return token_id < NUM_SPECIAL

    def token_text(self, token_id: int) -> str:
        """The text of one token decoded alone (special tokens by name; lone bytes may be U+FFFD)."""
        return self._single_text[token_id]

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Plain (non-incremental) decoding, like ``tokenizer.decode``; special tokens by name."""
        tb = self.token_bytes
        if skip_special_tokens:
            data = b"".join(tb[i] for i in token_ids if i >= NUM_SPECIAL)
        else:
            data = b"".join(tb[i] if i >= NUM_SPECIAL else SPECIAL_TOKENS[i].encode() for i in token_ids)
        return data.decode("utf-8", errors="replace")

    def encode(self, text: str) -> list[int]:
        """Bytes to ids (one id per byte; good enough to build prompts in tests)."""
        return [self._byte_id[b] for b in text.encode()]


class DecodeStream:
    """A re-implementation of ``tokenizers.decoders.DecodeStream`` (which vLLM's fast detokenizer
    uses) for this byte-level vocabulary, primed with the prompt like vLLM primes it.

    ``step`` returns the new text, or None while the decoded tail ends in U+FFFD (an unfinished or
    invalid UTF-8 sequence); when the prompt itself ends mid-character, the first text returned
    repeats the prompt's text (vLLM does the same; see ``gen-text-stream-prompt-tail-utf8.txt``).
    """

    __slots__ = ("_ids", "_prefix", "_prefix_index", "_skip", "_tok")

    def __init__(
        self, tokenizer: ByteTokenizer, prompt: Sequence[int] = (), skip_special_tokens: bool = True
    ) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids = list(prompt)
        text = self._decode(self._ids)
        if text.endswith("\ufffd"):
            self._prefix, self._prefix_index = "", 0
        else:
            self._prefix, self._prefix_index = text, len(self._ids)

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(ids, self._skip)

    def step(self, token_id: int) -> str | None:
        ids = self._ids
        ids.append(token_id)
        text = self._decode(ids)
        prefix = self._prefix
        if len(text.encode()) > len(prefix.encode()) and not text.endswith("\ufffd"):
            if not text.startswith(prefix):
                # tokenizers raises "Invalid prefix"; vLLM then starts a fresh stream for this token
                self._ids, self._prefix, self._prefix_index = [], "", 0
                return self.step(token_id)
            new_text = text[len(prefix) :]
            new_prefix_index = len(ids) - self._prefix_index
            self._ids = ids[self._prefix_index :]
            self._prefix = self._decode(self._ids)
            self._prefix_index = new_prefix_index
            return new_text
        return None


class IncrementalDecoder:
    """Text deltas for a token stream (``""`` where ``DecodeStream.step`` gives None)."""

    __slots__ = ("_stream",)

    def __init__(
        self, tokenizer: ByteTokenizer, skip_special_tokens: bool = True, prompt: Sequence[int] = ()
    ) -> None:
        self._stream = DecodeStream(tokenizer, prompt, skip_special_tokens)

    def feed(self, token_id: int) -> str:
        return self._stream.step(token_id) or ""


def logprob_token_text(tokenizer: ByteTokenizer, token_id: int, context: Sequence[int]) -> str:
    """The ``token``/``decoded_token`` vLLM reports for one logprob entry: the token decoded alone,
    or, when that ends in U+FFFD, re-decoded with up to 4 preceding sequence tokens as context
    (vLLM's ``LogprobsProcessor._correct_decoded_token``); ``""`` while genuinely incomplete."""
    text = tokenizer.decode([token_id], skip_special_tokens=False)
    if not text.endswith("\ufffd"):
        return text
    for num_ctx in range(1, min(len(context), 4) + 1):
        ctx = list(context[-num_ctx:])
        full = tokenizer.decode([*ctx, token_id], skip_special_tokens=False)
        if full.endswith("\ufffd"):
            continue
        clean_end = len(ctx)
        for j in range(len(ctx) - 1, -1, -1):
            if tokenizer.decode([ctx[j]], skip_special_tokens=False).endswith("\ufffd"):
                clean_end = j
            else:
                break
        clean_prefix = tokenizer.decode(ctx[:clean_end], skip_special_tokens=False) if clean_end else ""
        if full.startswith(clean_prefix):
            return full[len(clean_prefix) :]
        common = 0
        for a, b in zip(clean_prefix, full, strict=False):
            if a != b:
                break
            common += 1
        return full[common:]
    return ""
