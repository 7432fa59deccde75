"""The engine contract's profile rules, shared by engine, agent and control plane."""

import pytest

from workers.profile import EngineProfile, ProfileError, load_profile, profile_errors


def test_defaults_are_valid():
    assert profile_errors({}) == {}
    assert EngineProfile.from_dict({}) == EngineProfile()


@pytest.mark.parametrize(
    ("data", "field", "needle"),
    [
        ({"max_num_batched_tokens": 32, "max_num_seqs": 64}, "max_num_batched_tokens", "below max_num_seqs"),
        ({"long_prefill_token_threshold": 1024}, "long_prefill_token_threshold", "above the step budget"),
        ({"max_num_seqs": 0}, "max_num_seqs", "must be positive"),
        ({"block_size": -16}, "block_size", "must be positive"),
        ({"block_size": 24}, "block_size", "power of two"),
        ({"chunk_size": 5}, "chunk_size", "unknown profile field"),
        ({"prefill_mode": "sliced"}, "prefill_mode", "must be one of"),
        ({"max_num_seqs": True}, "max_num_seqs", "integer"),
    ],
)
def test_bad_fields_are_named(data, field, needle):
    errors = profile_errors(data)
    assert field in errors, errors
    assert any(needle in message for message in errors[field])


def test_monolithic_budget_must_cover_the_model_max_length():
    data = {"prefill_mode": "monolithic", "max_num_batched_tokens": 4096}
    assert profile_errors(data) == {}
    errors = profile_errors(data, max_model_len=32768)
    assert "max_num_batched_tokens" in errors
    assert "32768" in errors["max_num_batched_tokens"][0]


def test_vllm_refuses_knobs_it_lacks():
    data = {"short_prompt_threshold": 64, "min_prefill_tokens_per_step": 16}
    assert profile_errors(data, engine_kind="reference") == {}
    errors = profile_errors(data, engine_kind="vllm")
    assert set(errors) == {"short_prompt_threshold", "min_prefill_tokens_per_step"}
    assert "vllm engine has no such knob" in errors["short_prompt_threshold"][0]


def test_from_dict_raises_with_every_field():
    with pytest.raises(ProfileError) as info:
        EngineProfile.from_dict({"max_num_seqs": -1, "nope": 1})
    assert set(info.value.errors) == {"max_num_seqs", "nope"}


def test_load_profile_reads_json_text_and_files(tmp_path):
    assert load_profile('{"prefill_mode": "monolithic", "max_num_batched_tokens": 8192}').prefill_mode == "monolithic"
    path = tmp_path / "p.json"
    path.write_text('{"long_prefill_token_threshold": 128}')
    assert load_profile(str(path)).chunk_cap == 128
    with pytest.raises(ProfileError) as info:
        load_profile("{not json")
    assert "profile" in info.value.errors
