"""The simulated engine: the reference scheduler's steps, priced by the
simulated GPU, in virtual time (no waiting)."""

from __future__ import annotations

import pytest

from workers.engines.api import SamplingParams
from workers.engines.reference.tiny import SHIPPED_DIR
from workers.engines.sim.engine import SimLLMEngine, VirtualClock
from workers.engines.sim.steptime import AicDevice, StepBatch
from workers.engines.sim.virtual import closed_loop, drive, figures
from workers.figures import tpot_seconds, ttft_seconds
from workers.loadgen import PlannedRequest
from workers.profile import EngineProfile, ProfileError

MAX_LEN = 16384


def engine(device: AicDevice, **profile: object) -> tuple[SimLLMEngine, VirtualClock]:
    clock = VirtualClock()
    e = SimLLMEngine(
        device, SHIPPED_DIR, max_model_len=MAX_LEN, profile=EngineProfile(**profile), clock=clock, sleep=None
    )
    return e, clock


def run_one(e: SimLLMEngine, prompt: int, max_tokens: int) -> list[float]:
    e.add_request("a", [100 + i % 1900 for i in range(prompt)], SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    times = []
    while e.has_unfinished_requests():
        for out in e.step():
            times.append(e.clock())
            assert out.outputs[0].token_ids
    return times


def test_time_to_first_token_is_the_sum_of_its_chunks_priced_by_the_gpu(h200: AicDevice) -> None:
    e, clock = engine(h200, max_num_batched_tokens=512)
    times = run_one(e, prompt=2048, max_tokens=3)
    chunks = [StepBatch(prefills=((s, 512),)) for s in (0, 512, 1024, 1536)]
    first = sum(h200.step_seconds(b) for b in chunks)
    assert times[0] == pytest.approx(first)
    # each later token is one decode step over the sequence so far
    assert times[1] - times[0] == pytest.approx(h200.step_seconds(StepBatch(decode_kv_lens=(2049,))))


def test_outputs_are_text_of_the_tokenizer_and_respect_max_tokens(h200: AicDevice) -> None:
    e, _ = engine(h200)
    e.add_request("a", "The for statement", SamplingParams(max_tokens=12))
    done = []
    while e.has_unfinished_requests():
        done += [o for o in e.step() if o.finished]
    (out,) = done
    assert len(out.outputs[0].token_ids) == 12
    assert out.outputs[0].finish_reason == "length"
    assert out.outputs[0].text.strip()


def test_an_8k_prefill_stalls_decodes_monolithic_and_chunking_bounds_the_gap(h200: AicDevice) -> None:
    # 32 streams decoding, then one 8K prompt arrives: monolithic prefills it
    # in one step, which every stream waits out; chunked at 512 interleaves it.
    planned = [PlannedRequest(0.0, "completions", 400, prompt_token_ids=list(range(200, 456))) for _ in range(32)]
    planned.append(PlannedRequest(0.5, "completions", 8, prompt_token_ids=[300 + i % 1500 for i in range(8192)]))
    gaps = {}
    for mode, budget in (("monolithic", MAX_LEN), ("chunked", 512)):
        e, clock = engine(h200, prefill_mode=mode, max_num_batched_tokens=budget)
        recorder, duration = drive(e, planned, clock=clock, wait_until=clock.advance_to)
        gaps[mode] = figures(recorder, duration)["stall_max_seconds"]
    big = h200.step_seconds(StepBatch(prefills=((0, 8192),), decode_kv_lens=(256,) * 32))
    assert gaps["monolithic"] == pytest.approx(big, rel=0.2)
    assert gaps["chunked"] < gaps["monolithic"] / 3


def test_memory_is_the_simulated_gpus_weights_and_kv_blocks(h200: AicDevice) -> None:
    e, _ = engine(h200)
    run_one(e, prompt=1000, max_tokens=4)
    facts = e.memory_facts()
    assert facts.weight_bytes == h200.weight_bytes
    assert facts.kv_bytes_per_token == h200.kv_bytes_per_token  # 128 KiB a token for Llama-3.1-8B in bf16
    assert e.memory.last_accounted.peak_memory_bytes > h200.weight_bytes + 1000 * h200.kv_bytes_per_token


def test_a_kv_cache_the_gpu_cannot_hold_or_too_small_for_one_request_is_refused(h200: AicDevice) -> None:
    with pytest.raises(ProfileError) as big:
        engine(h200, kv_cache_bytes=200 << 30)
    assert "kv_cache_bytes" in big.value.errors and "more than the simulated H200" in str(big.value)
    with pytest.raises(ProfileError) as small:
        engine(h200, kv_cache_bytes=64 << 20)
    assert "max_model_len (16384)" in str(small.value)


def test_memory_caps_the_batch_so_preemption_emerges(h200: AicDevice) -> None:
    # Room for about two full-length sequences: eight long ones must take turns.
    e, clock = engine(h200, kv_cache_bytes=2 * MAX_LEN * h200.kv_bytes_per_token, max_num_seqs=8)
    planned = [PlannedRequest(0.0, "completions", 3000, prompt_token_ids=[200 + i] * 6000) for i in range(8)]
    recorder, _ = drive(e, planned, clock=clock, wait_until=clock.advance_to)
    assert len(recorder.requests) == 8
    assert sum(s.num_preemptions for s in recorder.steps) > 0


def test_closed_loop_tpot_is_the_decode_steps_of_its_batch(h200: AicDevice) -> None:
    e, _ = engine(h200, max_num_seqs=16, max_num_batched_tokens=2064, long_prefill_token_threshold=2048)
    recorder = closed_loop(e, concurrency=16, prompt_tokens=1024, output_tokens=128, num_requests=64)
    assert len(recorder.requests) == 64
    steady = recorder.requests[16:-16]
    tpots = [tpot_seconds(m) for m in steady]
    decode_only = h200.step_seconds(StepBatch(decode_kv_lens=(1088,) * 16))
    # Between a decode-only step and one with a whole prompt beside it.
    mixed = h200.step_seconds(StepBatch(prefills=((0, 1024),), decode_kv_lens=(1088,) * 15))
    assert all(decode_only * 0.9 < t < mixed for t in tpots if t is not None)
    assert all(ttft_seconds(m) is not None for m in steady)


def test_a_greedy_output_depends_on_the_prompt_not_on_how_it_was_prefilled(h200: AicDevice) -> None:
    prompt = [100 + (i * 7) % 1900 for i in range(1500)]
    outputs = []
    for mode, budget in (("monolithic", MAX_LEN), ("chunked", 256), ("chunked", 1024)):
        e, _ = engine(h200, prefill_mode=mode, max_num_batched_tokens=budget)
        e.add_request("a", prompt, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
        while e.has_unfinished_requests():
            done = [o for o in e.step() if o.finished]
        outputs.append(done[0].outputs[0].token_ids)
    assert outputs[0] == outputs[1] == outputs[2]
    other, _ = engine(h200)
    other.add_request("b", prompt[:-1] + [5], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    while other.has_unfinished_requests():
        done = [o for o in other.step() if o.finished]
    assert done[0].outputs[0].token_ids != outputs[0]
