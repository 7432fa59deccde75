"""Block-level figures from inside vLLM's V1 engine core: the one module that
touches vLLM internals.

vLLM's public surface (``LLMEngine``, its Prometheus metrics) says how full
the KV cache is, but not which blocks each request holds, how many tokens they
store, which requests ran a prefill chunk in a step, or how long each chunk
waited. Those live in the engine core's scheduler, reachable only when the
core runs in this process (``InprocClient``, which ``LLMEngine`` uses when
multiprocessing is off). This probe wraps two methods on *our own* engine's
instances — the scheduler's ``schedule()`` and the core client's
``get_output()`` — and reads the KV cache manager after each step.

Internal API used (vLLM 0.32; re-check on upgrade):
  ``LLMEngine.engine_core`` (InprocClient) → ``.engine_core`` (EngineCore)
  → ``.scheduler`` (Scheduler): ``schedule()``, ``requests``, ``running``,
  ``waiting``, ``kv_cache_manager`` (``get_blocks(req_id)``, ``usage``),
  ``kv_cache_config`` (``num_blocks``, ``kv_cache_tensors[].size``);
  ``SchedulerOutput.num_scheduled_tokens`` / ``preempted_req_ids``;
  ``EngineCoreOutputs.scheduler_stats.prefix_cache_stats``;
  ``Request.num_computed_tokens`` / ``num_prompt_tokens``.
Each access is guarded so that a renamed attribute fails loudly at start
(``VLLMProbe.__init__``) rather than silently during serving.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from workers.engines.api import EngineLoad


@dataclass
class StepSchedule:
    """What one ``schedule()`` call decided, classified for our figures
    (prefill vs decode tokens, chunk waits; docs/engines.md)."""

    start_time: float
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_scheduled_requests: int = 0
    num_waiting: int = 0
    num_preemptions: int = 0
    prefill_chunk_waits: list[float] = field(default_factory=list)
    # Engine-internal request id → waits of the chunks it ran this step.
    chunk_waits_by_request: dict[str, float] = field(default_factory=dict)
    first_scheduled: list[str] = field(default_factory=list)
    # The largest prefill running this step, in tokens left to compute after
    # its prefix-cache hit (its whole prefill, taken at its first chunk): the
    # advisor's long-prefill steps, as StepMetrics.max_prefill_tokens.
    max_prefill_tokens: int = 0


@dataclass
class KVOccupancy:
    num_blocks_held: int
    num_tokens_stored: int


@dataclass(frozen=True)
class PrefixCacheCounts:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of which found cached


class VLLMProbe:
    def __init__(self, llm_engine: Any):
        client = llm_engine.engine_core
        core = getattr(client, "engine_core", None)
        if core is None:
            raise RuntimeError(
                "vLLM's engine core is not in this process; the vLLM backend needs "
                "VLLM_ENABLE_V1_MULTIPROCESSING=0 (it sets it before importing vLLM)."
            )
        self._client = client
        self.scheduler = core.scheduler
        self.kv_cache_manager = self.scheduler.kv_cache_manager
        kv_config = self.scheduler.kv_cache_config
        self.num_blocks_total = int(kv_config.num_blocks)
        self.kv_cache_bytes_total = int(sum(t.size for t in kv_config.kv_cache_tensors))
        self.block_bytes = self.kv_cache_bytes_total // max(1, self.num_blocks_total)
        groups = kv_config.kv_cache_groups
        if len(groups) != 1:
            # Hybrid models (sliding window + full attention) keep one block
            # table per group; fragmentation would need a per-group definition.
            raise RuntimeError(f"the vLLM backend supports one KV cache group; this model has {len(groups)}.")
        self.block_size = int(groups[0].kv_cache_spec.block_size)

        # Engine-internal request id → when it became schedulable again
        # (arrival, or the end of its previous prefill chunk).
        self._ready_since: dict[str, float] = {}
        self._scheduled_once: set[str] = set()
        # Engine-internal request id → its prefill left after its prefix hit, at its first chunk.
        self._prefill_size: dict[str, int] = {}
        # Schedules since the last ``take_schedule``: one per step here; with
        # vLLM's batch queue (async scheduling on GPUs) a step may schedule a
        # batch whose tokens come back a step later, and none is lost.
        self._schedules: list[StepSchedule] = []
        self.last_prefix_cache = PrefixCacheCounts()  # of the last step

        original_schedule = self.scheduler.schedule
        original_get_output = client.get_output

        def schedule(*args: Any, **kwargs: Any) -> Any:
            start = time.monotonic()
            output = original_schedule(*args, **kwargs)
            self._schedules.append(self._classify(output, start))
            return output

        def get_output(*args: Any, **kwargs: Any) -> Any:
            outputs = original_get_output(*args, **kwargs)
            stats = getattr(outputs, "scheduler_stats", None)
            cache = getattr(stats, "prefix_cache_stats", None)
            self.last_prefix_cache = (
                PrefixCacheCounts(int(cache.queries), int(cache.hits)) if cache is not None else PrefixCacheCounts()
            )
            return outputs

        self.scheduler.schedule = schedule
        client.get_output = get_output

    # ---- per request -------------------------------------------------------
    def mark_arrival(self, internal_id: str, when: float) -> None:
        self._ready_since[internal_id] = when

    def forget(self, internal_id: str) -> None:
        self._ready_since.pop(internal_id, None)
        self._scheduled_once.discard(internal_id)
        self._prefill_size.pop(internal_id, None)

    # ---- per step ----------------------------------------------------------
    def _classify(self, output: Any, start: float) -> StepSchedule:
        """Split the step's tokens into prefill and decode and time each chunk.

        ``schedule()`` has already advanced ``num_computed_tokens`` by the
        scheduled count, so a request was prefilling this step when the tokens
        computed *before* the step were short of its prompt.
        """
        step = StepSchedule(start_time=start)
        requests = self.scheduler.requests
        for req_id, num_tokens in output.num_scheduled_tokens.items():
            request = requests.get(req_id)
            if request is None:
                continue
            computed_before = request.num_computed_tokens - num_tokens
            prompt_left = max(0, request.num_prompt_tokens - computed_before)
            prefill = min(num_tokens, prompt_left)
            step.num_prefill_tokens += prefill
            step.num_decode_tokens += num_tokens - prefill
            if req_id not in self._scheduled_once:
                self._scheduled_once.add(req_id)
                step.first_scheduled.append(req_id)
            if prefill:
                size = self._prefill_size.setdefault(req_id, prompt_left)
                step.max_prefill_tokens = max(step.max_prefill_tokens, size)
                ready = self._ready_since.get(req_id, start)
                wait = max(0.0, start - ready)
                step.prefill_chunk_waits.append(wait)
                step.chunk_waits_by_request[req_id] = wait
        step.num_scheduled_requests = len(output.num_scheduled_tokens)
        step.num_waiting = len(self.scheduler.waiting)
        step.num_preemptions = len(output.preempted_req_ids or ())
        return step

    def take_schedule(self, end: float) -> StepSchedule | None:
        """What was scheduled since the last call, as one step; a chunk's
        request becomes schedulable again when its step ends."""
        schedules, self._schedules = self._schedules, []
        if not schedules:
            return None
        step = schedules[0]
        for more in schedules[1:]:
            step.num_prefill_tokens += more.num_prefill_tokens
            step.num_decode_tokens += more.num_decode_tokens
            step.num_scheduled_requests = max(step.num_scheduled_requests, more.num_scheduled_requests)
            step.num_waiting = more.num_waiting
            step.num_preemptions += more.num_preemptions
            step.prefill_chunk_waits += more.prefill_chunk_waits
            step.chunk_waits_by_request.update(more.chunk_waits_by_request)
            step.first_scheduled += more.first_scheduled
            step.max_prefill_tokens = max(step.max_prefill_tokens, more.max_prefill_tokens)
        for req_id in step.chunk_waits_by_request:
            if req_id in self._ready_since:
                self._ready_since[req_id] = end
        return step

    def kv_occupancy(self) -> KVOccupancy:
        """Blocks referenced by live requests (shared prefix blocks once) and
        the tokens whose KV they hold (``num_computed_tokens``)."""
        seen: set[int] = set()
        stored = 0
        size = self.block_size
        for req_id, request in list(self.scheduler.requests.items()):
            blocks = self.kv_cache_manager.get_blocks(req_id).blocks[0]
            computed = request.num_computed_tokens
            for index, block in enumerate(blocks):
                if block.is_null or block.block_id in seen:
                    continue
                seen.add(block.block_id)
                stored += min(size, max(0, computed - index * size))
        return KVOccupancy(num_blocks_held=len(seen), num_tokens_stored=stored)

    def load(self) -> EngineLoad:
        """The scheduler's running and waiting requests and KV usage, read from any thread."""
        return EngineLoad(
            num_requests_running=len(self.scheduler.running),
            num_requests_waiting=len(self.scheduler.waiting),
            kv_cache_usage_perc=float(self.kv_cache_manager.usage),
        )

    def scheduler_stats(self) -> Any:
        """vLLM's own stats record, to refresh its gauges outside a step (after an abort)."""
        return self.scheduler.make_stats()
