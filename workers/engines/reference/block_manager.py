"""Paged KV cache bookkeeping: a pool of fixed-size blocks with reference
counts, and prefix caching by a chain of hashes over full blocks.

Design note. A block's hash covers its tokens and, through the previous
block's hash, every token before it, so equal hashes mean equal prefixes.
A full block whose KV has been computed is registered under its hash; a
later request whose prompt starts with the same blocks takes them (ref
count + 1) instead of recomputing. When the last reference goes, a
registered block stays in the cache but joins the free list at its tail, so
free blocks are reused least-recently-freed first (LRU eviction), and blocks
that never held a full hashed block are reused before any cached one. The
last prompt token is never served from the cache: its logits are needed.

Pure Python, no torch: the scheduler and the property tests use it as is.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from workers.engines.reference.sequence import Sequence


class NoFreeBlocksError(RuntimeError):
    pass


def block_hash(parent: int, token_ids: list[int]) -> int:
    """128-bit hash of a block's tokens chained to its parent block's hash."""
    h = hashlib.blake2b(parent.to_bytes(16, "little"), digest_size=16)
    h.update(array("q", token_ids).tobytes())
    return int.from_bytes(h.digest(), "little")


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1:
            raise ValueError("the KV cache must hold at least one block.")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[int | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}  # hash → block id
        # Free blocks in reuse order: the first is taken (and evicted) first.
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.num_evictions = 0

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free)

    def allocate(self, count: int) -> list[int]:
        if count > len(self.free):
            raise NoFreeBlocksError(f"{count} blocks wanted, {len(self.free)} free")
        blocks = []
        for _ in range(count):
            block, _ = self.free.popitem(last=False)
            old = self.block_hashes[block]
            if old is not None:  # evict: its content is about to be overwritten
                if self.cached.get(old) == block:
                    del self.cached[old]
                self.block_hashes[block] = None
                self.num_evictions += 1
            self.ref_counts[block] = 1
            blocks.append(block)
        return blocks

    def take_cached(self, block: int) -> None:
        """Add a reference to a cached block (reviving it if it was free)."""
        if self.ref_counts[block] == 0:
            del self.free[block]
        self.ref_counts[block] += 1

    def release(self, blocks: list[int]) -> None:
        # Tail blocks first: they are the least likely to be shared, so they
        # should be evicted before the prefix they extend.
        for block in reversed(blocks):
            count = self.ref_counts[block]
            if count <= 0:
                raise AssertionError(f"block {block} freed twice")
            self.ref_counts[block] = count - 1
            if count == 1:
                self.free[block] = None
                if self.block_hashes[block] is None:
                    self.free.move_to_end(block, last=False)

    def lookup(self, h: int) -> int | None:
        return self.cached.get(h)

    def register(self, block: int, h: int) -> None:
        if h in self.cached or self.block_hashes[block] is not None:
            return  # an identical block is cached already; this one stays private
        self.cached[h] = block
        self.block_hashes[block] = h

    def reset_prefix_cache(self) -> None:
        for block in list(self.cached.values()):
            self.block_hashes[block] = None
            if self.ref_counts[block] == 0:
                self.free.move_to_end(block, last=False)
        self.cached.clear()


class BlockManager:
    """Maps sequences to blocks of the pool."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.pool = BlockPool(num_blocks, block_size)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """New blocks ``seq`` needs to hold KV for its first ``num_tokens`` tokens."""
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    def _hashes(self, seq: Sequence, num_blocks: int) -> list[int]:
        hashes = seq.block_hashes
        bs = self.block_size
        tokens = seq.token_ids
        while len(hashes) < num_blocks:
            i = len(hashes)
            hashes.append(block_hash(hashes[-1] if hashes else 0, tokens[i * bs : (i + 1) * bs]))
        return hashes

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks covering the longest prefix of ``seq``, never its last token."""
        if not self.enable_prefix_caching:
            return []
        num_full = (seq.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for h in self._hashes(seq, num_full)[:num_full]:
            block = self.pool.lookup(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def admission_cost(self, hits: list[int], seq: Sequence, num_tokens: int) -> int:
        """Free blocks consumed by admitting ``seq`` with ``hits`` and room for ``num_tokens``."""
        revived = sum(1 for b in hits if self.pool.ref_counts[b] == 0)
        return revived + max(0, -(-num_tokens // self.block_size) - len(hits))

    def admit(self, seq: Sequence, hits: list[int]) -> None:
        assert not seq.block_table, seq
        for block in hits:
            self.pool.take_cached(block)
        seq.block_table = list(hits)
        seq.num_computed_tokens = len(hits) * self.block_size
        seq.num_registered_blocks = len(hits)

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Give ``seq`` blocks for its first ``num_tokens`` tokens."""
        need = self.blocks_needed(seq, num_tokens)
        if need:
            seq.block_table.extend(self.pool.allocate(need))

    def free(self, seq: Sequence) -> None:
        if seq.block_table:
            self.pool.release(seq.block_table)
        seq.block_table = []
        seq.num_registered_blocks = 0

    def register_computed(self, seq: Sequence) -> None:
        """Offer ``seq``'s newly completed full blocks to the prefix cache."""
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        if num_full <= seq.num_registered_blocks:
            return
        hashes = self._hashes(seq, num_full)
        for i in range(seq.num_registered_blocks, num_full):
            self.pool.register(seq.block_table[i], hashes[i])
        seq.num_registered_blocks = num_full
