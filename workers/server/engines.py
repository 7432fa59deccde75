"""Engine backends by kind: a registry of import strings, as healthchecks
chooses its transports. Each entry names a ``Backend``: how to validate a
profile for it, its default profile, and how to build its ``AsyncEngine``.
A backend's heavy imports (torch, vLLM) happen only when it is chosen.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workers.engine_api import AsyncEngine
from workers.profile import EngineProfile, ProfileError, profile_errors

BACKENDS: dict[str, str] = {
    "reference": "workers.server.engines:REFERENCE",
    "vllm": "workers.server.engines:VLLM",
}


@dataclass(frozen=True)
class EngineSpec:
    """Everything a worker fixes at start; the profile is what changes."""

    kind: str
    model: str
    device: str = "auto"
    served_model_name: str | None = None
    max_model_len: int | None = None
    dtype: str = "auto"
    seed: int = 0

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model).name


@dataclass(frozen=True)
class Backend:
    build: Callable[[EngineSpec, EngineProfile], AsyncEngine]
    default_profile: Callable[[str], EngineProfile]  # by resolved device
    errors: Callable[[EngineProfile, str, int | None], dict[str, list[str]]]  # profile, device, max_model_len


def backend(kind: str) -> Backend:
    if kind not in BACKENDS:
        raise ValueError(f"unknown engine {kind!r}; choose one of {', '.join(BACKENDS)}.")
    module, _, attr = BACKENDS[kind].partition(":")
    found: Backend = getattr(importlib.import_module(module), attr)
    return found


def resolve_device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def validate(spec: EngineSpec, profile: EngineProfile, max_model_len: int | None) -> None:
    """Raise ProfileError if this backend cannot run ``profile``."""
    errors = backend(spec.kind).errors(profile, resolve_device(spec.device), max_model_len)
    if errors:
        raise ProfileError(errors)


# ---- reference -------------------------------------------------------------


def _build_reference(spec: EngineSpec, profile: EngineProfile) -> AsyncEngine:
    from workers.engine import AsyncLLM

    engine: Any = AsyncLLM(
        model=spec.model,
        device=resolve_device(spec.device),
        served_model_name=spec.model_name,
        max_model_len=spec.max_model_len,
        profile=profile,
        dtype=spec.dtype,
        seed=spec.seed,
    )
    return engine  # type: ignore[no-any-return]


def _reference_errors(profile: EngineProfile, device: str, max_model_len: int | None) -> dict[str, list[str]]:
    return profile_errors(profile.to_dict(), engine_kind="reference", max_model_len=max_model_len)


REFERENCE = Backend(
    build=_build_reference,
    default_profile=lambda device: EngineProfile(),
    errors=_reference_errors,
)


# ---- vllm ------------------------------------------------------------------


def _build_vllm(spec: EngineSpec, profile: EngineProfile) -> AsyncEngine:
    from workers.vllm_backend.engine import VLLMEngine

    engine: Any = VLLMEngine(
        spec.model,
        profile,
        device=spec.device,
        served_model_name=spec.model_name,
        max_model_len=spec.max_model_len,
        dtype=spec.dtype,
        seed=spec.seed,
    )
    return engine  # type: ignore[no-any-return]


def _vllm_errors(profile: EngineProfile, device: str, max_model_len: int | None) -> dict[str, list[str]]:
    from workers.vllm_backend.args import vllm_profile_errors

    return vllm_profile_errors(profile, device=device, max_model_len=max_model_len)


def _vllm_default(device: str) -> EngineProfile:
    from workers.vllm_backend.args import default_profile

    return default_profile(device)


VLLM = Backend(build=_build_vllm, default_profile=_vllm_default, errors=_vllm_errors)
