"""Block pool invariants hold after any sequence of add, step, finish, abort,
preempt and profile change: no block leaked, none freed twice, the prefix
cache consistent with the pool."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from workers.engines.api import SamplingParams
from workers.engines.reference import LLMEngine
from workers.engines.reference.block_manager import BlockManager, BlockPool
from workers.engines.reference.scheduler import Scheduler, SchedulerOutput
from workers.engines.reference.sequence import Sequence, SequenceStatus
from workers.profile import EngineProfile

BLOCK_SIZE = 4
NUM_BLOCKS = 24


def check_pool(pool: BlockPool, live: list[Sequence]) -> None:
    refs = [0] * pool.num_blocks
    for seq in live:
        assert len(set(seq.block_table)) == len(seq.block_table), f"{seq} holds a block twice"
        for block in seq.block_table:
            refs[block] += 1
    assert refs == pool.ref_counts, "reference counts differ from the blocks sequences hold"
    assert set(pool.free) == {b for b in range(pool.num_blocks) if refs[b] == 0}, "free list wrong"
    assert pool.num_free + pool.num_used == pool.num_blocks
    for h, block in pool.cached.items():
        assert pool.block_hashes[block] == h
    for block, h in enumerate(pool.block_hashes):
        if h is not None:
            assert pool.cached.get(h) == block


class SchedulerMachine(RuleBasedStateMachine):
    """Drives the real scheduler and block manager; a step's "model" appends
    a token from a tiny alphabet so prompts and outputs repeat (prefix hits)."""

    @initialize(chunked=st.booleans(), cap=st.sampled_from([1, 3, 8, 64]))
    def setup(self, chunked: bool, cap: int) -> None:
        self.profile = EngineProfile(
            prefill_mode="chunked" if chunked else "monolithic",
            max_num_batched_tokens=64,
            long_prefill_token_threshold=cap,
            max_num_seqs=6,
            block_size=BLOCK_SIZE,
        )
        self.blocks = BlockManager(NUM_BLOCKS, BLOCK_SIZE)
        self.scheduler = Scheduler(self.profile, self.blocks)
        self.live: list[Sequence] = []
        self.clock = 0.0
        self.count = 0

    @rule(length=st.integers(1, 40), token=st.integers(0, 2), max_tokens=st.integers(1, 12))
    def add(self, length: int, token: int, max_tokens: int) -> None:
        ids = [token] * (length // 2) + list(range(length - length // 2))
        seq = Sequence(
            f"s{self.count}", None, ids, SamplingParams(max_tokens=max_tokens), self.clock, length + max_tokens
        )
        self.count += 1
        self.scheduler.add(seq)
        self.live.append(seq)

    @precondition(lambda self: self.scheduler.has_unfinished())
    @rule(token=st.integers(0, 2))
    def step(self, token: int) -> None:
        self.clock += 1
        out = self.scheduler.schedule(self.clock)
        for chunk in out.chunks:
            assert chunk.seq.status == SequenceStatus.RUNNING
            assert len(chunk.seq.block_table) * BLOCK_SIZE >= chunk.start + chunk.num_tokens
        assert out.num_tokens <= self.scheduler.profile.max_num_batched_tokens
        self.scheduler.complete(out, self.clock)
        for chunk in out.chunks:
            seq = chunk.seq
            if chunk.samples:
                seq.token_ids.append(token)
                if seq.num_tokens >= seq.max_total_tokens:
                    self.scheduler.finish(seq, SequenceStatus.FINISHED_LENGTH)
                    self.live.remove(seq)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(self.live))
        self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)
        self.live.remove(seq)

    @precondition(lambda self: self.scheduler.running)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(self.scheduler.running))
        self.scheduler.finish(seq, SequenceStatus.FINISHED_STOPPED)
        self.live.remove(seq)

    @precondition(lambda self: self.scheduler.running)
    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(self.scheduler.running))
        self.scheduler._preempt(seq, SchedulerOutput(), self.clock)

    @rule(chunked=st.booleans(), cap=st.sampled_from([1, 5, 64]))
    def change_profile(self, chunked: bool, cap: int) -> None:
        self.scheduler.profile = EngineProfile(
            prefill_mode="chunked" if chunked else "monolithic",
            max_num_batched_tokens=64,
            long_prefill_token_threshold=cap,
            max_num_seqs=6,
            block_size=BLOCK_SIZE,
        )

    @invariant()
    def pool_is_consistent(self) -> None:
        if hasattr(self, "blocks"):
            check_pool(self.blocks.pool, self.live)
            for seq in self.scheduler.waiting:
                assert not seq.block_table, "a waiting request holds blocks"

    def teardown(self) -> None:
        if not hasattr(self, "blocks"):
            return
        for seq in list(self.live):
            self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)
        check_pool(self.blocks.pool, [])
        assert self.blocks.pool.num_free == NUM_BLOCKS, "blocks leaked"


TestSchedulerBlockInvariants = SchedulerMachine.TestCase
TestSchedulerBlockInvariants.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


def test_releasing_a_block_twice_is_caught() -> None:
    pool = BlockPool(4, 4)
    blocks = pool.allocate(2)
    pool.release(blocks)
    with pytest.raises(AssertionError, match="freed twice"):
        pool.release(blocks[:1])


def test_freed_cached_blocks_are_evicted_least_recently_freed_first() -> None:
    pool = BlockPool(4, 2)
    a, b, c, d = pool.allocate(4)
    for block, h in ((a, 10), (b, 11), (c, 12)):
        pool.register(block, h)
    pool.release([b])  # freed first → evicted first
    pool.release([a])
    pool.release([d])  # never cached → reused before any cached block
    assert pool.allocate(1) == [d]
    assert pool.allocate(1) == [b] and pool.lookup(11) is None
    assert pool.lookup(10) == a  # still cached until its turn
    pool.take_cached(a)  # a hit revives it out of the free list
    assert pool.num_free == 0 and pool.ref_counts[a] == 1


def test_engine_pool_is_clean_after_random_adds_aborts_and_preemptions(tiny_model: Path) -> None:
    """The same invariants through a real engine with a cache small enough to preempt."""
    engine = LLMEngine(
        tiny_model,
        max_model_len=256,
        max_num_batched_tokens=48,
        long_prefill_token_threshold=16,
        max_num_seqs=8,
        block_size=8,
        kv_cache_bytes=40 * 2 * 2 * 8 * 2 * 64 * 4,
    )
    rng = random.Random(3)
    for i in range(120):
        action = rng.random()
        if action < 0.3:
            n = rng.randint(1, 120)
            engine.add_request(
                f"r{i}",
                [0] + [rng.randint(3, 6) for _ in range(n)],
                SamplingParams(temperature=0.8, seed=i, max_tokens=rng.randint(1, 30)),
            )
        elif action < 0.4 and engine.requests:
            engine.abort_request(rng.choice(sorted(engine.requests)))
        else:
            engine.step()
        live = list(engine.scheduler.running) + list(engine.scheduler.waiting)
        check_pool(engine.blocks.pool, live)
    while engine.has_unfinished_requests():
        engine.step()
    check_pool(engine.blocks.pool, [])
    assert engine.blocks.pool.num_free == engine.blocks.pool.num_blocks
