"""The vLLM backend: ``AsyncEngine`` over vLLM's V1 engine in this process.

``args`` maps a profile to vLLM's engine arguments (no vLLM import needed);
``engine`` runs the engine; ``probe`` is the one place that reads vLLM
internals (block-level figures); ``backend`` is how the registry builds it.
vLLM is imported only when an engine starts (docs/engines.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from workers.engines.vllm.args import default_profile, engine_args_for, vllm_profile_errors

if TYPE_CHECKING:
    from workers.engines.vllm.engine import VLLMEngine

__all__ = ["VLLMEngine", "default_profile", "engine_args_for", "vllm_profile_errors"]


def __getattr__(name: str) -> Any:  # VLLMEngine pulls torch; import it on first use
    if name == "VLLMEngine":
        from workers.engines.vllm.engine import VLLMEngine

        return VLLMEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
