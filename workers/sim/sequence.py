"""One output sequence (a choice): next tokens, stop rules, text deltas with stop-string hold-back,
and logprobs in both output modes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .model import EOS_TOKEN_ID, fold, fold_all, logprob_of, mix, next_token, redraw
from .protocol import SamplingParams
from .tokenizer import ByteTokenizer, IncrementalDecoder, logprob_token_text


@dataclass
class SeqConfig:
    """What every choice of one request shares."""

    sp: SamplingParams
    vocab_size: int
    max_tokens: int
    greedy: bool
    tokenizer: ByteTokenizer | None
    text_mode: bool
    stops: list[str]
    stop_ids: frozenset[int]
    prompt: list[int]
    holdback: int = 0
    token_id_placeholders: bool = False
    first_differs: bool = False
    """The ``first_token_mismatch`` fault: the first token is another than the model's."""

    @classmethod
    def build(
        cls,
        sp: SamplingParams,
        *,
        vocab_size: int,
        max_tokens: int,
        tokenizer: ByteTokenizer | None,
        text_mode: bool,
        prompt: list[int],
        token_id_placeholders: bool = False,
        first_differs: bool = False,
    ) -> SeqConfig:
        stops = sp.stop_strings() if tokenizer is not None else []
        max_stop_len = max((len(s) for s in stops), default=0)
        holdback = max_stop_len - 1 if stops and not sp.include_stop_str_in_output else 0
        return cls(
            sp=sp,
            vocab_size=vocab_size,
            max_tokens=max_tokens,
            greedy=sp.temperature < 1e-5,
            tokenizer=tokenizer,
            text_mode=text_mode,
            stops=stops,
            stop_ids=frozenset(sp.stop_token_ids or ()),
            prompt=prompt,
            holdback=max(holdback, 0),
            token_id_placeholders=token_id_placeholders,
            first_differs=first_differs,
        )

    @property
    def detokenize(self) -> bool:
        return self.tokenizer is not None and (self.text_mode or bool(self.stops))


@dataclass
class Sequence:
    index: int
    salt: int
    h: int
    cfg: SeqConfig
    tokens: list[int] = field(default_factory=list)
    sent: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    decoder: IncrementalDecoder | None = None
    text: str = ""
    sent_text: int = 0
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    sent_logprobs: int = 0

    def __post_init__(self) -> None:
        cfg = self.cfg
        if cfg.detokenize and cfg.tokenizer is not None:
            self.decoder = IncrementalDecoder(cfg.tokenizer, cfg.sp.skip_special_tokens, cfg.prompt)

    def step(self) -> int:
        """Generate one token and decide whether the sequence finishes."""
        cfg = self.cfg
        sp = cfg.sp
        allowed = sp.allowed_token_ids
        h = self.h
        tok = next_token(h, self.salt, cfg.vocab_size, allowed)
        before_min = len(self.tokens) < sp.min_tokens
        banned: set[int] = set()
        if before_min:
            banned.update(cfg.stop_ids)
            if not sp.ignore_eos:
                banned.add(EOS_TOKEN_ID)
            if tok in banned:
                tok = redraw(h, self.salt, cfg.vocab_size, banned, allowed)
        if cfg.first_differs and not self.tokens:
            # the fault: another token than the model's (still one min_tokens allows)
            tok = redraw(h, self.salt, cfg.vocab_size, banned | {tok}, allowed)
        if sp.logprobs is not None:
            self.logprobs.append(self._logprob_entry(h, tok))
        self.tokens.append(tok)
        self.h = fold(h, tok)
        n = len(self.tokens)
        # the engine's check_stop: EOS, stop_token_ids, then length (EOS/stop ids are masked out
        # before min_tokens, see above)
        stop_terminated = False
        if tok == EOS_TOKEN_ID and not sp.ignore_eos:
            self.finish_reason, stop_terminated = "stop", True
        elif tok in cfg.stop_ids:
            self.finish_reason, self.stop_reason, stop_terminated = "stop", tok, True
        elif n >= cfg.max_tokens:
            self.finish_reason = "length"
        if self.decoder is not None and not (stop_terminated and not sp.include_stop_str_in_output):
            # vLLM's detokenizer leaves out the token that stop-terminated the sequence
            piece = self.decoder.feed(tok)
            self.text += piece
            if cfg.stops and n > sp.min_tokens:
                self._check_stop_strings(len(piece))
        return tok

    def _check_stop_strings(self, new_char_count: int) -> None:
        """vLLM's ``check_stop_strings``: the stop string that completes earliest in the new text wins."""
        if not new_char_count:
            return
        text = self.text
        best: tuple[int, int, str] | None = None  # (end, index, stop)
        for stop in self.cfg.stops:
            idx = text.find(stop, max(0, len(text) - new_char_count - len(stop) + 1))
            if idx != -1 and (best is None or idx + len(stop) < best[0]):
                best = (idx + len(stop), idx, stop)
        if best is None:
            return
        end, idx, stop = best
        self.text = text[:end] if self.cfg.sp.include_stop_str_in_output else text[:idx]
        self.finish_reason, self.stop_reason = "stop", stop

    # -- deltas -----------------------------------------------------------------------------------

    def take_tokens(self) -> list[int]:
        new = self.tokens[self.sent :]
        self.sent = len(self.tokens)
        return new

    def take_text(self) -> str:
        """The text not yet sent, minus the stop-string hold-back while still running."""
        end = len(self.text) if self.finish_reason is not None else len(self.text) - self.cfg.holdback
        if end <= self.sent_text:
            return ""
        delta = self.text[self.sent_text : end]
        self.sent_text = end
        return delta

    def take_logprobs(self) -> dict[str, Any] | None:
        if self.cfg.sp.logprobs is None:
            return None
        new = self.logprobs[self.sent_logprobs :]
        self.sent_logprobs = len(self.logprobs)
        return {"content": new}

    def all_logprobs(self) -> dict[str, Any] | None:
        if self.cfg.sp.logprobs is None:
            return None
        return {"content": self.logprobs}

    # -- logprobs ---------------------------------------------------------------------------------

    def _candidates(self, h: int, tok: int, count: int) -> list[int]:
        """``count`` distinct tokens other than ``tok``, in rank order (deterministic)."""
        out: list[int] = []
        seen = {tok}
        attempt = 1
        while len(out) < count and attempt < 4 * count + 16:
            t = next_token(mix(h + 7919 * attempt), self.salt, self.cfg.vocab_size)
            attempt += 1
            if t not in seen:
                seen.add(t)
                out.append(t)
        return out

    def _logprob_entry(self, h: int, tok: int) -> dict[str, Any]:
        cfg = self.cfg
        k = cfg.sp.logprobs or 0
        if k == -1:
            k = cfg.vocab_size - 1
        rank = 1 if cfg.greedy else 1 + mix(h ^ self.salt ^ 0xA5A5) % 3
        top = logprob_of(h, self.salt, 0) - 5.0

        def lp(r: int) -> float:
            return top - 0.03125 * (r - 1)

        others = self._candidates(h, tok, max(k, rank))
        by_rank: list[tuple[int, int]] = []  # (rank, token)
        it = iter(others)
        for r in range(1, max(k, rank) + 1):
            by_rank.append((r, tok if r == rank else next(it, tok)))
        # vLLM lists the sampled token first, then the top-k, and cuts the list at max(k, 1)
        entries = ([(rank, tok)] + [(r, t) for r, t in by_rank if r <= k and r != rank])[: max(k, 1)]
        if cfg.text_mode and cfg.token_id_placeholders:

            def placeholder(r: int, t: int) -> dict[str, Any]:
                return {"token": f"token_id:{t}", "logprob": lp(r), "bytes": None}

            return {**placeholder(rank, tok), "top_logprobs": [placeholder(r, t) for r, t in entries]}
        if cfg.text_mode and cfg.tokenizer is not None:
            tz = cfg.tokenizer

            context = self.tokens

            def item(r: int, t: int) -> dict[str, Any]:
                s = logprob_token_text(tz, t, context)
                return {"token": s, "logprob": lp(r), "bytes": list(s.encode("utf-8", errors="replace"))}

            head = item(rank, tok)
            return {**head, "top_logprobs": [item(r, t) for r, t in entries]}
        return {
            "token_id": tok,
            "logprob": lp(rank),
            "rank": rank,
            "top_logprobs": [{"token_id": t, "logprob": lp(r), "rank": r} for r, t in entries],
        }


def prompt_logprobs(
    prompt: list[int], k: int, salt: int, vocab_size: int, tokenizer: ByteTokenizer | None
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's non-streaming ``prompt_logprobs``: null for the first token, then per position the
    prompt token and the top-k candidates keyed by token id (as strings)."""
    out: list[dict[str, dict[str, Any]] | None] = [None]
    h = fold_all(prompt[:1])
    for pos in range(1, len(prompt)):
        tok = prompt[pos]
        best = next_token(h, salt, vocab_size)
        top = logprob_of(h, salt, 0) - 5.0
        entry: dict[str, dict[str, Any]] = {}
        rank = 1 if tok == best else 2 + mix(h ^ tok) % (vocab_size - 1)

        context = prompt[1:pos]  # vLLM's context: the preceding scored prompt tokens

        def item(t: int, r: int, _top: float = top, _ctx: list[int] = context) -> dict[str, Any]:
            return {
                "logprob": _top - 0.03125 * (r - 1) - (0.5 if r > 1 else 0.0),
                "rank": r,
                "decoded_token": logprob_token_text(tokenizer, t, _ctx) if tokenizer is not None else None,
            }

        entry[str(tok)] = item(tok, rank)
        cands = [best]
        a = 1
        while len(cands) < k and a < 4 * k + 16:
            t = next_token(mix(h + 7919 * a), salt, vocab_size)
            a += 1
            if t not in cands:
                cands.append(t)
        for r, t in enumerate(cands[:k], start=1):
            if str(t) not in entry:
                entry[str(t)] = item(t, r)
        out.append(entry)
        h = fold(h, tok)
    return out
