"""The checkpoint's tokenizer: ``tokenizer.json`` through ``tokenizers``,
special tokens and the chat template from ``tokenizer_config.json``.

Encoding applies the tokenizer's own post-processor (a BOS, say), as
Hugging Face's fast tokenizers do, so both engines see the same ids.
Decoding is incremental (``IncrementalDetokenizer``) so a streamed token
costs a decode of a few ids, not of the whole output.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer


class Tokenizer:
    def __init__(self, model_dir: str | Path):
        path = Path(model_dir)
        if not (path / "tokenizer.json").is_file():
            raise FileNotFoundError(f"tokenizer.json: not found in {path}.")
        self._tok = HFTokenizer.from_file(str(path / "tokenizer.json"))
        config: dict[str, Any] = {}
        if (path / "tokenizer_config.json").is_file():
            config = json.loads((path / "tokenizer_config.json").read_text())
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.chat_template: str | None = config.get("chat_template")
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens))

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise ValueError("chat_template: the checkpoint's tokenizer_config.json has none.")
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        return env.from_string(self.chat_template).render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # {"content": "<s>", ...} in older configs
        return value.get("content")
    return value


class IncrementalDetokenizer:
    """vLLM's scheme: decode a short window of ids twice (before and after
    the new ones) and emit the difference, holding back text while the last
    bytes are an incomplete UTF-8 character. The window starts a few prompt
    tokens back so tokenizers that mark word starts (SentencePiece) get the
    first space right."""

    __slots__ = ("tokenizer", "prefix_offset", "read_offset", "skip_special_tokens")

    def __init__(self, tokenizer: Tokenizer, num_prompt_tokens: int, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.prefix_offset = max(num_prompt_tokens - 5, 0)
        self.read_offset = num_prompt_tokens
        self.skip_special_tokens = skip_special_tokens

    def step(self, all_token_ids: list[int]) -> str:
        """New text once ``all_token_ids`` grew; '' while a character is incomplete."""
        decode = self.tokenizer.decode
        prefix = decode(all_token_ids[self.prefix_offset : self.read_offset], self.skip_special_tokens)
        full = decode(all_token_ids[self.prefix_offset :], self.skip_special_tokens)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset = self.read_offset
            self.read_offset = len(all_token_ids)
            return full[len(prefix) :]
        return ""
