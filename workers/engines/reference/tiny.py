"""The project's tiny Llama checkpoint: shipped in the repository, and the
recipe that builds it from nothing but the Python installation.

``python -m workers make-tiny-model OUT_DIR`` puts the checkpoint at
``OUT_DIR`` (tests and the demo run it first): a copy of the one shipped in
``workers/engines/reference/tiny_model/``, so every machine serves the same
bytes. Training on each machine did not give that: float sums differ between
CPU models, and on one the model came out looping on ``stmt_stmt_stmt``.
With ``--seed`` or ``--train-steps`` other than the recipe's it trains
instead (tests train a few steps to check that training is deterministic).

``python -m workers build-tiny-model [--out DIR]`` runs the recipe and
rewrites the shipped copy (commit the result): a byte-level BPE tokenizer
trained on the Python reference docs that ship with CPython
(``pydoc_data.topics``), then a ~3M-parameter Llama (head_dim 64, so vLLM's
CPU attention runs it too) trained on the same text for about a minute,
single-threaded with fixed seeds, so one machine always gives the same bytes
and greedy output is varied text. The result is a Hugging Face checkpoint
directory that transformers and vLLM load as they are.

Safe to run from several processes at once: one writes under a file lock
into a temporary directory that is renamed into place; the others wait and
then find it. Instant when ``OUT_DIR`` already holds this checkpoint: what
only training needs (torch, tokenizers, CPython's docs, the model) is
imported where it is used.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

RECIPE_VERSION = 2
STAMP = "chunkpilot_tiny_model.json"
SHIPPED_DIR = Path(__file__).resolve().parent / "tiny_model"
WEIGHTS = "model.safetensors"

VOCAB_SIZE = 2048
SPECIAL_TOKENS = ["<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
MODEL_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "hidden_act": "silu",
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "mlp_bias": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 2,
    "dtype": "float32",
    "initializer_range": 0.02,
}
# Training: fixed steps (not a time limit) so the result does not depend on the machine's speed.
TRAIN_STEPS = 400
BATCH_SIZE = 8
SEQ_LEN = 128
LEARNING_RATE = 4e-3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "out_dir", type=Path, help="checkpoint directory to write (skipped when it already holds this seed)"
    )
    parser.add_argument("--seed", type=int, default=0, help="training seed (default 0)")
    parser.add_argument("--quiet", action="store_true")
    parser.add_argument(
        "--train-steps", type=int, default=TRAIN_STEPS, help=argparse.SUPPRESS
    )  # tests: a quick, still deterministic, build


def main(args: argparse.Namespace) -> int:
    started = time.monotonic()
    built = ensure_tiny_model(
        args.out_dir, seed=args.seed, train_steps=args.train_steps, log=None if args.quiet else print
    )
    if not args.quiet:
        print(f"tiny model ready at {built} ({time.monotonic() - started:.1f}s)")
    return 0


def add_build_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=SHIPPED_DIR, help="where to write it (default: the shipped copy)")


def main_build(args: argparse.Namespace) -> int:
    """``build-tiny-model``: run the recipe and write the shipped checkpoint."""
    out = Path(args.out).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with _locked(out.parent / f".{out.name}.lock"):
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.building-", dir=out.parent))
        try:
            build(tmp, seed=0, train_steps=TRAIN_STEPS, log=print)
            stamp = {**_stamp(0, TRAIN_STEPS), "sha256": _sha256(tmp / WEIGHTS)}
            (tmp / STAMP).write_text(json.dumps(stamp) + "\n")
            _swap_in(tmp, out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    print(f"tiny model built at {out} ({time.monotonic() - started:.0f}s); weights sha256 {stamp['sha256']}")
    return 0


def _stamp(seed: int, train_steps: int) -> dict[str, int | str]:
    return {"recipe": RECIPE_VERSION, "seed": seed, "train_steps": train_steps}


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _read_stamp(model_dir: Path) -> object:
    try:
        return json.loads((model_dir / STAMP).read_text())
    except (OSError, ValueError):
        return None


def _wanted_stamp(seed: int, train_steps: int) -> object:
    """The recipe's own seed and length mean the shipped checkpoint (its
    stamp carries the weights' hash, so a copy once trained on this machine
    is replaced by it); others mean a local training run."""
    if (seed, train_steps) == (0, TRAIN_STEPS) and (SHIPPED_DIR / STAMP).is_file():
        return _read_stamp(SHIPPED_DIR)
    return _stamp(seed, train_steps)


def is_built(out_dir: Path, seed: int, train_steps: int = TRAIN_STEPS) -> bool:
    stamp = _read_stamp(out_dir)
    return stamp is not None and stamp == _wanted_stamp(seed, train_steps)


def _swap_in(tmp: Path, out: Path) -> None:
    if out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(out)


def ensure_tiny_model(
    out_dir: str | Path, *, seed: int = 0, train_steps: int = TRAIN_STEPS, log: object = None
) -> Path:
    out = Path(out_dir).resolve()
    if out == SHIPPED_DIR or is_built(out, seed, train_steps):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    say: Callable[[str], object] | None = log if callable(log) else None
    with _locked(out.parent / f".{out.name}.lock"):
        if is_built(out, seed, train_steps):  # another process built it while we waited
            return out
        if out.exists() and not (out / STAMP).exists() and any(out.iterdir()):
            raise FileExistsError(f"{out} exists and is not a tiny-model checkpoint; refusing to overwrite it.")
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.building-", dir=out.parent))
        try:
            shipped = _read_stamp(SHIPPED_DIR)
            if shipped is not None and _wanted_stamp(seed, train_steps) == shipped:
                for source in sorted(SHIPPED_DIR.iterdir()):
                    if source.is_file():
                        shutil.copyfile(source, tmp / source.name)
                if say is not None:
                    say(f"copied the shipped tiny model from {SHIPPED_DIR}")
            else:
                build(tmp, seed=seed, train_steps=train_steps, log=say)
            _swap_in(tmp, out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def training_texts() -> list[str]:
    """Text that ships with every CPython: the language reference's topics.

    Runs of whitespace become one space: with its layout kept, a model this
    small and this briefly trained learns mostly to emit blank lines.
    """
    from pydoc_data.topics import topics  # building only: see the module's docstring

    return [" ".join(topics[key].split()) for key in sorted(topics)]


def train_tokenizer(texts: list[str]):  # -> tokenizers.Tokenizer
    from tokenizers import (  # building only
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    bos_id = tokenizer.token_to_id("<s>")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos_id)]
    )
    return tokenizer


def build(out: Path, *, seed: int, train_steps: int = TRAIN_STEPS, log=None) -> None:
    # Building only (see the module's docstring): these pull torch.
    import torch
    from safetensors.torch import save_file

    from workers.engines.reference.config import ModelConfig
    from workers.engines.reference.model import LlamaForCausalLM

    say = log or (lambda *_: None)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    started = time.monotonic()
    texts = training_texts()
    tokenizer = train_tokenizer(texts)
    tokenizer.save(str(out / "tokenizer.json"))
    say(f"tokenizer: {tokenizer.get_vocab_size()} tokens trained on {sum(map(len, texts)) / 1e6:.1f} MB of text")

    eos_id, bos_id = tokenizer.token_to_id("</s>"), tokenizer.token_to_id("<s>")
    stream: list[int] = []
    for encoding in tokenizer.encode_batch(texts, add_special_tokens=False):
        stream.extend(encoding.ids)
        stream.append(eos_id)
    data = torch.tensor(stream, dtype=torch.long)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: the same float sums in the same order, every run
    try:
        torch.manual_seed(seed)
        config = ModelConfig.from_dict(MODEL_CONFIG)
        model = LlamaForCausalLM(config)
        _init_weights(model, std=0.02)  # MODEL_CONFIG["initializer_range"]
        generator = torch.Generator().manual_seed(seed)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, betas=(0.9, 0.95), weight_decay=0.05)
        model.train()
        for step in range(train_steps):
            # linear warm-up, then cosine decay to a tenth
            lr = LEARNING_RATE * min(1.0, (step + 1) / 20) * (0.1 + 0.45 * (1 + math.cos(math.pi * step / train_steps)))
            for group in optimizer.param_groups:
                group["lr"] = lr
            starts = torch.randint(0, len(data) - SEQ_LEN, (BATCH_SIZE,), generator=generator)
            windows = torch.stack([data[s : s + SEQ_LEN] for s in starts.tolist()])
            inputs = torch.cat([torch.full((BATCH_SIZE, 1), bos_id), windows[:, :-1]], dim=1)
            logits = model.forward_dense(inputs)
            loss = torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), windows.reshape(-1))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            if step % 50 == 0 or step == train_steps - 1:
                say(f"step {step:4d}  loss {loss.item():.3f}  ({time.monotonic() - started:.0f}s)")
    finally:
        torch.set_num_threads(threads)

    save_file(model.hf_state_dict(), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(MODEL_CONFIG, indent=2) + "\n")
    (out / "generation_config.json").write_text(
        json.dumps(
            {
                "bos_token_id": bos_id,
                "eos_token_id": [eos_id, tokenizer.token_to_id("<|end|>")],
                "pad_token_id": tokenizer.token_to_id("<pad>"),
            },
            indent=2,
        )
        + "\n"
    )
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "pad_token": "<pad>",
                "add_bos_token": True,
                "model_max_length": MODEL_CONFIG["max_position_embeddings"],
                "clean_up_tokenization_spaces": False,
                "chat_template": CHAT_TEMPLATE,
            },
            indent=2,
        )
        + "\n"
    )
    (out / STAMP).write_text(json.dumps(_stamp(seed, train_steps)) + "\n")
    say(f"built in {time.monotonic() - started:.0f}s")


def _init_weights(model, std: float) -> None:
    import torch  # building only

    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 2:
                torch.nn.init.normal_(param, mean=0.0, std=std)
            elif "bias" in name:
                param.zero_()
