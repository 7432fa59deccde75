"""A Llama-family decoder (Llama, Mistral without sliding windows, Qwen2):
RMSNorm, rotary embeddings with the checkpoint's theta, grouped-query
attention, SwiGLU MLP, tied or untied embeddings, optional QKV bias.

Weights load from the checkpoint's safetensors under Hugging Face names;
q/k/v and gate/up are fused into one matrix each so a layer runs fewer,
larger matmuls. ``forward`` runs a packed step against the paged cache;
``forward_dense`` runs plain causal batches (training the tiny model, tests).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import cast

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from workers.engines.reference.attention import AttentionContext, apply_rope, paged_attention
from workers.engines.reference.config import ModelConfig, UnsupportedModelError


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # one fused op, same result
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Hugging Face's order for half types: float32 statistics, cast back, then scale.
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, config.q_size + 2 * config.kv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(config.q_size, config.hidden_size, bias=config.o_bias)

    def forward(self, x: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x).view(num_tokens, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        qk = apply_rope(qkv[:, : self.num_heads + self.num_kv_heads], ctx.cos, ctx.sin)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, self.num_heads + self.num_kv_heads :]
        o = paged_attention(self.layer, q, k, v, ctx)
        return self.o_proj(o.reshape(num_tokens, self.num_heads * self.head_dim))

    def forward_dense(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        qkv = self.qkv_proj(x).view(batch * length, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        qk = apply_rope(qkv[:, : self.num_heads + self.num_kv_heads], cos, sin)
        q = qk[:, : self.num_heads].view(batch, length, self.num_heads, self.head_dim).transpose(1, 2)
        k = qk[:, self.num_heads :].view(batch, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = (
            qkv[:, self.num_heads + self.num_kv_heads :]
            .reshape(batch, length, self.num_kv_heads, self.head_dim)
            .transpose(1, 2)
        )
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.num_heads != self.num_kv_heads)
        return self.o_proj(o.transpose(1, 2).reshape(batch, length, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.self_attn = Attention(config, layer)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), ctx)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_dense(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn.forward_dense(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    inv_freq: torch.Tensor

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("inv_freq", config.rope_inv_freq(), persistent=False)

    # ---- running ---------------------------------------------------------
    def decoder_layers(self) -> list[DecoderLayer]:
        return cast(list[DecoderLayer], list(self.layers))

    def rope_cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        return freqs.cos().to(dtype), freqs.sin().to(dtype)

    def forward(self, input_ids: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        """Hidden states (before the final norm) of a packed step."""
        x = self.embed_tokens(input_ids)
        for layer in self.decoder_layers():
            x = layer(x, ctx)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden)).float()

    def forward_dense(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits [batch, length, vocab] of full causal batches (positions from 0)."""
        batch, length = input_ids.shape
        positions = torch.arange(length, device=input_ids.device).repeat(batch)
        cos, sin = self.rope_cos_sin(positions, self.embed_tokens.weight.dtype)
        x = self.embed_tokens(input_ids)
        for layer in self.decoder_layers():
            x = layer.forward_dense(x, cos, sin)
        return self.lm_head(self.norm(x)).float()

    # ---- weights ---------------------------------------------------------
    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Weights under Hugging Face Llama names (q/k/v and gate/up split back)."""
        c = self.config
        out: dict[str, torch.Tensor] = {"model.embed_tokens.weight": self.embed_tokens.weight}
        for i, layer in enumerate(self.decoder_layers()):
            p = f"model.layers.{i}."
            q, k, v = layer.self_attn.qkv_proj.weight.split([c.q_size, c.kv_size, c.kv_size])
            out[p + "self_attn.q_proj.weight"] = q
            out[p + "self_attn.k_proj.weight"] = k
            out[p + "self_attn.v_proj.weight"] = v
            if c.qkv_bias:
                qb, kb, vb = layer.self_attn.qkv_proj.bias.split([c.q_size, c.kv_size, c.kv_size])
                out[p + "self_attn.q_proj.bias"] = qb
                out[p + "self_attn.k_proj.bias"] = kb
                out[p + "self_attn.v_proj.bias"] = vb
            out[p + "self_attn.o_proj.weight"] = layer.self_attn.o_proj.weight
            if c.o_bias:
                out[p + "self_attn.o_proj.bias"] = layer.self_attn.o_proj.bias
            gate, up = layer.mlp.gate_up_proj.weight.split(c.intermediate_size)
            out[p + "mlp.gate_proj.weight"] = gate
            out[p + "mlp.up_proj.weight"] = up
            out[p + "mlp.down_proj.weight"] = layer.mlp.down_proj.weight
            out[p + "input_layernorm.weight"] = layer.input_layernorm.weight
            out[p + "post_attention_layernorm.weight"] = layer.post_attention_layernorm.weight
        out["model.norm.weight"] = self.norm.weight
        if not c.tie_word_embeddings:
            out["lm_head.weight"] = self.lm_head.weight
        return {k: v.detach().contiguous() for k, v in out.items()}

    @torch.no_grad()
    def load_checkpoint(self, model_dir: str | Path) -> None:
        files = sorted(Path(model_dir).glob("*.safetensors"))
        if not files:
            raise UnsupportedModelError("model.safetensors", f"no *.safetensors files in {model_dir}.")
        tensors: dict[str, torch.Tensor] = {}
        for path in files:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    tensors[name] = f.get_tensor(name)
        self.load_hf_state_dict(tensors)

    @torch.no_grad()
    def load_hf_state_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        c = self.config

        def take(name: str) -> torch.Tensor:
            if name not in tensors:
                raise UnsupportedModelError(name, "tensor missing from the checkpoint.")
            return tensors[name]

        def put(param: torch.Tensor, value: torch.Tensor, name: str) -> None:
            if tuple(param.shape) != tuple(value.shape):
                raise UnsupportedModelError(name, f"shape {tuple(value.shape)}, expected {tuple(param.shape)}.")
            param.copy_(value.to(param.dtype))

        put(self.embed_tokens.weight, take("model.embed_tokens.weight"), "model.embed_tokens.weight")
        for i, layer in enumerate(self.decoder_layers()):
            p = f"model.layers.{i}."
            attn = layer.self_attn
            qkv = torch.cat([take(p + f"self_attn.{x}_proj.weight") for x in "qkv"])
            put(attn.qkv_proj.weight, qkv, p + "self_attn.qkv_proj.weight")
            if c.qkv_bias:
                bias = torch.cat([take(p + f"self_attn.{x}_proj.bias") for x in "qkv"])
                put(attn.qkv_proj.bias, bias, p + "self_attn.qkv_proj.bias")
            put(attn.o_proj.weight, take(p + "self_attn.o_proj.weight"), p + "self_attn.o_proj.weight")
            if c.o_bias:
                put(attn.o_proj.bias, take(p + "self_attn.o_proj.bias"), p + "self_attn.o_proj.bias")
            gate_up = torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")])
            put(layer.mlp.gate_up_proj.weight, gate_up, p + "mlp.gate_up_proj.weight")
            put(layer.mlp.down_proj.weight, take(p + "mlp.down_proj.weight"), p + "mlp.down_proj.weight")
            put(layer.input_layernorm.weight, take(p + "input_layernorm.weight"), p + "input_layernorm.weight")
            put(
                layer.post_attention_layernorm.weight,
                take(p + "post_attention_layernorm.weight"),
                p + "post_attention_layernorm.weight",
            )
        put(self.norm.weight, take("model.norm.weight"), "model.norm.weight")
        if not c.tie_word_embeddings:
            put(self.lm_head.weight, take("lm_head.weight"), "lm_head.weight")

    def num_weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self._unique_parameters())

    def _unique_parameters(self) -> Iterator[torch.Tensor]:
        seen: set[int] = set()
        for p in self.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                yield p
