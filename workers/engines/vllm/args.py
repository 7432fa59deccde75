"""An engine profile in vLLM's words: pure, importable without vLLM.

The mapping is one-to-one where vLLM has the knob (the engine contract names
them after vLLM's flags; docs/engines.md); ``workers.profile.UNSUPPORTED_KNOBS["vllm"]`` lists the
knobs it lacks, refused here before vLLM is ever imported. vLLM's CPU
attention adds a rule of its own: the block size must be a multiple of 32.
"""

from __future__ import annotations

from typing import Any

from workers.profile import EngineProfile, ProfileError, profile_errors

# vLLM's CPU attention kernels only take blocks of a multiple of this size
# (``Unsupported CPU attention configuration`` otherwise).
CPU_BLOCK_SIZE_MULTIPLE = 32
# vLLM on CPU fails with its default memory fraction: it needs an explicit KV
# size. A GPU worker leaves it unset and vLLM sizes it from free memory.
DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30


def vllm_profile_errors(
    profile: EngineProfile, *, device: str, max_model_len: int | None = None
) -> dict[str, list[str]]:
    """Every way ``profile`` cannot run on vLLM on ``device``, by field."""
    errors = profile_errors(profile.to_dict(), engine_kind="vllm", max_model_len=max_model_len)
    if device == "cpu" and profile.block_size % CPU_BLOCK_SIZE_MULTIPLE:
        errors.setdefault("block_size", []).append(
            f"vLLM's CPU attention needs a block size that is a multiple of {CPU_BLOCK_SIZE_MULTIPLE}; "
            f"got {profile.block_size}."
        )
    return errors


def default_profile(device: str) -> EngineProfile:
    """The profile a vLLM worker runs when none is given."""
    if device == "cpu":
        return EngineProfile(block_size=CPU_BLOCK_SIZE_MULTIPLE)
    return EngineProfile()


def engine_args_for(
    profile: EngineProfile,
    *,
    model: str,
    device: str,
    served_model_name: str | None = None,
    max_model_len: int | None = None,
    dtype: str = "auto",
    seed: int = 0,
) -> dict[str, Any]:
    """Keyword arguments for ``vllm.engine.arg_utils.EngineArgs``.

    Raises ProfileError for a profile vLLM cannot run.
    """
    errors = vllm_profile_errors(profile, device=device, max_model_len=max_model_len)
    if errors:
        raise ProfileError(errors)
    kwargs: dict[str, Any] = {
        "model": model,
        "tokenizer": model,
        "dtype": dtype,
        "seed": seed,
        # Eager on CPU: no compile at start (slow there, and it writes a cache
        # under ~/.cache), and a profile switch rebuilds in seconds. A GPU
        # keeps CUDA graphs: decode speed is worth the capture at each build.
        "enforce_eager": device != "cuda",
        "enable_chunked_prefill": profile.is_chunked,
        "max_num_batched_tokens": profile.max_num_batched_tokens,
        "max_num_seqs": profile.max_num_seqs,
        "block_size": profile.block_size,
        "enable_prefix_caching": profile.enable_prefix_caching,
        # Our own stat records feed /metrics; vLLM's stay on for its own
        # Prometheus metrics.
        "disable_log_stats": False,
    }
    if profile.long_prefill_token_threshold is not None:
        kwargs["long_prefill_token_threshold"] = profile.long_prefill_token_threshold
    kv_cache_bytes = profile.kv_cache_bytes
    if kv_cache_bytes is None and device == "cpu":
        kv_cache_bytes = DEFAULT_CPU_KV_CACHE_BYTES
    if kv_cache_bytes is not None:
        kwargs["kv_cache_memory_bytes"] = kv_cache_bytes
    if served_model_name:
        kwargs["served_model_name"] = served_model_name
    if max_model_len is not None:
        kwargs["max_model_len"] = max_model_len
    return kwargs


def cli_flags_for(kwargs: dict[str, Any]) -> list[str]:
    """The same settings as ``vllm serve`` flags, for logs and for operators
    who run vLLM's own server with a Chunkpilot profile."""
    flags: list[str] = []
    for name, value in kwargs.items():
        if name in ("model", "tokenizer"):
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        else:
            flags.extend([flag, str(value)])
    return flags
