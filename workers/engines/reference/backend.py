"""The reference engine as a ``workers.engines`` backend."""

from __future__ import annotations

from workers.engines import resolve_device
from workers.engines.api import AsyncEngine, Backend, EngineSpec
from workers.profile import EngineProfile, profile_errors


def build(spec: EngineSpec, profile: EngineProfile) -> AsyncEngine:
    # torch loads with the engine, not when the registry checks a profile.
    from workers.engines.reference.async_llm import AsyncLLM

    return AsyncLLM(
        model=spec.model,
        device=resolve_device(spec.device),
        served_model_name=spec.model_name,
        max_model_len=spec.max_model_len,
        profile=profile,
        dtype=spec.dtype,
        seed=spec.seed,
        fault_stall_marker=spec.fault_stall_marker,
    )


def errors(profile: EngineProfile, device: str, max_model_len: int | None) -> dict[str, list[str]]:
    return profile_errors(profile.to_dict(), engine_kind="reference", max_model_len=max_model_len)


BACKEND = Backend(build=build, default_profile=lambda device: EngineProfile(), errors=errors)
