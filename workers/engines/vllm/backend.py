"""The vLLM engine as a ``workers.engines`` backend."""

from __future__ import annotations

from workers.engines.api import AsyncEngine, Backend, EngineSpec
from workers.engines.vllm.args import default_profile, vllm_profile_errors
from workers.profile import EngineProfile


def build(spec: EngineSpec, profile: EngineProfile) -> AsyncEngine:
    # torch (and, at start, vLLM) load with the engine, not when the registry
    # checks a profile.
    from workers.engines.vllm.engine import VLLMEngine

    return VLLMEngine(
        spec.model,
        profile,
        device=spec.device,
        served_model_name=spec.model_name,
        max_model_len=spec.max_model_len,
        dtype=spec.dtype,
        seed=spec.seed,
    )


def errors(profile: EngineProfile, device: str, max_model_len: int | None) -> dict[str, list[str]]:
    return vllm_profile_errors(profile, device=device, max_model_len=max_model_len)


BACKEND = Backend(build=build, default_profile=default_profile, errors=errors)
