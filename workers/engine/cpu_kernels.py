"""Decode attention on CPU that reads the paged cache in place.

Design note. A decode step's attention is bound by memory traffic: every
running request's keys and values are read once. Gathering them out of the
block pool into a padded tensor for SDPA reads them, writes a copy and
reads the copy again — about three times the traffic, which made the
gather most of a decode step. This kernel walks each request's block table
and reads keys and values where they lie (as vLLM's CPU paged-attention
kernel does), one (request, KV head) pair per task, the KV head's query
heads together so each key is read once for all of them.

Compiled with numba on first use (cached on disk); when numba is missing
the engine falls back to the gather path (``attention.py``).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

try:  # numba comes with vLLM's CPU build; optional for the reference engine
    import numba
    from numba import njit, prange
except ImportError:  # pragma: no cover - exercised only without numba
    numba = None


def available() -> bool:
    return numba is not None


if numba is not None:

    @njit(parallel=True, fastmath=True, cache=True, nogil=True)
    def _decode_kernel(q, k_cache, v_cache, block_tables, context_lens, scale, out):  # type: ignore[no-untyped-def]
        num_seqs, num_heads, head_dim = q.shape
        block_size = k_cache.shape[1]
        num_kv_heads = k_cache.shape[2]
        group = num_heads // num_kv_heads
        for task in prange(num_seqs * num_kv_heads):
            i = task // num_kv_heads
            kv = task % num_kv_heads
            n = context_lens[i]
            scores = np.empty((group, n), dtype=np.float32)
            for t in range(n):
                block = block_tables[i, t // block_size]
                off = t % block_size
                for g in range(group):
                    s = np.float32(0.0)
                    for d in range(head_dim):
                        s += q[i, kv * group + g, d] * k_cache[block, off, kv, d]
                    scores[g, t] = s * scale
            acc = np.zeros((group, head_dim), dtype=np.float32)
            totals = np.empty(group, dtype=np.float32)
            for g in range(group):
                m = scores[g, 0]
                for t in range(1, n):
                    if scores[g, t] > m:
                        m = scores[g, t]
                total = np.float32(0.0)
                for t in range(n):
                    e = np.exp(scores[g, t] - m)
                    scores[g, t] = e
                    total += e
                totals[g] = total
            for t in range(n):
                block = block_tables[i, t // block_size]
                off = t % block_size
                for g in range(group):
                    p = scores[g, t]
                    for d in range(head_dim):
                        acc[g, d] += p * v_cache[block, off, kv, d]
            for g in range(group):
                inv = np.float32(1.0) / totals[g]
                for d in range(head_dim):
                    out[i, kv * group + g, d] = acc[g, d] * inv


def decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: np.ndarray, context_lens: np.ndarray
) -> torch.Tensor:
    """q: [n, H, D] float32 (one query token per request); caches [blocks, block_size, KVH, D].
    Returns [n, H, D]."""
    out = torch.empty(q.shape, dtype=q.dtype)
    _decode_kernel(
        q.contiguous().numpy(),
        k_cache.numpy(),
        v_cache.numpy(),
        block_tables,
        context_lens,
        np.float32(1.0 / math.sqrt(q.shape[-1])),
        out.numpy(),
    )
    return out


def set_threads(num_threads: int) -> None:
    if numba is not None:
        numba.set_num_threads(max(1, min(num_threads, numba.config.NUMBA_NUM_THREADS)))


def warm_up(dtype: Any = torch.float32) -> None:
    """Compile (or load the cached compilation) before the first real step."""
    if numba is None:
        return
    q = torch.zeros(1, 2, 4, dtype=dtype)
    cache = torch.zeros(2, 4, 1, 4, dtype=dtype)
    decode_attention(q, cache, cache, np.zeros((1, 1), dtype=np.int64), np.ones(1, dtype=np.int64))
