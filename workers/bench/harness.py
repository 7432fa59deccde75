"""The benchmarks' replay harness: a workload's requests fed to an engine at
their arrival times, stepped until drained, each token timed when its step
returned.

Engines sit behind one small interface (``Adapter``): ``ReferenceAdapter``
for Chunkpilot's engine, built here or handed in already built (gpu-check
keeps one engine across runs), and ``VLLMAdapter`` for vLLM's V1 engine.
``replay`` works with either, so both engines are timed by the same clock.
"""

from __future__ import annotations

import dataclasses
import gc
import importlib.util
import math
import os
import random
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from workers.engines.api import RequestMetrics, SamplingParams, StepMetrics
from workers.engines.reference import LLMEngine
from workers.engines.reference.sequence import OutputKind

# vLLM is imported where its adapter is built, never up here: only the bench's
# child process runs it (see prefill.main), after prepare_vllm_environment().


# ---- workload --------------------------------------------------------------------
@dataclass(frozen=True)
class Request:
    request_id: str
    offset_seconds: float  # arrival, from the start of the replay
    prompt_token_ids: list[int]
    max_tokens: int

    @property
    def is_long(self) -> bool:
        return len(self.prompt_token_ids) > 2048


def mixed_workload(
    seed: int, duration: float, rate: float, long_fraction: float, long_range: tuple[int, int], vocab: int, bos: int
) -> list[Request]:
    """Poisson arrivals; lognormal short prompts (~300 tokens) and outputs
    (~120 tokens, 16–400); a ``long_fraction`` of long prompts, at least two."""
    rng = random.Random(seed)
    arrivals = []
    t = 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= duration:
            break
        arrivals.append(t)
    longs = {i for i in range(len(arrivals)) if rng.random() < long_fraction}
    for share in (0.25, 0.6):  # the figures need long prompts to be there
        if len(longs) < 2 and arrivals:
            longs.add(int(share * len(arrivals)))
    out = []
    for i, at in enumerate(arrivals):
        if i in longs:
            n = rng.randint(*long_range)
        else:
            n = min(1500, max(32, int(rng.lognormvariate(math.log(300), 0.6))))
        max_tokens = min(400, max(16, int(rng.lognormvariate(math.log(120), 0.7))))
        ids = [bos] + [rng.randrange(3, vocab) for _ in range(n - 1)]
        out.append(Request(f"m{i}", at, ids, max_tokens))
    return out


# ---- engines behind one small interface -----------------------------------------
class StepOutput(NamedTuple):
    request_id: str
    num_new_tokens: int
    finished: bool


class Adapter:
    label: str
    steps: list[StepMetrics]
    engine_metrics: dict[str, RequestMetrics]

    def add(self, r: Request, arrival: float) -> None:
        raise NotImplementedError

    def step(self) -> list[StepOutput]:
        raise NotImplementedError

    def has_work(self) -> bool:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class ReferenceAdapter(Adapter):
    """The reference engine, observed for its steps and finished requests.

    ``build`` makes an engine that the adapter owns and frees on ``close``;
    an engine handed in is only let go of (observer removed), so its caller
    can run it again under another profile. With ``account_memory`` each step
    is also kept with the accounting formula's memory figures (``accounted``),
    for gpu-check to hold against the allocator's."""

    def __init__(self, label: str, engine: LLMEngine, *, owned: bool = False, account_memory: bool = False):
        self.label = label
        self.engine = engine
        self.owned = owned
        self.account_memory = account_memory
        self.steps: list[StepMetrics] = []
        self.accounted: list[StepMetrics] = []
        self.engine_metrics: dict[str, RequestMetrics] = {}
        engine.add_observer(self)

    @classmethod
    def build(cls, label: str, model: Path, profile: dict[str, Any], max_model_len: int) -> ReferenceAdapter:
        return cls(label, LLMEngine(model, max_model_len=max_model_len, **profile), owned=True)

    def on_step(self, step: StepMetrics) -> None:
        self.steps.append(step)
        if self.account_memory:
            acc = self.engine.memory.last_accounted
            self.accounted.append(
                dataclasses.replace(step, memory_bytes=acc.memory_bytes, peak_memory_bytes=acc.peak_memory_bytes)
            )

    def on_request_finished(self, request_id: str, metrics: RequestMetrics, finish_reason: str) -> None:
        self.engine_metrics[request_id] = metrics

    def add(self, r: Request, arrival: float) -> None:
        params = SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True)
        self.engine.add_request(
            r.request_id, r.prompt_token_ids, params, arrival_time=arrival, output_kind=OutputKind.DELTA
        )

    def step(self) -> list[StepOutput]:
        return [StepOutput(o.request_id, len(o.outputs[0].token_ids), o.finished) for o in self.engine.step()]

    def has_work(self) -> bool:
        return self.engine.has_unfinished_requests()

    def close(self) -> None:
        self.engine.observers.remove(self)
        if self.owned:
            del self.engine
            gc.collect()


class VLLMAdapter(Adapter):
    def __init__(self, label: str, model: Path, profile: dict[str, Any], max_model_len: int, kv_cache_bytes: int):
        from vllm.engine.arg_utils import EngineArgs  # vLLM: see the note at the top
        from vllm.v1.engine.llm_engine import LLMEngine

        self.label = label
        chunked = profile.get("prefill_mode", "chunked") == "chunked"
        kwargs: dict[str, Any] = dict(
            model=str(model),
            tokenizer=str(model),
            dtype="float32",
            seed=0,
            enforce_eager=True,
            max_model_len=max_model_len,
            enable_chunked_prefill=chunked,
            max_num_batched_tokens=profile["max_num_batched_tokens"],
            max_num_seqs=profile["max_num_seqs"],
            block_size=profile["block_size"],
            kv_cache_memory_bytes=kv_cache_bytes,
            disable_log_stats=False,  # per-request stats carry when each request was first scheduled
        )
        self.engine = LLMEngine.from_engine_args(EngineArgs(**kwargs), enable_multiprocessing=False)
        self.steps = []
        self.engine_metrics = {}
        self.ids: dict[str, str] = {}

    def add(self, r: Request, arrival: float) -> None:
        from vllm import SamplingParams as VSamplingParams  # vLLM: see the note at the top
        from vllm.sampling_params import RequestOutputKind

        params = VSamplingParams(
            temperature=0, max_tokens=r.max_tokens, ignore_eos=True, output_kind=RequestOutputKind.DELTA
        )
        internal = self.engine.add_request(r.request_id, {"prompt_token_ids": r.prompt_token_ids}, params)
        self.ids[str(internal) if internal is not None else r.request_id] = r.request_id

    def step(self) -> list[StepOutput]:
        outs: list[Any] = self.engine.step()
        result = []
        for o in outs:
            request_id = self.ids.get(o.request_id, o.request_id)
            stats = getattr(o, "metrics", None)
            if stats is not None and getattr(stats, "scheduled_ts", None):
                own = self.engine_metrics.setdefault(request_id, RequestMetrics(arrival_time=0.0))
                if own.first_scheduled_time is None:  # engine-core monotonic time, same clock in-process
                    own.first_scheduled_time = stats.scheduled_ts
                own.num_preemptions = stats.num_preemptions
            result.append(StepOutput(request_id, len(o.outputs[0].token_ids), o.finished))
        return result

    def has_work(self) -> bool:
        return bool(self.engine.has_unfinished_requests())

    def close(self) -> None:
        self.engine.engine_core.shutdown()
        del self.engine
        gc.collect()


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def prepare_vllm_environment() -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    for key in ("VLLM_NO_USAGE_STATS", "DO_NOT_TRACK", "HF_HUB_OFFLINE"):
        os.environ.setdefault(key, "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


# ---- replay ------------------------------------------------------------------------
def replay(adapter: Adapter, workload: list[Request]) -> tuple[list[RequestMetrics], float]:
    """Feed ``workload`` at its arrival times, step until drained; harness-side token times."""
    pending = deque(sorted(workload, key=lambda r: r.offset_seconds))
    records: dict[str, RequestMetrics] = {}
    start = time.monotonic() + 0.01
    while pending or adapter.has_work():
        now = time.monotonic()
        while pending and start + pending[0].offset_seconds <= now:
            r = pending.popleft()
            arrival = start + r.offset_seconds
            records[r.request_id] = RequestMetrics(arrival_time=arrival, num_prompt_tokens=len(r.prompt_token_ids))
            adapter.add(r, arrival)
        if not adapter.has_work():
            if pending:
                time.sleep(max(0.0, min(0.05, start + pending[0].offset_seconds - time.monotonic())))
            continue
        outputs = adapter.step()
        done_at = time.monotonic()
        for request_id, num_new, finished in outputs:
            m = records[request_id]
            if num_new:
                if m.first_token_time is None:
                    m.first_token_time = done_at
                m.token_times.extend([done_at] * num_new)
                m.num_output_tokens += num_new
            if finished:
                m.finished_time = done_at
    end = max((m.finished_time or start) for m in records.values()) if records else start
    for request_id, m in records.items():  # what only the engine knows
        own = adapter.engine_metrics.get(request_id)
        if own is not None:
            m.first_scheduled_time = own.first_scheduled_time
            m.num_cached_tokens = own.num_cached_tokens
            m.num_preemptions = own.num_preemptions
            m.prefill_chunk_waits = own.prefill_chunk_waits
    return list(records.values()), end - start
