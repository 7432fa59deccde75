"""Chunkpilot's reference inference engine (PyTorch, CPU or CUDA).

A Llama-family decoder over a paged KV cache with prefix caching, stepped by
a scheduler that prefills monolithic or chunked, with exact per-request and
per-step metrics (docs/engines.md). Shaped like vLLM::

    from workers.engines.reference import LLM, SamplingParams
    llm = LLM(model="var/tiny-model", prefill_mode="chunked", max_num_batched_tokens=256)
    out = llm.generate(["The for statement"], SamplingParams(temperature=0, max_tokens=32))
    print(out[0].outputs[0].text)

``AsyncLLM`` is the streaming ``workers.engines.api.AsyncEngine`` the worker
server runs; ``backend.BACKEND`` is how the registry builds it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from workers.engines.api import RequestOutput, SamplingParams

if TYPE_CHECKING:
    from workers.engines.reference.async_llm import AsyncLLM
    from workers.engines.reference.llm_engine import LLM, LLMEngine

__all__ = ["LLM", "LLMEngine", "AsyncLLM", "SamplingParams", "RequestOutput"]

# These pull torch. The package is imported for light modules too (the
# registry's backend, config, the tiny model's up-to-date check), which must
# not pay for it: import the engine classes on first use.
_LAZY = {
    "AsyncLLM": "workers.engines.reference.async_llm",
    "LLM": "workers.engines.reference.llm_engine",
    "LLMEngine": "workers.engines.reference.llm_engine",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
