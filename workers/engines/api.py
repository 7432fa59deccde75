"""What every engine backend offers the worker server, and what it reports.

Two backends implement ``AsyncEngine``: the reference engine
(``workers.engines.reference``) and the vLLM backend
(``workers.engines.vllm``). The server, the agent and the metrics exporter
speak only this interface, so one OpenAI server and one ``/metrics``
vocabulary serve both. Each backend's ``Backend`` record tells the registry
(``workers.engines``) how to check a profile for it and how to build it from
an ``EngineSpec``.

The records (``RequestMetrics``, ``StepMetrics``) are what an engine knows
exactly; every figure ("Metrics" in docs/architecture.md) is computed from
them by ``workers.figures`` (bench, load generator) and
``workers.server.metrics`` (Prometheus). docs/engines.md says how each engine
fills them. Pure Python: no torch, no Django.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, runtime_checkable

from workers.profile import EngineProfile


class EngineError(RuntimeError):
    """The engine failed; the request cannot continue."""


class RequestFailed(EngineError):
    """The engine failed this one request after accepting it (its sampling
    or its step broke); the engine itself goes on serving the others. Not
    worth retrying elsewhere: the same input would fail the same way."""


class RequestError(ValueError):
    """Bad input for one request (empty prompt, too long, bad sampling
    parameter). ``field`` names the offending parameter for a 400 reply."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


@dataclass
class SamplingParams:
    """vLLM's names and defaults for the parameters both engines support."""

    max_tokens: int | None = 16  # None: up to the model's max length
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; 0 or more: the chosen token's logprob
    include_stop_str_in_output: bool = False
    min_tokens: int = 0  # no EOS, stop token or stop string before this many output tokens
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit

    def validate(self) -> None:
        if self.max_tokens is not None and self.max_tokens < 1:
            raise RequestError(f"max_tokens must be at least 1; got {self.max_tokens}.", "max_tokens")
        for name in ("temperature", "top_p"):
            if not math.isfinite(getattr(self, name)):
                raise RequestError(f"{name} must be a finite number; got {getattr(self, name)}.", name)
        if self.temperature < 0:
            raise RequestError(f"temperature must be non-negative; got {self.temperature}.", "temperature")
        if self.seed is not None and not -(2**63) <= self.seed < 2**63:
            raise RequestError(f"seed must be a 64-bit signed integer; got {self.seed}.", "seed")
        if not 0 < self.top_p <= 1:
            raise RequestError(f"top_p must be in (0, 1]; got {self.top_p}.", "top_p")
        if self.top_k < -1:
            raise RequestError(f"top_k must be -1, 0 or positive; got {self.top_k}.", "top_k")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise RequestError(
                f"min_tokens must be in [0, max_tokens ({self.max_tokens})]; got {self.min_tokens}.", "min_tokens"
            )
        if any(t < 0 or not (math.isfinite(b) and -100 <= b <= 100) for t, b in self.logit_bias.items()):
            raise RequestError("logit_bias maps token ids to biases in [-100, 100].", "logit_bias")


@dataclass
class RequestMetrics:
    """One request's life, in ``time.monotonic()`` seconds."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # one per output token
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_output_tokens: int = 0
    num_preemptions: int = 0
    # Per prefill chunk: how long the request waited, schedulable, since its
    # previous chunk ended (or since arrival for the first chunk).
    prefill_chunk_waits: list[float] = field(default_factory=list)
    # Per prefill chunk (or step, recomputes after a preemption included):
    # (time.monotonic() it was scheduled, its tokens). None: the engine does
    # not know its chunks (vLLM), never a guess.
    prefill_chunks: list[tuple[float, int]] | None = None


@dataclass
class StepMetrics:
    """One engine step."""

    start_time: float  # time.monotonic()
    duration_seconds: float
    num_prefill_tokens: int
    num_decode_tokens: int
    num_running: int  # requests scheduled this step
    num_waiting: int  # requests left waiting after scheduling
    num_blocks_held: int  # KV blocks referenced by live requests after the step
    num_tokens_stored: int  # tokens whose KV those blocks hold
    block_size: int
    num_blocks_total: int
    memory_bytes: int  # engine memory in use after the step (KV held + resident)
    peak_memory_bytes: int  # the step's high-water mark (KV + transient activations)
    num_preemptions: int = 0  # preemptions this step
    prefill_chunk_waits: list[float] = field(default_factory=list)  # chunks run this step
    prefix_cache_queries: int = 0  # prompt tokens looked up this step
    prefix_cache_hits: int = 0  # of which found cached
    # The largest prefill running this step, in tokens left to compute after
    # its prefix-cache hit (its whole prefill, not this step's chunk); 0: no
    # prefill ran; None: the engine does not know (the advisor's head-of-line figures).
    max_prefill_tokens: int | None = None

    @property
    def kv_fragmentation(self) -> float | None:
        """1 − tokens stored / (blocks held × block_size); None with no blocks."""
        capacity = self.num_blocks_held * self.block_size
        return None if capacity == 0 else 1.0 - self.num_tokens_stored / capacity


@dataclass(frozen=True)
class MemoryFacts:
    """What an engine knows of its memory, for the advisor's knobs and PD estimate."""

    weight_bytes: int
    kv_bytes_per_token: int  # K and V of one token over every layer, in the cache's dtype


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[float] | None = None  # the chosen tokens' logprobs
    finish_reason: str | None = None  # "stop", "length", "abort"
    stop_reason: int | str | None = None  # the stop token id or string that matched


@dataclass
class RequestOutput:
    """As vLLM's. From ``generate`` (batch) the outputs are cumulative; from
    ``AsyncEngine.generate`` (streaming) each one carries only the new tokens
    and text (vLLM's RequestOutputKind.DELTA)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None  # set on the final output


@dataclass
class EngineLoad:
    num_requests_running: int
    num_requests_waiting: int
    kv_cache_usage_perc: float  # 0–1


class EngineObserver(Protocol):
    """Receives records as they happen; must be cheap (called on the engine's
    thread, between steps)."""

    def on_step(self, step: StepMetrics) -> None: ...

    def on_request_finished(self, request_id: str, metrics: RequestMetrics, finish_reason: str) -> None: ...


@runtime_checkable
class AsyncEngine(Protocol):
    engine_kind: str  # "reference" or "vllm"
    model_name: str
    max_model_len: int
    profile: EngineProfile

    async def start(self) -> None:
        """Load the model and start stepping; returns when ready to serve."""

    async def shutdown(self) -> None:
        """Abort what is in flight and release the model and its memory."""

    def generate(
        self, prompt: str | list[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        """Stream delta outputs; raises RequestError before the first one for bad input."""

    async def abort(self, request_id: str) -> None:
        """Stop a request and free its KV blocks; its stream ends with finish_reason "abort"."""

    async def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block, so the next requests start cold
        (an experiment's arms and repeats each do). True when it was reset."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens=False`` for a rendered chat
        template, which writes its own BOS."""

    def decode(self, token_ids: list[int]) -> str: ...

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str: ...

    def load(self) -> EngineLoad: ...

    def add_observer(self, observer: EngineObserver) -> None: ...


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
    # Fault injection, reference engine only, off when empty: a request whose
    # prompt contains this text stops being fed after its first output
    # (hanging-request tests).
    fault_stall_marker: str = ""
    # Simulated engine only (workers/engines/sim): the device it simulates,
    # from AIConfigurator's database (system, backend, model config, database
    # version) or a step-time table fitted to the reference engine.
    sim_system: str | None = None
    sim_backend: str = "vllm"
    sim_model: str | None = None
    sim_version: str | None = None
    sim_table: str | None = None

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model).name


@dataclass(frozen=True)
class Backend:
    """One engine kind, as the registry (``workers.engines.BACKENDS``) finds it."""

    build: Callable[[EngineSpec, EngineProfile], AsyncEngine]
    default_profile: Callable[[str], EngineProfile]  # by resolved device
    errors: Callable[[EngineProfile, str, int | None], dict[str, list[str]]]  # profile, device, max_model_len
