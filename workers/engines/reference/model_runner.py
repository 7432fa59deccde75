"""Runs one scheduled step: packs every request's tokens into one flat batch,
runs the model once against the paged KV cache, and returns the logits of
the rows that produce a token.

Layout of the flat batch: first the one-token rows (decodes, one-token
chunks) sorted by context length and cut into groups whose padding stays
small, then each prefill chunk's rows. See ``attention.py`` for how each
kind attends.
"""

from __future__ import annotations

import numpy as np
import torch

from workers.engines.reference import cpu_kernels
from workers.engines.reference.attention import (
    AttentionContext,
    DecodeGroup,
    KernelDecode,
    PrefillChunk,
    Workspace,
)
from workers.engines.reference.config import ModelConfig
from workers.engines.reference.memory import StepShape
from workers.engines.reference.model import LlamaForCausalLM
from workers.engines.reference.scheduler import ScheduledChunk
from workers.engines.reference.threads import ThreadPolicy

# A group of one-token rows is padded to its longest context; start a new
# group when padding would exceed this share of the keys actually needed.
MAX_PADDING_RATIO = 1.3


class ModelRunner:
    def __init__(
        self,
        config: ModelConfig,
        model: LlamaForCausalLM,
        device: torch.device,
        dtype: torch.dtype,
        num_blocks: int,
        block_size: int,
        use_cpu_flash: bool = True,
    ):
        self.config = config
        self.model = model
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.use_cpu_flash = use_cpu_flash and device.type == "cpu"
        # CPU: every thread only while the machine has a core free for each (threads.py).
        self.thread_policy = ThreadPolicy(torch.get_num_threads() if device.type == "cpu" else 1)
        # Decode rows read the block pool in place on CPU (float32 only: numba has no bfloat16).
        self.use_decode_kernel = device.type == "cpu" and dtype == torch.float32 and cpu_kernels.available()
        if self.use_decode_kernel:
            cpu_kernels.set_threads(torch.get_num_threads())
            cpu_kernels.warm_up()
        self.workspace = Workspace(device, dtype)
        shape = (config.num_hidden_layers, 2, num_blocks, block_size, config.num_key_value_heads, config.head_dim)
        # torch.empty: on CPU the pages of blocks never written are never touched.
        self.kv_cache = torch.empty(shape, dtype=dtype, device=device)
        self.kv_caches = [(self.kv_cache[i, 0], self.kv_cache[i, 1]) for i in range(config.num_hidden_layers)]

    @torch.inference_mode()
    def run(
        self, chunks: list[ScheduledChunk], all_logits: bool = False
    ) -> tuple[torch.Tensor, list[ScheduledChunk], StepShape]:
        """Logits [S, vocab] (float32) for the S chunks that sample, those chunks, the step's shape.

        ``all_logits``: logits of every row instead, in the flat batch's order (scoring).
        """
        bs = self.block_size
        singles = sorted((c for c in chunks if c.num_tokens == 1), key=lambda c: c.start)
        multis = [c for c in chunks if c.num_tokens > 1]
        shape = StepShape()

        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        sampled: list[ScheduledChunk] = []
        for row, c in enumerate(singles):
            seq, p = c.seq, c.start
            ids.append(seq.token_ids[p])
            positions.append(p)
            slots.append(seq.block_table[p // bs] * bs + p % bs)
            if c.samples:
                sample_rows.append(row)
                sampled.append(c)
        pos_parts = [np.asarray(positions, dtype=np.int64)]
        slot_parts = [np.asarray(slots, dtype=np.int64)]

        kernel_decode = None
        decode_groups: list[DecodeGroup] = []
        if singles and self.use_decode_kernel:
            kernel_decode = self._kernel_decode(singles, shape)
        else:
            decode_groups = self._decode_groups(singles, shape)
        prefills: list[PrefillChunk] = []
        row = len(singles)
        for c in multis:
            seq, s, n = c.seq, c.start, c.num_tokens
            ids.extend(seq.token_ids[s : s + n])
            pos = np.arange(s, s + n, dtype=np.int64)
            table = np.asarray(seq.block_table[: -(-(s + n) // bs)], dtype=np.int64)
            pos_parts.append(pos)
            slot_parts.append(table[pos // bs] * bs + pos % bs)
            prefix = None
            if s > 0:
                prefix = torch.from_numpy(table[: -(-s // bs)]).to(self.device)
                shape.num_gathered_kv_rows += s
            prefills.append(PrefillChunk(row, row + n, s, prefix))
            shape.num_prefill_tokens += n
            row += n
            if c.samples:
                sample_rows.append(row - 1)
                sampled.append(c)

        device = self.device
        positions_t = torch.from_numpy(np.concatenate(pos_parts)).to(device)
        cos, sin = self.model.rope_cos_sin(positions_t, self.dtype)
        ctx = AttentionContext(
            slot_mapping=torch.from_numpy(np.concatenate(slot_parts)).to(device),
            cos=cos,
            sin=sin,
            kv_caches=self.kv_caches,
            decode_groups=decode_groups,
            kernel_decode=kernel_decode,
            prefills=prefills,
            use_cpu_flash=self.use_cpu_flash,
            workspace=self.workspace,
        )
        hidden = self.model(torch.tensor(ids, dtype=torch.long, device=device), ctx)
        if not all_logits and len(sample_rows) != hidden.shape[0]:
            hidden = hidden[torch.tensor(sample_rows, dtype=torch.long, device=device)]
        logits = self.model.compute_logits(hidden)
        shape.num_tokens = len(ids)
        shape.num_sampled = len(sample_rows)
        return logits, sampled, shape

    def _kernel_decode(self, singles: list[ScheduledChunk], shape: StepShape) -> KernelDecode:
        bs = self.block_size
        lens = np.fromiter((c.start + 1 for c in singles), dtype=np.int64, count=len(singles))
        table = np.zeros((len(singles), -(-int(lens[-1]) // bs)), dtype=np.int64)  # sorted: the last is longest
        for r, c in enumerate(singles):
            nb = -(-(c.start + 1) // bs)
            table[r, :nb] = c.seq.block_table[:nb]
        # the kernel's transient: one score per query head and key
        shape.num_mask_entries += self.config.num_attention_heads * int(lens.sum())
        return KernelDecode(len(singles), table, lens)

    def _decode_groups(self, singles: list[ScheduledChunk], shape: StepShape) -> list[DecodeGroup]:
        """Cut the one-token rows (sorted by context) into groups padded to their longest."""
        bs = self.block_size
        groups: list[DecodeGroup] = []
        i = 0
        while i < len(singles):
            j = i + 1
            total = singles[i].start + 1
            while j < len(singles):
                ctx = singles[j].start + 1
                if (j - i + 1) * ctx > MAX_PADDING_RATIO * (total + ctx):
                    break
                total += ctx
                j += 1
            members = singles[i:j]
            n = j - i
            context_len = members[-1].start + 1
            max_blocks = -(-context_len // bs)
            table = np.zeros((n, max_blocks), dtype=np.int64)
            for r, c in enumerate(members):
                nb = -(-(c.start + 1) // bs)
                table[r, :nb] = c.seq.block_table[:nb]
            mask = None
            if n > 1:
                lens = torch.tensor([c.start + 1 for c in members])
                capacity = max_blocks * bs
                mask = torch.zeros(n, 1, 1, capacity, dtype=self.dtype)
                mask.masked_fill_(
                    torch.arange(capacity)[None, None, None, :] >= lens[:, None, None, None], float("-inf")
                )
                mask = mask.to(self.device)
                shape.num_mask_entries += n * capacity
                shape.num_gathered_kv_rows += n * capacity
            else:
                shape.num_gathered_kv_rows += max_blocks * bs
            groups.append(DecodeGroup(i, j, torch.from_numpy(table).to(self.device), mask, context_len))
            i = j
        return groups
