"""Chunkpilot's reference inference engine (PyTorch, CPU or CUDA).

A Llama-family decoder over a paged KV cache with prefix caching, stepped by
a scheduler that prefills monolithic or chunked (DESIGN.md), with exact
per-request and per-step metrics. Shaped like vLLM::

    from workers.engine import LLM, SamplingParams
    llm = LLM(model="var/tiny-model", prefill_mode="chunked", max_num_batched_tokens=256)
    out = llm.generate(["The for statement"], SamplingParams(temperature=0, max_tokens=32))
    print(out[0].outputs[0].text)

``AsyncLLM`` is the streaming ``workers.engine_api.AsyncEngine`` the worker
server runs.
"""

from workers.engine.async_llm import AsyncLLM
from workers.engine.llm_engine import LLM, LLMEngine
from workers.engine_api import RequestOutput, SamplingParams

__all__ = ["LLM", "LLMEngine", "AsyncLLM", "SamplingParams", "RequestOutput"]
