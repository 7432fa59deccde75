"""Factories for engine tests: real engines on the tiny checkpoint or on
small random checkpoints written by transformers (no mocks)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, NamedTuple

import torch

from workers.engines.api import RequestMetrics, StepMetrics

# One intra-op thread: these are correctness tests of small batches, and on a
# busy 2-core machine two OpenMP threads spend most of each tiny op waiting
# for each other (steps took 30× longer).
torch.set_num_threads(1)


def write_random_checkpoint(out: Path, tiny_model: Path, arch: str = "llama", **config: Any) -> Path:
    """A randomly initialised Hugging Face checkpoint with the tiny tokenizer."""
    import transformers  # seconds to import: only the tests that write a checkpoint pay for it

    torch.manual_seed(0)
    common: dict[str, Any] = dict(
        vocab_size=2048,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        initializer_range=0.2,  # large weights: logits far from uniform, a hard test
        bos_token_id=0,
        eos_token_id=1,
    )
    common.update(config)
    if arch == "qwen2":
        hf_config = transformers.Qwen2Config(**common)
        model = transformers.Qwen2ForCausalLM(hf_config)
    else:
        hf_config = transformers.LlamaConfig(**common)
        model = transformers.LlamaForCausalLM(hf_config)
    model.save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model / name, out / name)
    return out


class Finished(NamedTuple):
    metrics: RequestMetrics
    finish_reason: str


class Recorder:
    """An EngineObserver that keeps every record."""

    def __init__(self) -> None:
        self.steps: list[StepMetrics] = []
        self.finished: dict[str, Finished] = {}

    def on_step(self, step: StepMetrics) -> None:
        self.steps.append(step)

    def on_request_finished(self, request_id: str, metrics: RequestMetrics, finish_reason: str) -> None:
        self.finished[request_id] = Finished(metrics, finish_reason)
