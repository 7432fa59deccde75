"""A profile in vLLM's words; refused before vLLM loads when vLLM cannot run it."""

import pytest

from workers.engines.vllm.args import (
    cli_flags_for,
    default_profile,
    engine_args_for,
    vllm_profile_errors,
)
from workers.profile import EngineProfile, ProfileError


def test_every_profile_knob_maps_to_its_vllm_flag():
    profile = EngineProfile(
        prefill_mode="chunked",
        max_num_batched_tokens=256,
        long_prefill_token_threshold=128,
        max_num_seqs=8,
        block_size=32,
        enable_prefix_caching=False,
        kv_cache_bytes=1 << 26,
    )
    kwargs = engine_args_for(profile, model="/m", device="cpu", max_model_len=4096)
    flags = cli_flags_for(kwargs)
    for flag in (
        "--enable-chunked-prefill",
        "--max-num-batched-tokens",
        "--long-prefill-token-threshold",
        "--max-num-seqs",
        "--block-size",
        "--no-enable-prefix-caching",
        "--kv-cache-memory-bytes",
    ):
        assert flag in flags
    assert kwargs["max_num_batched_tokens"] == 256 and kwargs["long_prefill_token_threshold"] == 128
    assert kwargs["kv_cache_memory_bytes"] == 1 << 26


def test_monolithic_turns_chunked_prefill_off_and_needs_the_whole_context_in_one_step():
    ok = engine_args_for(
        EngineProfile(prefill_mode="monolithic", max_num_batched_tokens=4096, block_size=32),
        model="/m",
        device="cpu",
        max_model_len=4096,
    )
    assert ok["enable_chunked_prefill"] is False
    with pytest.raises(ProfileError) as info:
        engine_args_for(
            EngineProfile(prefill_mode="monolithic", max_num_batched_tokens=512, block_size=32),
            model="/m",
            device="cpu",
            max_model_len=4096,
        )
    assert "max_num_batched_tokens" in info.value.errors


@pytest.mark.parametrize("knob", ["short_prompt_threshold", "min_prefill_tokens_per_step"])
def test_knobs_vllm_lacks_are_refused_with_a_message_naming_them(knob):
    errors = vllm_profile_errors(EngineProfile(block_size=32, **{knob: 64}), device="cpu")
    assert knob in errors and "vllm engine has no such knob" in errors[knob][0]


def test_cpu_block_size_must_be_a_multiple_of_32_but_gpu_takes_16():
    errors = vllm_profile_errors(EngineProfile(block_size=16), device="cpu")
    assert "multiple of 32" in errors["block_size"][0]
    assert vllm_profile_errors(EngineProfile(block_size=16), device="cuda") == {}
    assert default_profile("cpu").block_size == 32


def test_cpu_gets_an_explicit_kv_size_and_gpu_leaves_it_to_vllm():
    assert engine_args_for(EngineProfile(block_size=32), model="/m", device="cpu")["kv_cache_memory_bytes"] > 0
    assert "kv_cache_memory_bytes" not in engine_args_for(EngineProfile(), model="/m", device="cuda")
