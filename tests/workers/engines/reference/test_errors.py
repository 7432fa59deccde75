"""Bad input raises an exception that names the problem."""

from __future__ import annotations

from pathlib import Path

import pytest

from workers.engines.api import RequestError, SamplingParams
from workers.engines.reference import LLM, LLMEngine
from workers.profile import EngineProfile, ProfileError


@pytest.fixture(scope="module")
def llm(tiny_model: Path) -> LLM:
    return LLM(tiny_model, max_model_len=256, max_num_batched_tokens=64)


@pytest.mark.parametrize("prompt", ["", []])
def test_empty_prompt_is_refused(llm: LLM, prompt: str | list[int]) -> None:
    with pytest.raises(RequestError, match="prompt is empty") as info:
        llm.generate(prompt if prompt else [prompt], SamplingParams())
    assert info.value.field == "prompt"


def test_prompt_longer_than_max_model_len_is_refused(llm: LLM) -> None:
    with pytest.raises(RequestError, match=r"300 tokens, longer than the model's max length of 256") as info:
        llm.generate([[0] * 300], SamplingParams())
    assert info.value.field == "prompt"


def test_token_id_outside_the_vocabulary_is_refused(llm: LLM) -> None:
    with pytest.raises(RequestError, match="token id 5000, outside the vocabulary"):
        llm.generate([[0, 5000]], SamplingParams())


@pytest.mark.parametrize(
    ("params", "field"),
    [
        (SamplingParams(max_tokens=-1), "max_tokens"),
        (SamplingParams(max_tokens=0), "max_tokens"),
        (SamplingParams(temperature=-0.5), "temperature"),
        (SamplingParams(top_p=0.0), "top_p"),
        (SamplingParams(top_k=-2), "top_k"),
        (SamplingParams(stop=[""]), "stop"),
        (SamplingParams(logprobs=-1), "logprobs"),
    ],
)
def test_bad_sampling_parameter_is_refused_naming_it(llm: LLM, params: SamplingParams, field: str) -> None:
    with pytest.raises(RequestError, match=field) as info:
        llm.generate(["The for statement"], params)
    assert info.value.field == field


def test_one_bad_prompt_refuses_the_whole_batch_before_running_any(llm: LLM) -> None:
    with pytest.raises(RequestError):
        llm.generate(["fine", ""], SamplingParams())
    assert not llm.llm_engine.has_unfinished_requests()


def test_unknown_profile_field_is_refused_naming_it(tiny_model: Path) -> None:
    with pytest.raises(ProfileError, match="max_num_batched_token: unknown profile field") as info:
        LLM(tiny_model, max_num_batched_token=512)
    assert "max_num_batched_token" in info.value.errors


def test_budget_below_max_num_seqs_is_refused(tiny_model: Path) -> None:
    with pytest.raises(
        ProfileError, match=r"max_num_batched_tokens: the step budget \(32\) is below max_num_seqs \(64\)"
    ):
        LLM(tiny_model, max_num_batched_tokens=32, max_num_seqs=64)


def test_chunk_cap_above_budget_is_refused(tiny_model: Path) -> None:
    with pytest.raises(ProfileError, match=r"long_prefill_token_threshold: 1024 is above the step budget"):
        LLM(tiny_model, max_num_batched_tokens=512, long_prefill_token_threshold=1024)


def test_monolithic_budget_below_max_model_len_is_refused(tiny_model: Path) -> None:
    with pytest.raises(ProfileError, match="must be at least the model's max length"):
        LLM(tiny_model, max_model_len=1024, prefill_mode="monolithic", max_num_batched_tokens=512)


def test_kv_cache_too_small_for_one_request_is_refused(tiny_model: Path) -> None:
    with pytest.raises(ProfileError, match=r"kv_cache_bytes: .* max_model_len \(1024\) needs 64"):
        LLM(tiny_model, max_model_len=1024, kv_cache_bytes=1 << 20)


def test_live_profile_change_of_the_cache_layout_is_refused(tiny_model: Path) -> None:
    engine = LLMEngine(tiny_model, max_model_len=256)
    with pytest.raises(ProfileError, match="block_size: is fixed by the KV cache's layout"):
        engine.update_profile(EngineProfile(block_size=32))
    with pytest.raises(ProfileError, match="max_num_batched_tokens"):
        engine.update_profile(EngineProfile(max_num_batched_tokens=8))
    assert engine.profile == EngineProfile()


def test_duplicate_request_id_is_refused(tiny_model: Path) -> None:
    engine = LLMEngine(tiny_model, max_model_len=256)
    engine.add_request("a", "The for statement", SamplingParams())
    with pytest.raises(RequestError, match="'a' is already in use"):
        engine.add_request("a", "again", SamplingParams())
