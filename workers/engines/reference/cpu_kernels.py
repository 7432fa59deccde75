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
the engine falls back to the gather path (``attention.py``). The kernel is
sequential and releases the GIL; a step's tasks are split over a small
thread pool by key count.
"""

from __future__ import annotations

import concurrent.futures
import math
from typing import Any

import numpy as np
import torch

_kernel: Any = None
_pool: concurrent.futures.ThreadPoolExecutor | None = None
_num_threads = 1
# Below this many keys in a step, splitting across threads costs more than it saves.
_MIN_KEYS_PER_THREAD = 4096


def available() -> bool:
    return _load() is not None


def _load() -> Any:
    """The compiled kernel, or None without numba. Compiled lazily so that
    importing the engine does not import numba (and llvmlite) for nothing."""
    global _kernel
    if _kernel is not None:
        return _kernel
    try:
        from numba import njit
    except ImportError:  # pragma: no cover - exercised only without numba
        return None

    # Sequential and GIL-free; threads come from a plain pool below. numba's
    # own parallel layer would bring a second OpenMP pool whose idle threads
    # made torch's kernels an order of magnitude slower on a 2-core host.
    @njit(fastmath=True, cache=True, nogil=True)
    def decode_tasks(q, k_cache, v_cache, block_tables, context_lens, scale, out, first_task, end_task):
        num_heads, head_dim = q.shape[1], q.shape[2]
        block_size = k_cache.shape[1]
        num_kv_heads = k_cache.shape[2]
        group = num_heads // num_kv_heads
        for task in range(first_task, end_task):
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

    _kernel = decode_tasks
    return _kernel


def decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: np.ndarray, context_lens: np.ndarray
) -> torch.Tensor:
    """q: [n, H, D] float32 (one query token per request); caches [blocks, block_size, KVH, D].
    Returns [n, H, D]."""
    kernel = _load()
    out = torch.empty(q.shape, dtype=q.dtype)
    num_kv_heads = k_cache.shape[2]
    args = (
        q.contiguous().numpy(),
        k_cache.numpy(),
        v_cache.numpy(),
        block_tables,
        context_lens,
        np.float32(1.0 / math.sqrt(q.shape[-1])),
        out.numpy(),
    )
    num_tasks = q.shape[0] * num_kv_heads
    total_keys = int(context_lens.sum())
    # torch's thread count is the step's (threads.py lowers it on a loaded machine).
    workers = min(_num_threads, torch.get_num_threads(), num_tasks, max(1, total_keys // _MIN_KEYS_PER_THREAD))
    if workers <= 1 or _pool is None:
        kernel(*args, 0, num_tasks)
        return out
    # Split the tasks into contiguous ranges of about equal keys.
    work = np.repeat(context_lens, num_kv_heads).cumsum()
    bounds = (
        [0]
        + [int(np.searchsorted(work, total_keys * num_kv_heads * w / workers)) for w in range(1, workers)]
        + [num_tasks]
    )
    futures = [
        _pool.submit(kernel, *args, bounds[w], bounds[w + 1])  # type: ignore[call-arg]
        for w in range(1, workers)
        if bounds[w] < bounds[w + 1]
    ]
    kernel(*args, bounds[0], bounds[1])
    for f in futures:
        f.result()
    return out


def set_threads(num_threads: int) -> None:
    """Threads for the kernel (the calling thread plus a pool)."""
    global _pool, _num_threads
    num_threads = max(1, num_threads)
    if num_threads != _num_threads:
        if _pool is not None:
            _pool.shutdown(wait=False)
        _pool = (
            concurrent.futures.ThreadPoolExecutor(num_threads - 1, thread_name_prefix="decode-attn")
            if num_threads > 1
            else None
        )
        _num_threads = num_threads


def warm_up(dtype: Any = torch.float32) -> None:
    """Compile (or load the cached compilation) before the first real step."""
    if _load() is None:
        return
    q = torch.zeros(1, 2, 4, dtype=dtype)
    cache = torch.zeros(2, 4, 1, 4, dtype=dtype)
    decode_attention(q, cache, cache, np.zeros((1, 1), dtype=np.int64), np.ones(1, dtype=np.int64))
