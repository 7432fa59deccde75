"""The simulated engine as a ``workers.engines`` backend."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from workers.engines.api import AsyncEngine, Backend, EngineSpec
from workers.profile import EngineProfile, profile_errors

if TYPE_CHECKING:
    from workers.engines.sim.steptime import Device


@functools.cache
def device_for(system: str | None, backend: str, model: str | None, version: str | None, table: str | None) -> Device:
    """One device per set of options, shared by every worker of a process
    (``--count N``): the database loads once, and its step-cost cache is shared."""
    # The kernel database (and torch, for the model config) load with a
    # device, not when the registry checks a profile.
    from workers.engines.sim.steptime import load_device

    return load_device(system=system, backend=backend, model=model, version=version, table=table)


def spec_device(spec: EngineSpec) -> Device:
    return device_for(spec.sim_system, spec.sim_backend, spec.sim_model, spec.sim_version, spec.sim_table)


def build(spec: EngineSpec, profile: EngineProfile) -> AsyncEngine:
    # torch (for the reference engine's classes) loads with the engine.
    from workers.engines.sim.engine import SimAsyncLLM

    return SimAsyncLLM(
        spec_device(spec),
        spec.model,
        served_model_name=spec.model_name,
        max_model_len=spec.max_model_len,
        profile=profile,
        seed=spec.seed,
    )


def errors(profile: EngineProfile, device: str, max_model_len: int | None) -> dict[str, list[str]]:
    return profile_errors(profile.to_dict(), engine_kind="sim", max_model_len=max_model_len)


BACKEND = Backend(build=build, default_profile=lambda device: EngineProfile(), errors=errors)
