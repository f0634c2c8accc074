"""A local tokenizer for the text datasets (``--tokenizer DIR``): nothing is downloaded.

``DIR`` is a model folder holding ``tokenizer.json`` (the ``tokenizers`` library's format, which
every Hugging Face fast tokenizer ships), or the path of that file. ``tokenizer_config.json`` beside
it, when present, gives the chat template and the special tokens it names. Prompts are encoded as
vLLM's benchmark does (``tokenizer(prompt).input_ids``: with the special tokens the tokenizer's
post-processor adds). The ``tokenizers`` library (and ``jinja2``, for a chat template) are imported
only when a tokenizer is loaded.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class TokenizerError(ValueError):
    """A tokenizer that cannot be loaded or used."""


@dataclass
class LocalTokenizer:
    """``tokenizer.json`` (through ``tokenizers``) plus the chat template of ``tokenizer_config.json``."""

    path: Path
    _tok: Any
    chat_template: str | None = None
    special: dict[str, str] = field(default_factory=dict)

    @property
    def vocab_size(self) -> int:
        size: int = self._tok.get_vocab_size(with_added_tokens=True)
        return size

    @property
    def special_ids(self) -> set[int]:
        """Ids of the added special tokens (``<s>``, ``</s>``, ...)."""
        out: set[int] = set()
        for tid, tok in self._tok.get_added_tokens_decoder().items():
            if getattr(tok, "special", False):
                out.add(int(tid))
        return out

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids: list[int] = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        text: str = self._tok.decode(list(ids), skip_special_tokens=False)
        return text

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """Render the chat template as transformers does (a sandboxed jinja2 environment)."""
        if not self.chat_template:
            raise TokenizerError(
                f"{self.path}: no chat_template in tokenizer_config.json (pass --skip-chat-template)"
            )
        try:
            from jinja2.sandbox import ImmutableSandboxedEnvironment  # noqa: PLC0415
        except ImportError:
            raise TokenizerError(
                "the chat template needs jinja2 (pip install 'pd-proxy[bench]'), "
                "or pass --skip-chat-template"
            ) from None
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        template = env.from_string(self.chat_template)
        text: str = template.render(
            messages=messages, add_generation_prompt=add_generation_prompt, **self.special
        )
        return text


def load_tokenizer(path: str | Path) -> LocalTokenizer:
    """The tokenizer of a local model folder (or of its ``tokenizer.json``)."""
    p = Path(path)
    file = p / "tokenizer.json" if p.is_dir() else p
    if not file.is_file():
        raise TokenizerError(
            f"no tokenizer at {path}: give a local directory holding tokenizer.json "
            "(pd-bench downloads nothing)"
        )
    try:
        from tokenizers import Tokenizer  # noqa: PLC0415
    except ImportError:
        raise TokenizerError(
            "--tokenizer needs the tokenizers library (pip install 'pd-proxy[bench]')"
        ) from None
    try:
        tok = Tokenizer.from_file(str(file))
    except Exception as exc:  # the library raises its own exception type for a bad file
        raise TokenizerError(f"{file}: not a tokenizers file ({exc})") from None
    template: str | None = None
    special: dict[str, str] = {}
    cfg_file = file.parent / "tokenizer_config.json"
    if cfg_file.is_file():
        try:
            cfg = json.loads(cfg_file.read_text(encoding="utf-8"))
        except ValueError as exc:
            raise TokenizerError(f"{cfg_file}: not JSON ({exc})") from None
        if isinstance(cfg, dict):
            raw = cfg.get("chat_template")
            template = raw if isinstance(raw, str) else None
            for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
                value = cfg.get(key)
                if isinstance(value, str):
                    special[key] = value
    return LocalTokenizer(path=file.parent, _tok=tok, chat_template=template, special=special)
