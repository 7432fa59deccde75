"""The step scheduler's rules, asserted one by one on the real Scheduler and
BlockManager (pure Python, no model): what a step runs, in which order, how
many tokens each request gets, and when KV blocks hold requests back."""

from __future__ import annotations

from itertools import count

from workers.engines.api import SamplingParams
from workers.engines.reference.block_manager import BlockManager
from workers.engines.reference.scheduler import ScheduledChunk, Scheduler, SchedulerOutput
from workers.engines.reference.sequence import Sequence, SequenceStatus
from workers.profile import EngineProfile

BLOCK_SIZE = 4
_token_ids = count(100)  # every prompt distinct: no prefix-cache hit muddies a count


def make_scheduler(num_blocks: int = 256, **profile: object) -> Scheduler:
    fields: dict[str, object] = dict(max_num_batched_tokens=64, max_num_seqs=8, block_size=BLOCK_SIZE)
    fields.update(profile)
    return Scheduler(EngineProfile(**fields), BlockManager(num_blocks, BLOCK_SIZE, enable_prefix_caching=False))  # type: ignore[arg-type]


def add(scheduler: Scheduler, name: str, num_prompt_tokens: int, max_tokens: int = 50) -> Sequence:
    ids = [next(_token_ids) for _ in range(num_prompt_tokens)]
    seq = Sequence(name, None, ids, SamplingParams(max_tokens=max_tokens), 0.0, num_prompt_tokens + max_tokens)
    scheduler.add(seq)
    return seq


def step(scheduler: Scheduler) -> SchedulerOutput:
    """One step as the engine runs it: schedule, "compute", sample a token for
    each chunk that reaches its sequence's end, finish at max_total_tokens."""
    now = float(scheduler.num_steps + 1)
    out = scheduler.schedule(now)
    scheduler.complete(out, now)
    for chunk in out.chunks:
        seq = chunk.seq
        if chunk.samples:
            seq.token_ids.append(7)
            if seq.num_tokens >= seq.max_total_tokens:
                scheduler.finish(seq, SequenceStatus.FINISHED_LENGTH)
    return out


def prefill_chunks(out: SchedulerOutput, seq: Sequence) -> list[ScheduledChunk]:
    return [c for c in out.chunks if c.seq is seq and not c.is_decode]


def run_until_idle(scheduler: Scheduler, max_steps: int = 500) -> list[SchedulerOutput]:
    outs = []
    while scheduler.has_unfinished():
        outs.append(step(scheduler))
        assert len(outs) < max_steps, "the scheduler made no progress"
    return outs


def test_prompts_at_or_under_the_short_threshold_are_never_split() -> None:
    scheduler = make_scheduler(
        max_num_batched_tokens=24, long_prefill_token_threshold=8, short_prompt_threshold=20, max_num_seqs=4
    )
    long = add(scheduler, "long", 60, max_tokens=5)  # takes 8 of the 24 each step while it prefills
    at = add(scheduler, "at-threshold", 20, max_tokens=5)
    under = add(scheduler, "under", 13, max_tokens=5)
    over = add(scheduler, "over", 21, max_tokens=5)
    outs = run_until_idle(scheduler)

    for seq in (at, under):
        chunks = [c for out in outs for c in prefill_chunks(out, seq)]
        assert [(c.start, c.num_tokens) for c in chunks] == [(0, seq.num_prompt_tokens)], f"{seq.request_id} was split"
    # Above the threshold the chunk cap applies as usual.
    for seq in (long, over):
        sizes = [c.num_tokens for out in outs for c in prefill_chunks(out, seq)]
        assert max(sizes) == 8 and sum(sizes) == seq.num_prompt_tokens


def test_each_request_gets_at_most_the_chunk_cap_of_prompt_tokens_per_step() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=8)
    seqs = [add(scheduler, f"p{i}", n, max_tokens=3) for i, n in enumerate((30, 45, 17))]
    outs = run_until_idle(scheduler)

    first = outs[0]
    # The budget would take all three prompts whole; the cap holds each to 8.
    assert [(c.seq.request_id, c.num_tokens) for c in first.chunks] == [("p0", 8), ("p1", 8), ("p2", 8)]
    for out in outs:
        for seq in seqs:
            assert sum(c.num_tokens for c in prefill_chunks(out, seq)) <= 8
    for seq in seqs:
        chunks = [c for out in outs for c in prefill_chunks(out, seq)]
        # Chunks continue where the last one stopped: positions are global.
        assert [c.start for c in chunks] == [sum(c.num_tokens for c in chunks[:i]) for i in range(len(chunks))]
        assert sum(c.num_tokens for c in chunks) == seq.num_prompt_tokens


def test_chunked_runs_the_decodes_first_then_prefill_chunks_within_the_budget() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=16)
    decoders = [add(scheduler, f"d{i}", 3) for i in range(3)]
    step(scheduler)  # all three short prompts prefill in one step
    assert all(s.is_decoding for s in decoders)
    long = add(scheduler, "long", 100, max_tokens=2)

    out = step(scheduler)
    assert [(c.seq.request_id, c.is_decode, c.num_tokens) for c in out.chunks] == [
        ("d0", True, 1),
        ("d1", True, 1),
        ("d2", True, 1),
        ("long", False, 13),
    ]
    assert out.num_tokens == 16
    while long.num_computed_tokens < long.num_prompt_tokens:
        out = step(scheduler)
        kinds = [c.is_decode for c in out.chunks]
        assert kinds == sorted(kinds, reverse=True), "a prefill chunk ran before a decode"
        assert out.num_decode_tokens == 3, "a decode waited behind the long prefill"
        assert out.num_tokens <= 16


def test_monolithic_runs_a_waiting_prompt_whole_while_the_decodes_wait() -> None:
    # The chunk cap is ignored in monolithic mode: the prompt still runs whole.
    scheduler = make_scheduler(prefill_mode="monolithic", max_num_batched_tokens=128, long_prefill_token_threshold=8)
    decoders = [add(scheduler, f"d{i}", 3) for i in range(2)]
    step(scheduler)
    assert all(s.is_decoding for s in decoders)
    add(scheduler, "long", 100, max_tokens=2)

    out = step(scheduler)
    assert [(c.seq.request_id, c.start, c.num_tokens, c.is_decode) for c in out.chunks] == [("long", 0, 100, False)]
    assert out.num_decode_tokens == 0
    out = step(scheduler)  # no prompt waits now: everyone decodes
    assert sorted(c.seq.request_id for c in out.chunks) == ["d0", "d1", "long"]
    assert all(c.is_decode and c.num_tokens == 1 for c in out.chunks)


def test_admission_waits_while_free_kv_blocks_are_too_few() -> None:
    scheduler = make_scheduler(num_blocks=10)  # 40 tokens of KV
    first = add(scheduler, "first", 30, max_tokens=2)  # 8 blocks to its end (32 tokens)
    second = add(scheduler, "second", 12, max_tokens=2)  # 3 blocks: more than are left

    out = step(scheduler)
    assert [c.seq for c in out.chunks] == [first]
    assert second.status == SequenceStatus.WAITING and not second.block_table
    assert out.num_preemptions == 0, "admission preempted a running request"
    out = step(scheduler)  # first's decode, its last token
    assert [c.seq for c in out.chunks] == [first]
    assert first.status == SequenceStatus.FINISHED_LENGTH
    out = step(scheduler)  # the blocks are back: now it is admitted
    assert [(c.seq, c.num_tokens) for c in out.chunks] == [(second, 12)]


def test_a_request_that_cannot_grow_preempts_the_newest_which_is_recomputed() -> None:
    scheduler = make_scheduler(num_blocks=4)  # 16 tokens of KV
    older = add(scheduler, "older", 8, max_tokens=3)  # 2 blocks each: the cache is full
    newer = add(scheduler, "newer", 8, max_tokens=3)
    step(scheduler)
    assert older.num_tokens == newer.num_tokens == 9 and scheduler.blocks.num_free_blocks == 0

    out = step(scheduler)  # older's 9th token needs a third block: newer gives its two up
    assert out.num_preemptions == 1 and newer.metrics.num_preemptions == 1
    assert [(c.seq, c.is_decode) for c in out.chunks] == [(older, True)]
    assert newer.status == SequenceStatus.PREEMPTED and newer.num_computed_tokens == 0 and not newer.block_table
    assert scheduler.waiting[0] is newer

    outs = run_until_idle(scheduler)
    recompute = [c for o in outs for c in o.chunks if c.seq is newer][0]
    # Recomputed from its first token, its sampled one included, in one chunk.
    assert (recompute.start, recompute.num_tokens, recompute.is_decode) == (0, 9, False)
    assert newer.status == SequenceStatus.FINISHED_LENGTH and newer.num_output_tokens == 3


def test_short_prompt_threshold_counts_the_tokens_left_after_the_prefix_hit() -> None:
    # A long prompt whose cached prefix leaves a short remainder is a short
    # prefill: it runs whole, though its raw length is far over the threshold.
    blocks = BlockManager(256, BLOCK_SIZE, enable_prefix_caching=True)
    profile = EngineProfile(
        max_num_batched_tokens=64,
        long_prefill_token_threshold=8,
        short_prompt_threshold=20,
        max_num_seqs=8,
        block_size=BLOCK_SIZE,
    )
    scheduler = Scheduler(profile, blocks)
    prefix = [next(_token_ids) for _ in range(64)]
    first = Sequence("first", None, [*prefix, next(_token_ids)], SamplingParams(max_tokens=1), 0.0, 66)
    scheduler.add(first)
    run_until_idle(scheduler)  # its 16 full prefix blocks stay in the prefix cache

    tail = [next(_token_ids) for _ in range(12)]
    cached = Sequence("cached", None, [*prefix, *tail], SamplingParams(max_tokens=2), 0.0, 78)
    cold = add(scheduler, "cold", 76, max_tokens=2)  # as long, nothing cached: split by the cap
    scheduler.add(cached)
    outs = run_until_idle(scheduler)

    chunks = [c for out in outs for c in prefill_chunks(out, cached)]
    assert [(c.start, c.num_tokens) for c in chunks] == [(64, 12)]  # 76 tokens, 64 cached, 12 > the cap of 8
    assert cached.metrics.num_cached_tokens == 64
    assert max(c.num_tokens for out in outs for c in prefill_chunks(out, cold)) == 8
