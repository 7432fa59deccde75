"""The step scheduler: which requests run how many tokens in the next step.

Design note. One step has a token budget, ``max_num_batched_tokens``, spent
on decode tokens (one per running request) and prefill tokens. Two policies
(``prefill_mode``; "Engine contract" in docs/architecture.md):

* monolithic — nano-vllm's prefill-first: waiting prompts that fit run
  whole, and if any prompt runs, decodes wait for the next step. Simple and
  the fastest way through a prompt, but a long prompt stalls every stream.
* chunked — Sarathi: running decodes first, one token each, then prefill
  chunks fill what is left of the budget, partially-prefilled requests
  before waiting ones (FCFS), at most ``chunk_cap`` tokens per request per
  step; prompts with at most ``short_prompt_threshold`` tokens left to
  compute after their prefix-cache hit are never split (a 100K prompt with a
  95K cached prefix is a short prefill); while a prefill waits, ``min_prefill_tokens_per_step`` of the
  budget is kept for prefill (excess decodes wait a step, oldest-served
  first) so a prefill always advances.

Chunks are groups of computation, never a restart: a request's positions
are global and each chunk attends to the KV of every chunk before it. The
profile is read at the start of each step, so a change between steps
applies to every request, including one halfway through its prefill.

KV blocks: a request holds blocks for the tokens it has computed plus the
ones scheduled now. Waiting requests are admitted only when enough blocks
are free (admission control); when a running request cannot grow, the
newest running request not yet given work this step is preempted: its
blocks are freed and it is recomputed later (its cached prefix usually
survives in the prefix cache).

Pure Python: no torch. Time comes in as ``now``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from workers.engines.reference.block_manager import BlockManager
from workers.engines.reference.sequence import Sequence, SequenceStatus
from workers.profile import EngineProfile


@dataclass
class ScheduledChunk:
    seq: Sequence
    start: int  # tokens with KV before this step (the chunk's first global position)
    num_tokens: int
    is_decode: bool

    @property
    def samples(self) -> bool:
        """The chunk reaches the sequence's last token, so it yields the next token."""
        return self.start + self.num_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_preemptions: int = 0
    prefill_chunk_waits: list[float] = field(default_factory=list)
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens


class Scheduler:
    def __init__(self, profile: EngineProfile, block_manager: BlockManager):
        self.profile = profile
        self.blocks = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the last is the newest
        self.num_steps = 0

    # ---- requests ----------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """Take ``seq`` out (finished or aborted) and free its blocks."""
        if seq.status in (SequenceStatus.WAITING, SequenceStatus.PREEMPTED):
            self.waiting.remove(seq)
        elif seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        self.blocks.free(seq)
        seq.status = status

    # ---- one step --------------------------------------------------------
    def schedule(self, now: float) -> SchedulerOutput:
        self.num_steps += 1
        out = SchedulerOutput()
        if self.profile.is_chunked:
            self._schedule_chunked(out, now)
        else:
            self._schedule_monolithic(out, now)
        return out

    def _schedule_chunked(self, out: SchedulerOutput, now: float) -> None:
        p = self.profile
        budget = p.max_num_batched_tokens
        scheduled: set[int] = set()
        decodes = [s for s in self.running if s.is_decoding]
        partials = [s for s in self.running if not s.is_decoding]
        prefill_waits = bool(partials) or (bool(self.waiting) and len(self.running) < p.max_num_seqs)

        # First, the running decodes, one token each. While a prefill waits,
        # keep min_prefill_tokens_per_step of the budget for it; the decodes
        # that do not fit then wait a step, those served longest ago going first.
        decode_budget = budget
        if prefill_waits and p.min_prefill_tokens_per_step:
            decode_budget = max(0, budget - p.min_prefill_tokens_per_step)
        if len(decodes) > decode_budget:
            decodes.sort(key=lambda s: s.last_scheduled_step)
            decodes = decodes[:decode_budget]
        for seq in decodes:
            if seq.status != SequenceStatus.RUNNING:
                continue  # preempted to make room for an earlier decode
            if self._reserve(seq, 1, scheduled, out, now):
                self._add_chunk(out, scheduled, seq, 1, now)
                budget -= 1

        # Second, requests part-way through their prefill, oldest first.
        for seq in partials:
            if budget == 0:
                break
            if seq.status != SequenceStatus.RUNNING:
                continue
            n = self._chunk_size(seq.num_uncomputed_tokens, seq.num_tokens - seq.metrics.num_cached_tokens, budget)
            if n and self._reserve(seq, n, scheduled, out, now):
                self._add_chunk(out, scheduled, seq, n, now)
                budget -= n

        # Third, waiting requests in arrival order, while budget, seats and blocks last.
        while self.waiting and budget > 0 and len(self.running) < p.max_num_seqs:
            n = self._admit_next(out, budget, whole=False)
            if n == 0:
                break
            self._add_chunk(out, scheduled, self.running[-1], n, now)
            budget -= n

    def _schedule_monolithic(self, out: SchedulerOutput, now: float) -> None:
        p = self.profile
        budget = p.max_num_batched_tokens
        scheduled: set[int] = set()

        # First, prefills, each whole: any left part-way by a switch from
        # chunked mode, then waiting prompts in arrival order.
        for seq in [s for s in self.running if not s.is_decoding]:
            n = seq.num_uncomputed_tokens
            if n > budget:
                break
            if seq.status == SequenceStatus.RUNNING and self._reserve(seq, n, scheduled, out, now):
                self._add_chunk(out, scheduled, seq, n, now)
                budget -= n
        while self.waiting and len(self.running) < p.max_num_seqs:
            n = self._admit_next(out, budget, whole=True)
            if n == 0:
                break
            self._add_chunk(out, scheduled, self.running[-1], n, now)
            budget -= n
        if out.chunks:
            return  # decodes wait for the prefills

        # Then, with no prefill to run, every running request decodes.
        for seq in list(self.running):
            if seq.status == SequenceStatus.RUNNING and self._reserve(seq, 1, scheduled, out, now):
                self._add_chunk(out, scheduled, seq, 1, now)

    # ---- helpers ---------------------------------------------------------
    def _chunk_size(self, remaining: int, after_hit: int, budget: int) -> int:
        """Prefill tokens a request may run now: its ``remaining`` ones, capped by
        the chunk cap and the budget; all or nothing for a short prefill, one
        with at most the threshold left to compute ``after_hit`` (its prefix-cache hit)."""
        p = self.profile
        if p.short_prompt_threshold is not None and after_hit <= p.short_prompt_threshold:
            return remaining if remaining <= budget else 0
        return min(remaining, p.chunk_cap, budget)

    def _admit_next(self, out: SchedulerOutput, budget: int, whole: bool) -> int:
        """Admit the first waiting request if its next chunk fits the budget and
        the free blocks; returns the chunk's size (0: not admitted)."""
        seq = self.waiting[0]
        hits = self.blocks.find_cached_prefix(seq)
        cached = len(hits) * self.blocks.block_size
        remaining = seq.num_tokens - cached
        if whole:
            n = remaining if remaining <= budget else 0
        else:
            n = self._chunk_size(remaining, remaining, budget)
        if n == 0:
            return 0
        if self.blocks.admission_cost(hits, seq, cached + n) > self.blocks.num_free_blocks:
            return 0
        self.waiting.popleft()
        self.blocks.admit(seq, hits)
        self.blocks.grow(seq, cached + n)
        if seq.status == SequenceStatus.WAITING:  # first admission, not a recompute
            seq.metrics.num_cached_tokens = cached
        out.prefix_cache_queries += seq.num_tokens if self.blocks.enable_prefix_caching else 0
        out.prefix_cache_hits += cached
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        return n

    def _reserve(self, seq: Sequence, n: int, scheduled: set[int], out: SchedulerOutput, now: float) -> bool:
        """Blocks for ``n`` more tokens of ``seq``, preempting the newest running
        requests not yet scheduled this step; False if ``seq`` itself had to go."""
        need = self.blocks.blocks_needed(seq, seq.num_computed_tokens + n)
        while need > self.blocks.num_free_blocks:
            victim = next((s for s in reversed(self.running) if id(s) not in scheduled), None)
            if victim is None:
                return False  # everything else already runs this step: wait for the next
            self._preempt(victim, out, now)
            if victim is seq:
                return False
        self.blocks.grow(seq, seq.num_computed_tokens + n)
        return True

    def _preempt(self, seq: Sequence, out: SchedulerOutput, now: float) -> None:
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.PREEMPTED
        seq.ready_time = now
        seq.metrics.num_preemptions += 1
        out.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _add_chunk(self, out: SchedulerOutput, scheduled: set[int], seq: Sequence, n: int, now: float) -> None:
        is_decode = seq.is_decoding
        out.chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, n, is_decode))
        scheduled.add(id(seq))
        seq.last_scheduled_step = self.num_steps
        if not seq.ever_scheduled:
            seq.ever_scheduled = True
            seq.metrics.first_scheduled_time = now
        if is_decode:
            out.num_decode_tokens += n
        else:
            out.num_prefill_tokens += n
            wait = max(0.0, now - seq.ready_time)
            out.prefill_chunk_waits.append(wait)
            seq.metrics.prefill_chunk_waits.append(wait)
            if seq.metrics.prefill_chunks is not None:
                seq.metrics.prefill_chunks.append((now, n))

    def complete(self, out: SchedulerOutput, now: float) -> None:
        """After the forward: the scheduled tokens now have KV in the cache."""
        for chunk in out.chunks:
            seq = chunk.seq
            seq.num_computed_tokens = chunk.start + chunk.num_tokens
            self.blocks.register_computed(seq)
            if not chunk.is_decode:
                seq.ready_time = now

    # ---- figures -----------------------------------------------------------
    def num_tokens_stored(self) -> int:
        """Tokens whose KV the held blocks hold, a shared block counted once.

        Only full blocks are shared (prefix hits), so every reference beyond
        a block's first stands for ``block_size`` tokens counted twice.
        """
        computed = sum(s.num_computed_tokens for s in self.running)
        references = sum(len(s.block_table) for s in self.running)
        return computed - (references - self.blocks.pool.num_used) * self.blocks.block_size

    def num_blocks_held(self) -> int:
        """Blocks referenced by live requests (a shared block counts once)."""
        return self.blocks.pool.num_used
