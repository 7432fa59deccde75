"""Model configuration from a Hugging Face checkpoint directory.

Only the fields that change the arithmetic are read; a checkpoint whose math
we do not implement is refused with ``UnsupportedModelError`` naming the
field, rather than loaded and run wrong.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# architecture → whether q/k/v carry a bias by construction (Qwen2 does).
SUPPORTED_ARCHITECTURES: dict[str, bool] = {
    "LlamaForCausalLM": False,
    "MistralForCausalLM": False,
    "Qwen2ForCausalLM": True,
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class UnsupportedModelError(ValueError):
    """The checkpoint is not one this engine can run; ``field`` names why."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(f"{field}: {message}")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    torch_dtype: str  # the checkpoint's own dtype name: float32, bfloat16, float16

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir)
        config_path = path / "config.json"
        if not config_path.is_file():
            raise UnsupportedModelError("config.json", f"no config.json in {path}.")
        raw = json.loads(config_path.read_text())
        generation: dict[str, Any] = {}
        if (path / "generation_config.json").is_file():
            generation = json.loads((path / "generation_config.json").read_text())
        return cls.from_dict(raw, generation)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], generation: dict[str, Any] | None = None) -> ModelConfig:
        generation = generation or {}
        architectures = raw.get("architectures") or []
        arch = next((a for a in architectures if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise UnsupportedModelError(
                "architectures",
                f"{architectures or 'missing'} is not supported; this engine runs "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}.",
            )

        def need(name: str) -> Any:
            if raw.get(name) is None:
                raise UnsupportedModelError(name, "missing from config.json.")
            return raw[name]

        hidden_act = raw.get("hidden_act", raw.get("hidden_activation", "silu"))
        if hidden_act != "silu":
            raise UnsupportedModelError("hidden_act", f"{hidden_act!r}; only 'silu' (SwiGLU) is supported.")
        if raw.get("mlp_bias"):
            raise UnsupportedModelError("mlp_bias", "MLP biases are not supported.")
        if raw.get("quantization_config"):
            raise UnsupportedModelError("quantization_config", "quantized checkpoints are not supported.")
        sliding = raw.get("sliding_window")
        uses_sliding = raw.get("use_sliding_window", arch == "MistralForCausalLM")
        max_pos = int(need("max_position_embeddings"))
        if sliding and uses_sliding and int(sliding) < max_pos:
            raise UnsupportedModelError("sliding_window", f"sliding-window attention ({sliding}) is not supported.")

        heads = int(need("num_attention_heads"))
        kv_heads = int(raw.get("num_key_value_heads") or heads)
        hidden = int(need("hidden_size"))
        if heads % kv_heads:
            raise UnsupportedModelError(
                "num_key_value_heads", f"{kv_heads} does not divide num_attention_heads ({heads})."
            )
        head_dim = int(raw.get("head_dim") or hidden // heads)

        # transformers 5 writes rope_parameters; older checkpoints rope_theta + rope_scaling.
        rope_params = raw.get("rope_parameters") or {}
        rope_theta = float(rope_params.get("rope_theta", raw.get("rope_theta", 10000.0)))
        scaling = raw.get("rope_scaling") or (
            rope_params if rope_params.get("rope_type", "default") != "default" else None
        )
        field = "rope_scaling" if raw.get("rope_scaling") else "rope_parameters"
        if scaling:
            rope_type = scaling.get("rope_type", scaling.get("type", "default"))
            if rope_type not in SUPPORTED_ROPE_TYPES:
                raise UnsupportedModelError(
                    f"{field}.rope_type",
                    f"{rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}.",
                )
            if rope_type == "default":
                scaling = None

        attention_bias = bool(raw.get("attention_bias", False))
        qkv_bias = SUPPORTED_ARCHITECTURES[arch] or attention_bias
        eos = generation.get("eos_token_id", raw.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        dtype = str(raw.get("torch_dtype") or raw.get("dtype") or "float32")
        return cls(
            architecture=arch,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_hidden_layers=int(need("num_hidden_layers")),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=dict(scaling) if scaling else None,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=attention_bias,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype=dtype,
        )

    def rope_inv_freq(self) -> Any:
        """RoPE inverse frequencies (float32 tensor), computed as transformers does."""
        dim = self.head_dim
        inv = 1.0 / (self.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        if not self.rope_scaling:
            return inv
        kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
        factor = float(self.rope_scaling.get("factor", 1.0))
        if kind == "linear":
            return inv / factor
        # llama3: keep high frequencies, divide low ones by factor, blend between.
        low = float(self.rope_scaling.get("low_freq_factor", 1.0))
        high = float(self.rope_scaling.get("high_freq_factor", 4.0))
        old_len = float(self.rope_scaling.get("original_max_position_embeddings", 8192))
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
