"""The vLLM backend: ``AsyncEngine`` over vLLM's V1 engine in this process.

``args`` maps a profile to vLLM's engine arguments (no vLLM import needed);
``engine`` runs the engine; ``probe`` is the one place that reads vLLM
internals (block-level figures). vLLM is imported only when an engine starts.
"""

from workers.vllm_backend.args import default_profile, engine_args_for, vllm_profile_errors

__all__ = ["VLLMEngine", "default_profile", "engine_args_for", "vllm_profile_errors"]


def __getattr__(name: str):  # VLLMEngine pulls torch; import it on first use
    if name == "VLLMEngine":
        from workers.vllm_backend.engine import VLLMEngine

        return VLLMEngine
    raise AttributeError(name)
