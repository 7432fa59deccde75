"""The model computes what Hugging Face's does, through the paged cache,
whole or in chunks; checkpoints we cannot run are refused by name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.workers.engines.reference.conftest import write_random_checkpoint
from workers.engines.api import SamplingParams
from workers.engines.reference import LLM
from workers.engines.reference.config import UnsupportedModelError

LENGTHS = (1, 15, 16, 17, 130, 600)


def hf_logits(model_dir: Path, ids: list[int]) -> torch.Tensor:
    import transformers  # seconds to import: only the tests that compare with it pay for it

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def some_ids(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [0] + torch.randint(3, 2048, (n - 1,), generator=g).tolist()


@pytest.fixture(scope="module")
def tiny_engine(tiny_model: Path) -> LLM:
    return LLM(tiny_model, max_model_len=4096, block_size=16)


@pytest.mark.parametrize("length", LENGTHS)
def test_teacher_forced_logits_match_transformers_whole_and_chunked(
    tiny_model: Path, tiny_engine: LLM, length: int
) -> None:
    ids = some_ids(length, seed=length)
    expected = hf_logits(tiny_model, ids)
    for chunk in (None, 7, 64):
        got = tiny_engine.llm_engine.score(ids, chunk_size=chunk)
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=0, msg=f"chunk size {chunk}")


def test_one_token_chunks_attend_like_a_whole_prefill(tiny_model: Path, tiny_engine: LLM) -> None:
    ids = some_ids(40, seed=1)
    torch.testing.assert_close(
        tiny_engine.llm_engine.score(ids, chunk_size=1), hf_logits(tiny_model, ids), atol=1e-4, rtol=0
    )


def test_masked_sdpa_path_for_gpus_matches_the_cpu_flash_path(tiny_model: Path) -> None:
    llm = LLM(tiny_model, max_model_len=4096, block_size=16)
    ids = some_ids(300, seed=2)
    flash = llm.llm_engine.score(ids, chunk_size=64)
    llm.llm_engine.runner.use_cpu_flash = False
    torch.testing.assert_close(llm.llm_engine.score(ids, chunk_size=64), flash, atol=1e-4, rtol=0)


def test_gather_decode_path_for_gpus_matches_the_cpu_kernel(tiny_model: Path) -> None:

    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=0)
    prompts = [some_ids(n, seed=n) for n in (5, 40, 300)]
    llm = LLM(tiny_model, max_model_len=4096, block_size=16)
    assert llm.llm_engine.runner.use_decode_kernel
    kernel = llm.generate(prompts, params)
    llm.llm_engine.runner.use_decode_kernel = False
    gathered = llm.generate(prompts, params)
    for a, b in zip(kernel, gathered, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == pytest.approx(b.outputs[0].logprobs, abs=1e-4)


def test_bfloat16_weights_run_close_to_float32(tiny_model: Path, tiny_engine: LLM) -> None:
    ids = some_ids(100, seed=4)
    bf16 = LLM(tiny_model, max_model_len=4096, dtype="bfloat16")
    assert not bf16.llm_engine.runner.use_decode_kernel  # the CPU kernel is float32-only
    got = bf16.llm_engine.score(ids, chunk_size=33)
    expected = tiny_engine.llm_engine.score(ids)
    assert got.dtype == torch.float32
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean() > 0.9
    out = bf16.generate([ids], SamplingParams(temperature=0, max_tokens=8))
    assert len(out[0].outputs[0].token_ids) == 8


@pytest.mark.parametrize(
    ("arch", "config"),
    [
        ("llama", {"tie_word_embeddings": False}),
        ("llama", {"tie_word_embeddings": True, "num_key_value_heads": 4, "head_dim": 64}),
        (
            "llama",
            {
                "rope_parameters": {
                    "rope_type": "llama3",
                    "rope_theta": 500000.0,
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 256,
                }
            },
        ),
        ("qwen2", {"num_key_value_heads": 1}),
    ],
    ids=["untied", "tied-mha-head64", "llama3-rope", "qwen2-bias-mqa"],
)
def test_llama_family_variants_match_transformers(tmp_path: Path, tiny_model: Path, arch: str, config: dict) -> None:
    model_dir = write_random_checkpoint(tmp_path / arch, tiny_model, arch=arch, **config)
    ids = some_ids(200, seed=3)
    expected = hf_logits(model_dir, ids)
    llm = LLM(model_dir, block_size=8)
    torch.testing.assert_close(llm.llm_engine.score(ids), expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(llm.llm_engine.score(ids, chunk_size=33), expected, atol=1e-4, rtol=0)


def _edited_copy(tmp_path: Path, tiny_model: Path, **changes: object) -> Path:
    out = tmp_path / "edited"
    shutil.copytree(tiny_model, out)
    config = json.loads((out / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "architectures"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling.rope_type"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"hidden_size": None}, "hidden_size"),
    ],
)
def test_unsupported_checkpoint_is_refused_naming_the_field(
    tmp_path: Path, tiny_model: Path, changes: dict, field: str
) -> None:
    with pytest.raises(UnsupportedModelError) as info:
        LLM(_edited_copy(tmp_path, tiny_model, **changes))
    assert info.value.field == field
    assert field in str(info.value)


def test_missing_weight_is_refused_naming_the_tensor(tmp_path: Path, tiny_model: Path) -> None:
    out = _edited_copy(tmp_path, tiny_model)
    tensors = load_file(out / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, out / "model.safetensors")
    with pytest.raises(UnsupportedModelError, match="model.layers.1.mlp.down_proj.weight"):
        LLM(out)


def test_checkpoint_sharded_across_files_loads_like_one_file(
    tmp_path: Path, tiny_model: Path, tiny_engine: LLM
) -> None:
    """Hugging Face's layout for a large model: shards plus an index naming each tensor's file."""
    out = tmp_path / "sharded"
    shutil.copytree(tiny_model, out, ignore=shutil.ignore_patterns("*.safetensors"))
    tensors = load_file(tiny_model / "model.safetensors")
    names = sorted(tensors)
    shards = [names[i::3] for i in range(3)]  # every shard holds parts of every layer
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        filename = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: tensors[n] for n in shard}, out / filename, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, filename))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )

    ids = some_ids(130, seed=5)
    sharded = LLM(out, max_model_len=4096, block_size=16)
    assert torch.equal(sharded.llm_engine.score(ids), tiny_engine.llm_engine.score(ids))
