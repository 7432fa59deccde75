"""Paged attention over one step's packed tokens.

Design note. A step is one flat batch of tokens: first the rows whose
request runs a single query token (decodes, and one-token prefill chunks),
then each prefill chunk's rows. Every layer first writes the step's new keys
and values into the paged cache (``slot_mapping``), then attends:

* Single-token rows: on CPU in float32, one call of a kernel that reads
  each request's blocks where they lie (``cpu_kernels.py``). Otherwise, in
  groups of similar context length: gather each group's blocks into one
  padded tensor and run one SDPA call, the query heads of a KV head stacked
  as a group's query rows (grouped-query attention without copying keys
  per query head).
* A prefill chunk at global positions ``[start, start + n)``: on CPU, two
  flash-attention calls merged by their log-sum-exp — the chunk against
  itself (causal) and the chunk against the cached prefix ``[0, start)``
  (no mask, query heads stacked). That keeps the CPU kernel on its
  fast paths, where one call with an explicit offset-causal mask ran ~2×
  slower. Elsewhere (CUDA) one SDPA call with that mask.

A chunk thus attends to the cached keys of every earlier chunk, at global
positions; the result equals a whole-prompt prefill up to float rounding.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from workers.engines.reference import cpu_kernels

_flash_cpu = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


@dataclass
class DecodeGroup:
    row_start: int
    row_end: int
    block_tables: torch.Tensor  # [n, max_blocks] int64
    mask: torch.Tensor | None  # [n, 1, 1, max_blocks * block_size] additive; None: one request
    context_len: int  # keys to read per row (the max in the group)


@dataclass
class PrefillChunk:
    row_start: int
    row_end: int
    start: int  # global position of the chunk's first token (= cached prefix length)
    prefix_blocks: torch.Tensor | None  # blocks holding positions [0, start); None when start == 0


class Workspace:
    """Reusable scratch tensors: gathers of many megabytes would otherwise be
    fresh allocations, paged in anew at every layer of every step."""

    def __init__(self, device: torch.device, dtype: torch.dtype):
        self.device = device
        self.dtype = dtype
        self.buffers: dict[str, torch.Tensor] = {}

    def take(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        numel = 1
        for n in shape:
            numel *= n
        buf = self.buffers.get(name)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(max(numel, 1 << 16), dtype=self.dtype, device=self.device)
            self.buffers[name] = buf
        return buf[:numel].view(shape)


@dataclass
class KernelDecode:
    """Single-token rows [0, num_rows) for the in-place CPU kernel."""

    num_rows: int
    block_tables: np.ndarray  # [num_rows, max_blocks] int64, padded with 0
    context_lens: np.ndarray  # [num_rows] int64


@dataclass
class AttentionContext:
    slot_mapping: torch.Tensor  # [num_tokens] int64 flat cache slot of each token
    cos: torch.Tensor  # [num_tokens, head_dim // 2]
    sin: torch.Tensor
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: [num_blocks, block_size, kv_heads, head_dim]
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    kernel_decode: KernelDecode | None = None
    prefills: list[PrefillChunk] = field(default_factory=list)
    use_cpu_flash: bool = True
    workspace: Workspace | None = None


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (Hugging Face's form, same rounding). x: [T, heads, D]."""
    x1, x2 = x.chunk(2, dim=-1)
    c = cos.unsqueeze(-2)
    s = sin.unsqueeze(-2)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def paged_attention(
    layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: AttentionContext
) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, KVH, D] for the step's tokens. Returns [T, H, D]."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    k_cache, v_cache = ctx.kv_caches[layer]
    block_size = k_cache.shape[1]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, ctx.slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, ctx.slot_mapping, v)

    ws = ctx.workspace
    if len(ctx.prefills) == 1 and not ctx.decode_groups and ctx.kernel_decode is None:
        return _prefill(q, k, v, k_cache, v_cache, ctx.prefills[0], group, ctx.use_cpu_flash, ws)

    out = q.new_empty(num_tokens, num_heads, head_dim)
    kd = ctx.kernel_decode
    if kd is not None:
        out[: kd.num_rows] = cpu_kernels.decode_attention(
            q[: kd.num_rows], k_cache, v_cache, kd.block_tables, kd.context_lens
        )
    for g in ctx.decode_groups:
        n = g.row_end - g.row_start
        capacity = g.block_tables.shape[1] * block_size
        kk = _gather(k_cache, g.block_tables.view(-1), ws, "decode_k").view(n, capacity, num_kv_heads, head_dim)
        vv = _gather(v_cache, g.block_tables.view(-1), ws, "decode_v").view(n, capacity, num_kv_heads, head_dim)
        if g.mask is None:
            kk = kk[:, : g.context_len]
            vv = vv[:, : g.context_len]
        qq = q[g.row_start : g.row_end].reshape(n, num_kv_heads, group, head_dim)
        o = F.scaled_dot_product_attention(qq, kk.transpose(1, 2), vv.transpose(1, 2), attn_mask=g.mask)
        out[g.row_start : g.row_end] = o.reshape(n, num_heads, head_dim)
    for p in ctx.prefills:
        out[p.row_start : p.row_end] = _prefill(q, k, v, k_cache, v_cache, p, group, ctx.use_cpu_flash, ws)
    return out


def _gather(cache: torch.Tensor, blocks: torch.Tensor, ws: Workspace | None, name: str) -> torch.Tensor:
    """The blocks' rows of ``cache`` [blocks, block_size, KVH, D], contiguous:
    a view when the blocks are consecutive (a prompt prefilled on a quiet
    pool usually is), a copy otherwise."""
    flat = cache.view(cache.shape[0], -1)
    n = blocks.shape[0]
    if blocks.device.type == "cpu" and n > 1:
        first, last = int(blocks[0]), int(blocks[-1])
        if last - first == n - 1 and bool((blocks[1:] - blocks[:-1] == 1).all()):
            return flat[first : last + 1]
    if ws is None:
        return torch.index_select(flat, 0, blocks)
    out = ws.take(name, (blocks.shape[0], flat.shape[1]))
    return torch.index_select(flat, 0, blocks, out=out)


def _prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    p: PrefillChunk,
    group: int,
    use_cpu_flash: bool,
    ws: Workspace | None,
) -> torch.Tensor:
    n = p.row_end - p.row_start
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k.shape[1]
    qc = q[p.row_start : p.row_end]  # [n, H, D]
    kc = k[p.row_start : p.row_end]
    vc = v[p.row_start : p.row_end]
    if p.start == 0:
        o = F.scaled_dot_product_attention(
            qc.transpose(0, 1)[None],
            kc.transpose(0, 1)[None],
            vc.transpose(0, 1)[None],
            is_causal=True,
            enable_gqa=group > 1,
        )
        return o[0].transpose(0, 1)
    assert p.prefix_blocks is not None
    kp = _gather(k_cache, p.prefix_blocks, ws, "prefix_k").view(-1, num_kv_heads, head_dim)[: p.start]
    vp = _gather(v_cache, p.prefix_blocks, ws, "prefix_v").view(-1, num_kv_heads, head_dim)[: p.start]

    if not use_cpu_flash or _flash_cpu is None or q.device.type != "cpu":
        keys = torch.cat((kp, kc)).transpose(0, 1)[None]
        values = torch.cat((vp, vc)).transpose(0, 1)[None]
        mask = torch.ones(n, p.start + n, dtype=torch.bool, device=q.device).tril(p.start)
        o = F.scaled_dot_product_attention(qc.transpose(0, 1)[None], keys, values, attn_mask=mask, enable_gqa=group > 1)
        return o[0].transpose(0, 1)

    # The chunk against itself, causal: keys repeated per query head (n rows only).
    if group > 1:
        kc = kc.repeat_interleave(group, dim=1)
        vc = vc.repeat_interleave(group, dim=1)
    o_self, lse_self = _flash_cpu(
        qc.transpose(0, 1)[None], kc.transpose(0, 1)[None], vc.transpose(0, 1)[None], 0.0, True
    )[:2]
    # The chunk against the cached prefix, unmasked: a KV head's query heads
    # stacked as n·group query rows, so the prefix is read once per KV head.
    q_stacked = (
        qc.reshape(n, num_kv_heads, group, head_dim).permute(1, 2, 0, 3).reshape(1, num_kv_heads, group * n, head_dim)
    )
    o_prefix, lse_prefix = _flash_cpu(q_stacked, kp.transpose(0, 1)[None], vp.transpose(0, 1)[None], 0.0, False)[:2]
    o_prefix = o_prefix.reshape(1, num_heads, n, head_dim)
    lse_prefix = lse_prefix.reshape(1, num_heads, n)
    # softmax over both key sets = the two partial results weighted by their
    # shares of the total mass: o_prefix + σ(lse_self − lse_prefix)·(o_self − o_prefix)
    weight = torch.sigmoid(lse_self - lse_prefix).unsqueeze(-1).to(o_self.dtype)
    o = torch.lerp(o_prefix, o_self, weight)
    return o[0].transpose(0, 1)
