"""Greedy output is the same token for token whatever the prefill policy,
the chunk cap, prefix-cache hits, preemptions or a profile change mid-prefill."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.workers.engines.reference.conftest import Recorder
from workers.engines.api import SamplingParams
from workers.engines.reference import LLM, LLMEngine
from workers.engines.reference.sequence import OutputKind
from workers.profile import EngineProfile

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
MAX_LEN = 2048


def prompts() -> list[list[int]]:
    """Short and long prompts, crossing many block boundaries, two sharing a long prefix."""
    g = torch.Generator().manual_seed(7)

    def rand(n: int) -> list[int]:
        return torch.randint(3, 2048, (n,), generator=g).tolist()

    shared = rand(150)
    return [
        [0, *rand(2)],
        [0, *rand(16)],  # exactly one block with BOS (block size 16 → 17 tokens)
        [0, *rand(63)],
        [0, *shared, *rand(9)],
        [0, *rand(410)],
        [0, *shared, *rand(40)],
        [0, *rand(33)],
    ]


def run_staggered(
    engine: LLMEngine, ps: list[list[int]], every: int = 3, changes: dict[int, EngineProfile] | None = None
) -> dict[str, list[int]]:
    """Add one prompt every ``every`` steps (long and short interleave), apply
    profile ``changes`` at given steps, and step to the end."""
    done: dict[str, list[int]] = {}
    pending = list(enumerate(ps))
    step = 0
    while pending or engine.has_unfinished_requests():
        if pending and step % every == 0:
            i, p = pending.pop(0)
            engine.add_request(f"r{i}", p, GREEDY, output_kind=OutputKind.FINAL_ONLY)
        if changes and step in changes:
            engine.update_profile(changes[step])
        for out in engine.step():
            done[out.request_id] = out.outputs[0].token_ids
        step += 1
    assert engine.blocks.pool.num_used == 0, "blocks leaked"
    return done


@pytest.fixture(scope="module")
def reference(tiny_model: Path) -> dict[str, list[int]]:
    """Monolithic, no prefix cache, every prompt alone: the baseline."""
    llm = LLM(tiny_model, prefill_mode="monolithic", max_model_len=MAX_LEN, enable_prefix_caching=False)
    outs = [llm.generate([p], GREEDY)[0] for p in prompts()]
    return {f"r{i}": o.outputs[0].token_ids for i, o in enumerate(outs)}


def test_greedy_batch_monolithic_equals_one_at_a_time(tiny_model: Path, reference: dict[str, list[int]]) -> None:
    llm = LLM(tiny_model, prefill_mode="monolithic", max_model_len=MAX_LEN)
    outs = llm.generate(prompts(), GREEDY)
    assert {f"r{i}": o.outputs[0].token_ids for i, o in enumerate(outs)} == reference


@pytest.mark.parametrize("cap", [1, 7, 64, 256])
def test_greedy_chunked_equals_monolithic_with_long_and_short_interleaved(
    tiny_model: Path, reference: dict[str, list[int]], cap: int
) -> None:
    engine = LLMEngine(
        tiny_model,
        max_model_len=MAX_LEN,
        prefill_mode="chunked",
        max_num_batched_tokens=max(cap, 64),
        long_prefill_token_threshold=cap,
        block_size=16,
    )
    assert run_staggered(engine, prompts()) == reference


@pytest.mark.parametrize("cap", [1, 7, 64, 256])
def test_greedy_chunked_equals_monolithic_across_prefix_cache_hits(
    tiny_model: Path, reference: dict[str, list[int]], cap: int
) -> None:
    llm = LLM(
        tiny_model,
        max_model_len=MAX_LEN,
        max_num_batched_tokens=max(cap, 64),
        long_prefill_token_threshold=cap,
        block_size=4,
    )
    first = llm.generate(prompts(), GREEDY)
    again = llm.generate(prompts(), GREEDY)  # now mostly served from the prefix cache
    assert [o.outputs[0].token_ids for o in first] == list(reference.values())
    assert [o.outputs[0].token_ids for o in again] == list(reference.values())
    assert sum(o.num_cached_tokens for o in again) > 0.8 * sum(len(p) for p in prompts())
    assert [o.num_cached_tokens for o in again][0] == 0  # a 3-token prompt: its last token is never cached


def test_shared_prefix_is_computed_once_within_a_batch(tiny_model: Path, reference: dict[str, list[int]]) -> None:
    engine = LLMEngine(tiny_model, max_model_len=MAX_LEN, max_num_batched_tokens=64, block_size=16)
    ps = prompts()
    engine.add_request("r3", ps[3], GREEDY, output_kind=OutputKind.FINAL_ONLY)
    while engine.requests["r3"].num_computed_tokens < len(ps[3]):
        engine.step()
    seq = engine.add_request("r5", ps[5], GREEDY, output_kind=OutputKind.FINAL_ONLY)
    engine.step()
    assert seq.metrics.num_cached_tokens == 144  # the shared 151 tokens' full blocks
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    assert done["r5"] == reference["r5"]


def test_greedy_survives_preemption_by_recompute(tiny_model: Path, reference: dict[str, list[int]]) -> None:
    # Room for ~800 tokens: the batch cannot all fit, so requests are preempted and recomputed.
    block_bytes = 2 * 2 * 16 * 2 * 64 * 4
    engine = LLMEngine(
        tiny_model,
        max_model_len=512,
        max_num_batched_tokens=96,
        long_prefill_token_threshold=32,
        block_size=16,
        kv_cache_bytes=50 * block_bytes,
    )
    recorder = Recorder()
    engine.add_observer(recorder)
    done = run_staggered(engine, prompts(), every=1)
    assert done == reference
    assert sum(s.num_preemptions for s in recorder.steps) > 0
    assert sum(m.num_preemptions for m, _ in recorder.finished.values()) == sum(
        s.num_preemptions for s in recorder.steps
    )


@pytest.mark.parametrize("monolithic_first", [False, True])
def test_profile_change_mid_prefill_keeps_greedy_output(
    tiny_model: Path, reference: dict[str, list[int]], monolithic_first: bool
) -> None:
    chunked = EngineProfile(max_num_batched_tokens=MAX_LEN, long_prefill_token_threshold=7, block_size=16)
    wide = EngineProfile(
        max_num_batched_tokens=MAX_LEN, long_prefill_token_threshold=256, short_prompt_threshold=64, block_size=16
    )
    mono = EngineProfile(prefill_mode="monolithic", max_num_batched_tokens=MAX_LEN, block_size=16)
    start = mono if monolithic_first else chunked
    engine = LLMEngine(tiny_model, max_model_len=MAX_LEN, profile=start)
    changes = (
        {2: chunked, 5: wide, 9: mono, 13: chunked, 20: mono}
        if monolithic_first
        else {4: wide, 6: mono, 8: chunked, 30: wide}
    )
    assert run_staggered(engine, prompts(), every=2, changes=changes) == reference


def test_min_prefill_tokens_keeps_a_prefill_moving_behind_many_decodes(tiny_model: Path) -> None:
    engine = LLMEngine(
        tiny_model,
        max_model_len=MAX_LEN,
        max_num_seqs=16,
        max_num_batched_tokens=16,
        min_prefill_tokens_per_step=4,
        block_size=16,
    )
    long_params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    for i in range(16 - 1):
        engine.add_request(f"d{i}", [0, 5 + i, 9], long_params)
    while any(not s.is_decoding for s in engine.requests.values()):
        engine.step()
    # 15 decodes would fill 15 of the 16 tokens; the waiting prompt still gets 4.
    engine.update_profile(
        EngineProfile(max_num_seqs=17, max_num_batched_tokens=17, min_prefill_tokens_per_step=4, block_size=16)
    )
    seq = engine.add_request("p", [0, *range(10, 60)], GREEDY)
    before = seq.num_computed_tokens
    engine.step()
    engine.step()
    assert seq.num_computed_tokens - before >= 8
    # and every decode still ran within two steps (the deferred ones first)
    assert all(
        s.last_scheduled_step >= engine.scheduler.num_steps - 1 for s in engine.requests.values() if s.is_decoding
    )
