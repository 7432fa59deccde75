"""The simulated engine: the reference engine's scheduling, a GPU's step times.

``SimLLMEngine`` is ``LLMEngine`` with its model replaced. Everything that
decides what a step holds is the reference engine's own code: scheduler,
block manager (so prefix caching and preemption), sequences, stop handling
and metrics. Only ``_execute`` differs: instead of a forward pass, it prices
the step on the simulated device (``steptime``), lets that time pass, and
emits one token per sampling sequence from a seeded generator over the
tokenizer's vocabulary.

Time passes in one of two ways:

- real time (a worker behind the gateway): the engine thread sleeps until the
  step's start plus its cost, so the scheduler's own Python time is part of
  the step, as a real engine's CPU overhead is;
- virtual time (``VirtualClock``; predictions): the clock jumps by the cost,
  and a whole replay runs as fast as the scheduler can step
  (``workers.engines.sim.virtual``).

Memory is the simulated device's: its weights, KV blocks of the simulated
model's shape, and a step's transient tensors by the reference engine's
formula (``reference/memory.py``), so peak, mean and fragmentation read as
they would on that GPU.
"""

from __future__ import annotations

import random
import time
import zlib
from array import array
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from workers.engines.api import MemoryFacts, RequestError
from workers.engines.reference.async_llm import AsyncLLM
from workers.engines.reference.block_manager import BlockManager
from workers.engines.reference.config import ModelConfig
from workers.engines.reference.llm_engine import LLMEngine, resolve_profile
from workers.engines.reference.memory import MemoryMeter, StepShape, kv_block_bytes
from workers.engines.reference.scheduler import ScheduledChunk, Scheduler
from workers.engines.reference.sequence import Sequence
from workers.engines.reference.tokenizer import Tokenizer
from workers.engines.sim.steptime import Device, StepBatch
from workers.profile import EngineProfile, ProfileError


class VirtualClock:
    """A clock that moves only when told: a replay's time without its waiting."""

    def __init__(self, start: float = 0.0):
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def advance_to(self, when: float) -> None:
        self.now = max(self.now, when)


def output_vocabulary(tokenizer: Tokenizer, vocab_size: int) -> list[int]:
    """Token ids a simulated step may emit: every id that decodes to text
    (specials, end of sequence among them, decode to nothing)."""
    return [i for i in range(vocab_size) if tokenizer.decode([i])]


class SimLLMEngine(LLMEngine):
    engine_kind = "sim"

    def __init__(
        self,
        device: Device,
        tokenizer_dir: str | Path,
        *,
        max_model_len: int | None = None,
        seed: int = 0,
        profile: EngineProfile | None = None,
        served_model_name: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] | None = time.sleep,
        **profile_fields: Any,
    ):
        # No super().__init__: it loads a checkpoint. The attributes below are
        # the ones LLMEngine's request, step and metrics code reads.
        self.sim_device = device
        self.model_dir = Path(tokenizer_dir)
        self.config = ModelConfig.from_pretrained(self.model_dir)  # the tokenizer's ids are checked against it
        native = device.model_config.max_position_embeddings
        if max_model_len is not None and not 0 < max_model_len <= native:
            raise ProfileError({"max_model_len": [f"must be between 1 and the model's {native}; got {max_model_len}."]})
        self.max_model_len = max_model_len or native
        self.profile = resolve_profile(profile, profile_fields, self.max_model_len)
        self.model_name = served_model_name or "sim"
        self.clock = clock
        self._sleep = sleep  # None: ``clock`` is a VirtualClock and advances instead
        self.device = torch.device("cpu")
        self.tokenizer = Tokenizer(self.model_dir)
        self.eos_token_ids = set(self.config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self._rng = random.Random(seed)
        self._vocab = output_vocabulary(self.tokenizer, self.config.vocab_size)

        p = self.profile
        self.block_bytes = kv_block_bytes(device.model_config, p.block_size, device.elem_bytes)
        fits = device.kv_cache_bytes(p.max_num_batched_tokens, p.max_num_seqs)
        kv_bytes = p.kv_cache_bytes or fits
        need = -(-self.max_model_len // p.block_size)
        num_blocks = kv_bytes // self.block_bytes
        if p.kv_cache_bytes and p.kv_cache_bytes > fits:
            raise ProfileError(
                {
                    "kv_cache_bytes": [
                        f"{p.kv_cache_bytes} bytes is more than the simulated {device.name} has free "
                        f"for KV after weights and activations ({fits} bytes)."
                    ]
                }
            )
        if num_blocks < need:
            raise ProfileError(
                {
                    "kv_cache_bytes": [
                        f"the simulated {device.name} holds {num_blocks} KV blocks of {p.block_size} tokens; one "
                        f"request of max_model_len ({self.max_model_len}) needs {need} "
                        f"({need * self.block_bytes} bytes)."
                    ]
                }
            )
        self.blocks = BlockManager(num_blocks, p.block_size, p.enable_prefix_caching)
        self.scheduler = Scheduler(p, self.blocks)
        self.memory = MemoryMeter(
            device.model_config,
            self.device,
            device.weight_bytes,
            self.block_bytes,
            num_blocks * self.block_bytes,
            device.elem_bytes,
        )
        self.requests: dict[str, Sequence] = {}
        self.failed_requests: dict[str, str] = {}
        self.observers = []
        self.num_steps = 0

    def _next_token(self, seq: Sequence) -> int:
        """Greedy (temperature 0): a function of the sequence so far, as a real
        model's argmax is, so one prompt gives one output however it was
        prefilled (the rollout's consistency gate compares them). Sampled: the
        engine's seeded generator."""
        if seq.params.temperature > 0:
            return self._rng.choice(self._vocab)
        tail = seq.token_ids[-8:]
        key = zlib.crc32(array("q", [len(seq.token_ids), *tail]).tobytes())
        return self._vocab[key % len(self._vocab)]

    def memory_facts(self) -> MemoryFacts:
        return MemoryFacts(self.sim_device.weight_bytes, self.block_bytes // self.profile.block_size)

    def score(self, token_ids: list[int], chunk_size: int | None = None) -> Any:
        raise RequestError("a simulated engine has no logits to score.", "prompt")

    def _execute(self, chunks: list[ScheduledChunk]) -> tuple[list[Sequence], Any, Any, dict[int, Any], StepShape]:
        started = self.clock()  # the scheduler ran just before: its time is already in the step
        cost = self.sim_device.step_seconds(StepBatch.of(chunks))
        if self._sleep is None:
            self.clock.advance(cost)  # type: ignore[attr-defined]
        else:
            wait = started + cost - self.clock()
            if wait > 0:
                self._sleep(wait)
        sampling = [c for c in chunks if c.samples]
        seqs = [c.seq for c in sampling]
        tokens = [self._next_token(seq) for seq in seqs]
        logprobs = [0.0] * len(seqs) if any(s.logprobs is not None for s in seqs) else None
        prefill = sum(c.num_tokens for c in chunks if not c.is_decode)
        shape = StepShape(
            num_tokens=sum(c.num_tokens for c in chunks),
            num_sampled=len(seqs),
            num_prefill_tokens=prefill,
            num_gathered_kv_rows=sum(c.start for c in chunks if not c.is_decode),
        )
        return seqs, tokens, logprobs, {}, shape


class SimAsyncLLM(AsyncLLM):
    """The streaming engine a simulated worker serves (real time)."""

    engine_kind = "sim"

    def __init__(self, device: Device, tokenizer_dir: str | Path, **kwargs: Any):
        self.sim_device = device
        super().__init__(tokenizer_dir, **kwargs)

    def _native_max_model_len(self) -> int:
        return self.sim_device.model_config.max_position_embeddings

    def _new_engine(self) -> LLMEngine:
        kwargs = {k: v for k, v in self._engine_kwargs.items() if k in ("max_model_len", "seed")}
        return SimLLMEngine(
            self.sim_device, self.model_dir, profile=self.profile, served_model_name=self.model_name, **kwargs
        )


__all__ = ["SimAsyncLLM", "SimLLMEngine", "VirtualClock", "output_vocabulary"]
