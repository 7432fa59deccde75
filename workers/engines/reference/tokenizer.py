"""The checkpoint's tokenizer, loaded the way transformers loads it.

``AutoTokenizer.from_pretrained`` reads the special tokens and the chat
template wherever the checkpoint keeps them: ``chat_template.jinja`` (how
transformers has saved templates since late 2024), ``chat_templates/``, or
the older ``chat_template`` key of ``tokenizer_config.json``. Encoding and
decoding then run on its fast backend (``tokenizers``) directly, without
transformers' per-call overhead; the ids are the same.

Encoding applies the tokenizer's own post-processor (a BOS, say), as
Hugging Face's fast tokenizers do, so both engines see the same ids.
Decoding is incremental (``IncrementalDetokenizer``) so a streamed token
costs a decode of a few ids, not of the whole output.
"""

from __future__ import annotations

import functools
import threading
from pathlib import Path
from typing import Any

from workers.engines.api import RequestError

# vLLM's words for a checkpoint without a template (transformers ≥ 4.44 has no default).
NO_TEMPLATE = (
    "The checkpoint's tokenizer has no chat template (neither chat_template.jinja nor a chat_template in "
    "tokenizer_config.json); as of transformers v4.44 there is no default one, so chat completions need a "
    "checkpoint that provides one. Use /v1/completions instead."
)


# transformers' lazy module is not safe to import from two threads at once
# (one sees it half-initialised: "no attribute 'AutoTokenizer'"); many
# workers of one process (``serve --count``) load their tokenizers together.
_LOAD_LOCK = threading.Lock()


def _load(path: str, mtime_ns: int) -> Any:
    with _LOAD_LOCK:
        return _load_once(path, mtime_ns)


@functools.lru_cache(maxsize=8)
def _load_once(path: str, mtime_ns: int) -> Any:
    """One transformers tokenizer per checkpoint (and version of its files)
    per process: the engine and its async wrapper share it."""
    import transformers  # seconds to import: only where a tokenizer is loaded

    return transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)


def _files_mtime_ns(path: Path) -> int:
    names = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")
    return max((p.stat().st_mtime_ns for name in names if (p := path / name).is_file()), default=0)


class Tokenizer:
    def __init__(self, model_dir: str | Path):
        path = Path(model_dir).resolve()
        if not (path / "tokenizer.json").is_file():
            raise FileNotFoundError(f"tokenizer.json: not found in {path}.")
        self._hf = _load(str(path), _files_mtime_ns(path))
        self._tok = self._hf.backend_tokenizer
        self.bos_token: str | None = self._hf.bos_token
        self.eos_token: str | None = self._hf.eos_token
        template = self._hf.chat_template
        self.chat_template: str | None = template if isinstance(template, str) else None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens))

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The template rendered by transformers itself (its sandbox, its helpers)."""
        if not self._hf.chat_template:
            raise RequestError(NO_TEMPLATE, "messages")
        try:
            text = self._hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        except Exception as exc:  # jinja2 errors: a template that rejects these messages (raise_exception)
            raise RequestError(f"the chat template rejected the messages: {exc}", "messages") from exc
        return str(text)


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
