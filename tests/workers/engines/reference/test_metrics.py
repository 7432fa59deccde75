"""The records: per request and per step, consistent with each other and
with the formulas of docs/architecture.md ("Metrics") and
workers/engines/reference/memory.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.workers.engines.reference.conftest import Recorder
from workers import figures
from workers.engines.api import SamplingParams
from workers.engines.reference import LLMEngine
from workers.engines.reference.memory import StepShape, kv_block_bytes, transient_bytes
from workers.engines.reference.sequence import OutputKind

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def engine_with_recorder(tiny_model: Path, **kw: object) -> tuple[LLMEngine, Recorder]:
    kw.setdefault("max_model_len", 1024)
    engine = LLMEngine(tiny_model, **kw)
    recorder = Recorder()
    engine.add_observer(recorder)
    return engine, recorder


def drain(engine: LLMEngine) -> None:
    while engine.has_unfinished_requests():
        engine.step()


def test_request_record_times_are_ordered_and_counts_match(tiny_model: Path) -> None:
    engine, rec = engine_with_recorder(tiny_model, max_num_batched_tokens=64, long_prefill_token_threshold=16)
    engine.add_request("a", [0, *range(10, 60)], GREEDY, output_kind=OutputKind.FINAL_ONLY)  # 51 tokens: 4 chunks
    drain(engine)
    m, reason = rec.finished["a"]
    assert reason == "length"
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
    assert m.token_times[0] == m.first_token_time and m.token_times[-1] == m.finished_time
    assert m.token_times == sorted(m.token_times)
    assert (m.num_prompt_tokens, m.num_output_tokens, m.num_cached_tokens) == (51, 6, 0)
    assert len(m.token_times) == 6
    assert len(m.prefill_chunk_waits) == 4
    assert figures.ttft_seconds(m) == m.first_token_time - m.arrival_time
    # The step records tell the same story.
    assert sum(s.num_prefill_tokens for s in rec.steps) == 51
    assert sum(s.num_decode_tokens for s in rec.steps) == 5  # the first token comes from the prefill
    assert [w for s in rec.steps for w in s.prefill_chunk_waits] == m.prefill_chunk_waits
    first_chunk_step = rec.steps[0]
    assert m.prefill_chunk_waits[0] == pytest.approx(first_chunk_step.start_time - m.arrival_time)
    # each later chunk waited from the end of the previous chunk's step
    for prev, cur, wait in zip(rec.steps, rec.steps[1:4], m.prefill_chunk_waits[1:], strict=False):
        assert wait == pytest.approx(cur.start_time - (prev.start_time + prev.duration_seconds), abs=1e-9)


def test_fragmentation_counts_the_unfilled_tail_of_the_last_block(tiny_model: Path) -> None:
    engine, rec = engine_with_recorder(tiny_model, block_size=16)
    engine.add_request(
        "a", [0, *range(10, 19)], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    )  # 10 tokens
    engine.step()
    s = rec.steps[0]
    assert (s.num_blocks_held, s.num_tokens_stored) == (1, 10)
    assert s.kv_fragmentation == pytest.approx(1 - 10 / 16)
    engine.step()
    assert rec.steps[1].num_tokens_stored == 11
    drain(engine)
    assert rec.steps[-1].num_blocks_held == 0 and rec.steps[-1].kv_fragmentation is None


def test_shared_prefix_blocks_count_once_in_tokens_stored(tiny_model: Path) -> None:
    engine, rec = engine_with_recorder(tiny_model, block_size=16)
    prompt = [0, *range(10, 50)]  # 41 tokens: two full blocks cacheable
    engine.add_request("a", prompt, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    engine.step()
    engine.add_request("b", prompt, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    engine.step()
    s = rec.steps[-1]
    assert (s.prefix_cache_queries, s.prefix_cache_hits) == (41, 32)
    # a: 42 tokens in 3 blocks; b: 41 tokens, sharing a's first two blocks, plus its own third
    assert s.num_blocks_held == 4
    assert s.num_tokens_stored == 42 + 41 - 32
    assert 0 <= s.kv_fragmentation < 1


def test_memory_follows_the_cpu_accounting_formula(tiny_model: Path) -> None:
    engine, rec = engine_with_recorder(tiny_model, block_size=16)
    config = engine.config
    block_bytes = kv_block_bytes(config, 16, 4)
    assert block_bytes == 2 * config.num_hidden_layers * 16 * config.num_key_value_heads * config.head_dim * 4
    weights = sum(p.numel() * 4 for p in engine.model.parameters())
    engine.add_request(
        "a", [0, *range(10, 29)], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    )  # 20 tokens
    engine.step()
    s = rec.steps[0]
    assert s.memory_bytes == weights + 2 * block_bytes
    shape = StepShape(num_tokens=20, num_sampled=1, num_prefill_tokens=20, num_gathered_kv_rows=0, num_mask_entries=0)
    assert s.peak_memory_bytes == weights + 2 * block_bytes + transient_bytes(config, shape, 4)
    engine.step()  # decode of token 21 in a 2-block context
    s = rec.steps[1]
    assert s.memory_bytes == weights  # finished: its blocks are free
    if engine.runner.use_decode_kernel:  # reads blocks in place: one score per head and key
        shape = StepShape(num_tokens=1, num_sampled=1, num_mask_entries=config.num_attention_heads * 21)
    else:  # gathers its two blocks
        shape = StepShape(num_tokens=1, num_sampled=1, num_gathered_kv_rows=32)
    assert s.peak_memory_bytes == weights + 2 * block_bytes + transient_bytes(config, shape, 4)


def test_step_records_count_tokens_requests_and_preemptions(tiny_model: Path) -> None:
    block_bytes = kv_block_bytes(LLMEngine(tiny_model, max_model_len=128).config, 16, 4)
    engine, rec = engine_with_recorder(
        tiny_model, max_model_len=128, max_num_batched_tokens=64, block_size=16, kv_cache_bytes=12 * block_bytes
    )  # room for 12 blocks = 192 tokens: three requests growing to 100 tokens must preempt
    for i in range(3):
        engine.add_request(
            f"r{i}", [0, *range(10 + i, 69 + i)], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        )
    drain(engine)
    for s in rec.steps:
        assert s.num_prefill_tokens + s.num_decode_tokens <= 64
        assert s.num_blocks_held <= s.num_blocks_total == 12
        assert s.duration_seconds >= 0
    preemptions = sum(s.num_preemptions for s in rec.steps)
    assert preemptions > 0
    assert preemptions == sum(m.num_preemptions for m, _ in rec.finished.values())
    assert all(m.num_output_tokens == 40 for m, _ in rec.finished.values())
