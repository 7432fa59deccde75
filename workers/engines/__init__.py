"""The engines a worker can serve from, chosen by kind.

``api`` is the contract every engine implements (``AsyncEngine``, the records
it reports, ``EngineSpec`` and ``Backend``); ``stream`` is the delta stream
both engines hand the server. Each engine is a folder of the same shape,
``reference/`` (Chunkpilot's own, PyTorch), ``vllm/`` (vLLM's V1 engine in
this process) and ``sim/`` (the reference scheduler on a simulated GPU's step
times, from NVIDIA's AIConfigurator database), whose ``backend.py`` holds its ``BACKEND``: how to check a
profile for it, its default profile, and how to build its ``AsyncEngine``.

``BACKENDS`` names them by import string, as healthchecks names its
transports, so only the chosen backend's module is imported, and checking a
profile imports neither torch nor vLLM: they load when an engine is built.
docs/engines.md says what each engine does with a profile.
"""

from __future__ import annotations

import importlib

from workers.engines.api import Backend, EngineSpec
from workers.profile import EngineProfile, ProfileError

BACKENDS: dict[str, str] = {
    "reference": "workers.engines.reference.backend:BACKEND",
    "vllm": "workers.engines.vllm.backend:BACKEND",
    "sim": "workers.engines.sim.backend:BACKEND",
}


def backend(kind: str) -> Backend:
    if kind not in BACKENDS:
        raise ValueError(f"unknown engine {kind!r}; choose one of {', '.join(BACKENDS)}.")
    module, _, attr = BACKENDS[kind].partition(":")
    found: Backend = getattr(importlib.import_module(module), attr)
    return found


def resolve_device(device: str) -> str:
    if device != "auto":
        return device
    import torch  # only to look for a GPU: a worker given a device never loads torch here

    return "cuda" if torch.cuda.is_available() else "cpu"


def validate(spec: EngineSpec, profile: EngineProfile, max_model_len: int | None) -> None:
    """Raise ProfileError if this backend cannot run ``profile``."""
    errors = backend(spec.kind).errors(profile, resolve_device(spec.device), max_model_len)
    if errors:
        raise ProfileError(errors)


__all__ = ["BACKENDS", "Backend", "EngineSpec", "backend", "resolve_device", "validate"]
