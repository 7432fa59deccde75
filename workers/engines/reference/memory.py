"""Engine memory in use, per step.

On CUDA the caching allocator knows: ``memory_allocated`` and its peak since
the step began. The KV pool is allocated whole at start, so its unused part
is taken out and only the blocks held are counted, as on CPU.

On CPU nothing tracks tensors, so memory is accounted from shapes:

    memory_bytes      = weight_bytes + blocks_held × block_bytes
    peak_memory_bytes = weight_bytes + blocks_held_during_step × block_bytes
                        + transient_bytes(step)

    block_bytes = 2 (K and V) × layers × block_size × kv_heads × head_dim × elem

    transient_bytes = elem × [ 2·T·hidden                      residual + normed input
                             + max( attention phase, MLP phase ) ]
                      + 4 × S × vocab                          float32 logits of the S sampled rows
    attention phase = T·(H + 2·KVH)·D                          fused q/k/v projection
                    + T·(H + KVH)·D                            rotated q and k
                    + T·H·D                                    attention output
                    + 2·G_kv·KVH·D + G_mask                    K and V rows gathered from blocks, masks
                                                               (or the decode kernel's scores)
                    + 4·P·H·D                                  per prefill chunk: its keys per head,
                                                               two partial outputs and their merge
    MLP phase       = T·2·I + T·I + T·hidden                   gate|up, activation, down projection

with T the step's tokens, H/KVH/D the query heads, KV heads and head size,
I the MLP width, G_kv the key rows gathered for attention (padded decode
groups and cached prefixes), G_mask their additive mask entries (for the
CPU decode kernel, which gathers nothing: one score per query head and key), and P the
prefill tokens. Layers run one after another, so one layer's tensors are
the peak, not a sum over layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from workers.engines.reference.config import ModelConfig


@dataclass
class StepShape:
    """What the runner built for one step: enough to size its transient tensors."""

    num_tokens: int = 0
    num_sampled: int = 0
    num_prefill_tokens: int = 0
    num_gathered_kv_rows: int = 0
    num_mask_entries: int = 0


class MemoryInUse(NamedTuple):
    memory_bytes: int  # after the step
    peak_memory_bytes: int  # the step's high-water mark


def kv_block_bytes(config: ModelConfig, block_size: int, elem_bytes: int) -> int:
    return 2 * config.num_hidden_layers * block_size * config.num_key_value_heads * config.head_dim * elem_bytes


def transient_bytes(config: ModelConfig, shape: StepShape, elem_bytes: int) -> int:
    t = shape.num_tokens
    h, kvh, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    attention = (
        t * (h + 2 * kvh) * d
        + t * (h + kvh) * d
        + t * h * d
        + 2 * shape.num_gathered_kv_rows * kvh * d
        + shape.num_mask_entries
        + 4 * shape.num_prefill_tokens * h * d
    )
    mlp = t * 3 * config.intermediate_size + t * config.hidden_size
    return elem_bytes * (2 * t * config.hidden_size + max(attention, mlp)) + 4 * shape.num_sampled * config.vocab_size


class MemoryMeter:
    def __init__(
        self,
        config: ModelConfig,
        device: torch.device,
        weight_bytes: int,
        block_bytes: int,
        kv_pool_bytes: int,
        elem_bytes: int,
    ):
        self.config = config
        self.device = device
        self.weight_bytes = weight_bytes
        self.block_bytes = block_bytes
        self.kv_pool_bytes = kv_pool_bytes
        self.elem_bytes = elem_bytes
        self.on_cuda = device.type == "cuda"
        self.last_accounted = MemoryInUse(weight_bytes, weight_bytes)  # the formula's figures for the latest step

    def begin_step(self) -> None:
        if self.on_cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    def end_step(self, shape: StepShape, blocks_held_during: int, blocks_held_after: int) -> MemoryInUse:
        """Memory in use now and the step's peak."""
        now = self.weight_bytes + blocks_held_after * self.block_bytes
        peak = (
            self.weight_bytes
            + blocks_held_during * self.block_bytes
            + transient_bytes(self.config, shape, self.elem_bytes)
        )
        # Kept on CUDA too, where the allocator's figure is returned: the GPU
        # check compares the two (``python -m workers gpu-check``).
        self.last_accounted = MemoryInUse(now, max(peak, now))
        if self.on_cuda:
            unused_during = self.kv_pool_bytes - blocks_held_during * self.block_bytes
            unused_after = self.kv_pool_bytes - blocks_held_after * self.block_bytes
            now = torch.cuda.memory_allocated(self.device) - unused_after
            peak = torch.cuda.max_memory_allocated(self.device) - unused_during
            return MemoryInUse(now, max(peak, now))
        return self.last_accounted
