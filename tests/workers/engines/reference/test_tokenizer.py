"""The checkpoint's tokenizer as transformers loads it: the chat template
wherever transformers keeps it, and a clear refusal when there is none."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from workers.engines.api import RequestError
from workers.engines.reference.tokenizer import Tokenizer

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]


def copy_without_template(tiny_model: Path, out: Path) -> tuple[Path, str]:
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(tiny_model / name, out / name)
    config = json.loads((out / "tokenizer_config.json").read_text())
    template = config.pop("chat_template")
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out, template


def test_a_template_in_chat_template_jinja_is_read_as_transformers_saves_it(tiny_model: Path, tmp_path: Path) -> None:
    out, template = copy_without_template(tiny_model, tmp_path)
    (out / "chat_template.jinja").write_text(template)
    expected = Tokenizer(tiny_model).apply_chat_template(MESSAGES)
    tokenizer = Tokenizer(out)
    assert tokenizer.chat_template == template
    assert (
        tokenizer.apply_chat_template(MESSAGES)
        == expected
        == ("<s><|system|>\nBe brief.<|end|>\n<|user|>\nhi<|end|>\n<|assistant|>\n")
    )


def test_a_checkpoint_without_any_template_refuses_chat_naming_messages(tiny_model: Path, tmp_path: Path) -> None:
    out, _ = copy_without_template(tiny_model, tmp_path)
    tokenizer = Tokenizer(out)
    assert tokenizer.chat_template is None
    with pytest.raises(RequestError, match="no chat template") as info:
        tokenizer.apply_chat_template(MESSAGES)
    assert info.value.field == "messages"


def test_special_tokens_and_ids_match_the_checkpoint(tiny_model: Path) -> None:
    tokenizer = Tokenizer(tiny_model)
    assert (tokenizer.bos_token, tokenizer.eos_token) == ("<s>", "</s>")
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1)
    ids = tokenizer.encode("The for statement")
    assert ids[0] == 0 and tokenizer.decode(ids) == "The for statement"
