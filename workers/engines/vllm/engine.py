"""``AsyncEngine`` over vLLM's V1 engine, run in this process.

Design note. vLLM offers two ways in: its OpenAI server (or ``AsyncLLM``),
which always puts the engine core in a separate busy-polling process, and the
V0-style ``LLMEngine``, which with multiprocessing off steps an in-process
``EngineCore`` on demand (``InprocClient``). We take the second:

* Block-level figures (blocks held, tokens stored, which requests ran a
  prefill chunk and how long each waited) exist only in the engine core's
  scheduler; in-process, ``probe.VLLMProbe`` reads them after every step.
* No engine-core process spinning on a core: on a 2-core host that process
  took ~90% of a core and starved the HTTP server (docs/engines.md). Here
  one thread steps the engine while there is work and sleeps otherwise.
* vLLM's own Prometheus metrics still come from its ``PrometheusStatLogger``
  (``LLMEngine.step`` records them), so ``/metrics`` carries vLLM's names and
  values, with our ``chunkpilot:*`` figures beside them.

Threading: ``LLMEngine`` is not thread-safe, so only the engine thread
touches it. The event loop sends commands (add, abort, stop) through a queue;
the engine thread posts each step's outputs back with one
``call_soon_threadsafe``. Streams are vLLM's DELTA outputs, merged when a
consumer falls behind (``workers.engines.stream``, as for ``AsyncLLM``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import gc
import json
import logging
import os
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from prometheus_client import REGISTRY

from workers.engines import resolve_device
from workers.engines.api import (
    CompletionOutput,
    EngineError,
    EngineLoad,
    EngineObserver,
    RequestError,
    RequestMetrics,
    RequestOutput,
    SamplingParams,
    StepMetrics,
)
from workers.engines.stream import StreamItem, deltas
from workers.engines.vllm.args import cli_flags_for, default_profile, engine_args_for
from workers.engines.vllm.probe import VLLMProbe
from workers.profile import EngineProfile

# vLLM itself is imported in the methods that use it, never up here: it reads
# its environment when imported (prepare_environment() comes first), and it
# takes seconds to load, which importing this module without starting an
# engine (the no-Django walk over every module) should not pay.

log = logging.getLogger(__name__)


def prepare_environment() -> None:
    """Before vLLM is imported: keep the engine core in this process (the
    probe needs it) and send nothing home."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("DO_NOT_TRACK", "1")


def resolve_max_model_len(model: str, requested: int | None) -> int:
    """The context length vLLM will use: the checkpoint's, capped by the request."""
    config = json.loads((Path(model) / "config.json").read_text())
    native = int(config.get("max_position_embeddings") or config.get("max_sequence_length") or 2048)
    return min(native, requested) if requested else native


def transient_activation_bytes(num_tokens: int, num_sampled: int, hf_config: Any, dtype_bytes: int) -> int:
    """CPU memory of one step's transient tensors, accounted from shapes.

    One decoder layer at a time holds, per scheduled token, the residual and
    normed hidden states (2·hidden), the fused QKV projection
    ((heads + 2·kv_heads)·head_dim) and the MLP's gate and up projections
    (2·intermediate); layers run one after another, so this is the peak, not a
    sum over layers. Sampling adds float32 logits for each sampled row.
    """
    hidden = int(hf_config.hidden_size)
    heads = int(hf_config.num_attention_heads)
    kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(hf_config, "head_dim", None) or hidden // heads)
    intermediate = int(hf_config.intermediate_size)
    per_token = 2 * hidden + (heads + 2 * kv_heads) * head_dim + 2 * intermediate
    return num_tokens * per_token * dtype_bytes + num_sampled * int(hf_config.vocab_size) * 4


@dataclass
class _Stream:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    metrics: RequestMetrics
    queue: asyncio.Queue[StreamItem] = field(default_factory=asyncio.Queue)
    internal_id: str | None = None
    num_output_tokens: int = 0
    done: bool = False  # engine thread: finished or aborted


# What the event loop asks of the engine thread, applied between steps.
@dataclass(frozen=True)
class _Add:
    stream: _Stream
    vllm_params: Any  # vllm.SamplingParams


@dataclass(frozen=True)
class _Abort:
    request_id: str


@dataclass(frozen=True)
class _Stop:
    pass


@dataclass(frozen=True)
class _Reset:
    done: concurrent.futures.Future[bool]


_Command = _Add | _Abort | _Stop | _Reset


class VLLMEngine:
    """The vLLM backend of ``workers.engines.api.AsyncEngine``."""

    engine_kind = "vllm"

    def __init__(
        self,
        model: str | Path,
        profile: EngineProfile | None = None,
        *,
        device: str = "auto",
        served_model_name: str | None = None,
        max_model_len: int | None = None,
        dtype: str = "auto",
        seed: int = 0,
    ):
        self.model_path = str(model)
        self.device = resolve_device(device)
        self.profile = profile or default_profile(self.device)
        self.model_name = served_model_name or Path(self.model_path).name
        self.max_model_len = resolve_max_model_len(self.model_path, max_model_len)
        # Validates the profile now (ProfileError), before vLLM loads anything.
        self.engine_kwargs = engine_args_for(
            self.profile,
            model=self.model_path,
            device=self.device,
            served_model_name=self.model_name,
            max_model_len=self.max_model_len,
            dtype=dtype,
            seed=seed,
        )
        self._observers: list[EngineObserver] = []
        self._streams: dict[str, _Stream] = {}
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._llm: Any = None
        self._probe: Any = None
        self._tokenizer: Any = None
        self._num_pending_adds = 0
        self.failed: BaseException | None = None  # set when the engine thread died

    # ---- lifecycle -----------------------------------------------------------
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        await asyncio.to_thread(self._build)
        self._thread = threading.Thread(target=self._run, name="vllm-engine", daemon=True)
        self._thread.start()

    def _build(self) -> None:
        prepare_environment()
        from vllm.engine.arg_utils import EngineArgs  # vLLM: after prepare_environment()
        from vllm.v1.engine.llm_engine import LLMEngine

        log.info("vLLM engine: %s", " ".join(cli_flags_for(self.engine_kwargs)))
        try:
            self._llm = LLMEngine.from_engine_args(EngineArgs(**self.engine_kwargs), enable_multiprocessing=False)
            self._probe = VLLMProbe(self._llm)
        except BaseException:
            # A build that failed after vLLM set up its process groups would
            # make every later build in this process fail ("already
            # initialized"): tear them down so the last profile can come back.
            from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

            if self._llm is not None:
                self._llm.engine_core.shutdown()
                self._llm = None
            cleanup_dist_env_and_memory()
            raise
        self._tokenizer = self._llm.get_tokenizer()
        model_config = self._llm.model_config
        self._hf_config = model_config.hf_text_config
        self._dtype_bytes = torch.empty((), dtype=model_config.dtype).element_size()
        self._weight_bytes = int(
            sum(
                self._llm.apply_model(
                    lambda m: sum(t.numel() * t.element_size() for t in [*m.parameters(), *m.buffers()])
                )
            )
        )

    async def shutdown(self) -> None:
        if self._thread is not None:
            self._commands.put(_Stop())
            await asyncio.to_thread(self._thread.join)
            self._thread = None
        if self._llm is not None:
            llm, self._llm, self._probe = self._llm, None, None
            await asyncio.to_thread(self._release, llm)

    @staticmethod
    def _release(llm: Any) -> None:
        llm.engine_core.shutdown()
        del llm
        gc.collect()

    # ---- requests ------------------------------------------------------------
    def _vllm_params(self, params: SamplingParams) -> Any:
        from vllm import SamplingParams as VSamplingParams  # vLLM: see the note at the top
        from vllm.sampling_params import RequestOutputKind

        return VSamplingParams(
            max_tokens=params.max_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k if params.top_k > 0 else 0,
            seed=params.seed,
            stop=list(params.stop) or None,
            stop_token_ids=list(params.stop_token_ids) or None,
            ignore_eos=params.ignore_eos,
            logprobs=0 if params.logprobs is not None else None,
            include_stop_str_in_output=params.include_stop_str_in_output,
            min_tokens=params.min_tokens,
            logit_bias=dict(params.logit_bias) or None,
            output_kind=RequestOutputKind.DELTA,
        )

    async def generate(
        self, prompt: str | list[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        arrival = time.monotonic()
        if self._thread is None or self.failed is not None:
            raise EngineError("the vLLM engine is not running.")
        params.validate()
        token_ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not token_ids:
            raise RequestError("the prompt is empty.", "prompt")
        if len(token_ids) >= self.max_model_len:
            raise RequestError(
                f"the prompt has {len(token_ids)} tokens; this model's maximum context length is "
                f"{self.max_model_len}, which must leave room for at least one output token.",
                "prompt",
            )
        if params.max_tokens is not None and len(token_ids) + params.max_tokens > self.max_model_len:
            raise RequestError(
                f"this model's maximum context length is {self.max_model_len} tokens; the prompt has "
                f"{len(token_ids)} and max_tokens asks for {params.max_tokens} more.",
                "max_tokens",
            )
        if request_id in self._streams:
            raise RequestError(f"request id {request_id!r} is already in flight.", "request_id")
        stream = _Stream(
            request_id=request_id,
            prompt=prompt if isinstance(prompt, str) else None,
            prompt_token_ids=token_ids,
            metrics=RequestMetrics(arrival_time=arrival, num_prompt_tokens=len(token_ids)),
        )
        self._streams[request_id] = stream
        self._num_pending_adds += 1
        self._commands.put(_Add(stream, self._vllm_params(params)))
        abandoned = functools.partial(self._commands.put, _Abort(request_id))
        async with contextlib.aclosing(deltas(stream.queue, on_abandoned=abandoned)) as outputs:
            async for out in outputs:
                yield out

    async def abort(self, request_id: str) -> None:
        if request_id in self._streams:
            self._commands.put(_Abort(request_id))

    async def reset_prefix_cache(self) -> bool:
        """vLLM's own reset, between two steps. False when vLLM refused
        (some cached blocks were still held by requests)."""
        if self.failed is not None or self._thread is None:
            raise EngineError("the vLLM engine is not running.")
        done: concurrent.futures.Future[bool] = concurrent.futures.Future()
        self._commands.put(_Reset(done))
        return await asyncio.wrap_future(done)

    # ---- tokenizer -----------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: list[int]) -> str:
        return str(self._tokenizer.decode(token_ids, skip_special_tokens=True))

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        if not getattr(self._tokenizer, "chat_template", None):
            raise RequestError("this model has no chat template; use /v1/completions.", "messages")
        try:
            return str(
                self._tokenizer.apply_chat_template(
                    messages, tokenize=False, add_generation_prompt=add_generation_prompt
                )
            )
        except Exception as exc:  # jinja2 errors: a template that rejects these messages
            raise RequestError(f"the chat template rejected the messages: {exc}", "messages") from exc

    # ---- state -------------------------------------------------------------
    def health_error(self) -> str | None:
        """Why this engine cannot serve now (its thread died), or None."""
        if self.failed is not None:
            return f"the vLLM engine failed: {self.failed!r}"
        if self._thread is not None and not self._thread.is_alive():
            return "the vLLM engine's thread is not running."
        return None

    def load(self) -> EngineLoad:
        if self._probe is None:
            return EngineLoad(0, 0, 0.0)
        load: EngineLoad = self._probe.load()
        # Requests handed to the engine thread but not yet to vLLM wait too.
        return dataclasses.replace(load, num_requests_waiting=load.num_requests_waiting + self._num_pending_adds)

    def add_observer(self, observer: EngineObserver) -> None:
        self._observers.append(observer)

    def prometheus_collector(self) -> Any:
        """vLLM's own metrics (``vllm:*``), which /metrics serves beside ours."""
        return REGISTRY

    def num_blocks_held(self) -> int:
        """Blocks referenced by live requests now (tests: an abort frees them)."""
        return 0 if self._probe is None else self._probe.kv_occupancy().num_blocks_held

    # ---- the engine thread ---------------------------------------------------
    def _post(self, fn: Callable[..., None], *args: Any) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    @staticmethod
    def _deliver(batch: list[tuple[_Stream, StreamItem]]) -> None:
        for stream, item in batch:
            stream.queue.put_nowait(item)

    def _pending_done(self) -> None:
        self._num_pending_adds -= 1

    def _run(self) -> None:
        llm = self._llm
        try:
            while True:
                commands = []
                if not llm.has_unfinished_requests():
                    commands.append(self._commands.get())  # idle: sleep until told
                while True:
                    try:
                        commands.append(self._commands.get_nowait())
                    except queue.Empty:
                        break
                if not self._handle(commands):
                    return
                if llm.has_unfinished_requests():
                    self._step()
        except BaseException as exc:  # the engine is unusable: fail every stream
            log.exception("vLLM engine thread died")
            self.failed = exc
            error = EngineError(f"the vLLM engine failed: {exc}")
            self._post(self._deliver, [(s, error) for s in self._streams.values() if not s.done])
        finally:
            for s in self._streams.values():
                s.done = True
            self._streams.clear()

    def _handle(self, commands: list[_Command]) -> bool:
        """Apply commands between steps; False on stop."""
        llm = self._llm
        aborted: list[tuple[_Stream, StreamItem]] = []
        for command in commands:
            if isinstance(command, _Add):
                stream = command.stream
                self._post(self._pending_done)
                try:
                    stream.internal_id = llm.add_request(
                        stream.request_id, {"prompt_token_ids": stream.prompt_token_ids}, command.vllm_params
                    )
                except ValueError as exc:
                    stream.done = True
                    self._streams.pop(stream.request_id, None)
                    aborted.append((stream, RequestError(str(exc))))
                    continue
                self._probe.mark_arrival(stream.internal_id, stream.metrics.arrival_time)
            elif isinstance(command, _Abort):
                found = self._streams.get(command.request_id)
                if found is None or found.done:
                    continue
                llm.abort_request([found.request_id])
                aborted.append((found, self._finish(found, "abort", time.monotonic())))
            elif isinstance(command, _Reset):
                try:
                    result = llm.reset_prefix_cache()  # None in older vLLM, which raises on failure
                    command.done.set_result(True if result is None else bool(result))
                except Exception as exc:  # noqa: BLE001 (handed to the caller)
                    command.done.set_exception(exc)
            elif isinstance(command, _Stop):
                for stream in list(self._streams.values()):
                    if not stream.done:
                        llm.abort_request([stream.request_id])
                        aborted.append((stream, self._finish(stream, "abort", time.monotonic())))
                self._post(self._deliver, aborted)
                return False
        if aborted:
            self._post(self._deliver, aborted)
            # Blocks were freed outside a step: refresh vLLM's own gauges
            # (KV usage, running, waiting), which it records only per step.
            manager = getattr(llm, "logger_manager", None)
            if manager is not None:
                manager.record(scheduler_stats=self._probe.scheduler_stats(), iteration_stats=None)
        return True

    def _finish(self, stream: _Stream, reason: str, now: float) -> RequestOutput:
        """Close a stream's record; the final output carries its metrics."""
        stream.done = True
        self._streams.pop(stream.request_id, None)
        if stream.internal_id is not None:
            self._probe.forget(stream.internal_id)
        m = stream.metrics
        m.finished_time = now
        m.num_output_tokens = stream.num_output_tokens
        for observer in self._observers:
            observer.on_request_finished(stream.request_id, m, reason)
        return RequestOutput(
            request_id=stream.request_id,
            prompt=stream.prompt,
            prompt_token_ids=stream.prompt_token_ids,
            outputs=[CompletionOutput(index=0, text="", token_ids=[], finish_reason=reason)],
            finished=True,
            num_cached_tokens=m.num_cached_tokens,
            metrics=m,
        )

    def _step(self) -> None:
        llm, probe = self._llm, self._probe
        cuda = self.device == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        outputs = llm.step()
        end = time.monotonic()
        schedule = probe.take_schedule(end)

        by_internal = {s.internal_id: s for s in self._streams.values() if s.internal_id is not None}
        if schedule is not None:
            for internal_id in schedule.first_scheduled:
                if (s := by_internal.get(internal_id)) is not None:
                    s.metrics.first_scheduled_time = schedule.start_time
            for internal_id, wait in schedule.chunk_waits_by_request.items():
                if (s := by_internal.get(internal_id)) is not None:
                    s.metrics.prefill_chunk_waits.append(wait)

        batch: list[tuple[_Stream, StreamItem]] = []
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None or stream.done:
                continue
            completion = out.outputs[0]
            new_ids = list(completion.token_ids)
            m = stream.metrics
            if new_ids:
                if m.first_token_time is None:
                    m.first_token_time = end
                m.token_times.extend([end] * len(new_ids))
                stream.num_output_tokens += len(new_ids)
            m.num_cached_tokens = int(out.num_cached_tokens or 0)
            logprobs = None
            if completion.logprobs is not None:
                logprobs = [float(lp[t].logprob) for t, lp in zip(new_ids, completion.logprobs, strict=False)]
            if out.finished:
                vstats = getattr(out, "metrics", None)
                m.num_preemptions = int(getattr(vstats, "num_preemptions", 0) or 0)
                reason = completion.finish_reason or "stop"
                final = self._finish(stream, reason, end)
                final.outputs = [
                    CompletionOutput(0, completion.text, new_ids, logprobs, reason, completion.stop_reason)
                ]
                batch.append((stream, final))
            else:
                batch.append(
                    (
                        stream,
                        RequestOutput(
                            request_id=stream.request_id,
                            prompt=stream.prompt,
                            prompt_token_ids=stream.prompt_token_ids,
                            outputs=[CompletionOutput(0, completion.text, new_ids, logprobs)],
                            finished=False,
                            num_cached_tokens=m.num_cached_tokens,
                        ),
                    )
                )
        if batch:
            self._post(self._deliver, batch)

        if schedule is None or schedule.num_prefill_tokens + schedule.num_decode_tokens == 0:
            return
        occupancy = probe.kv_occupancy()
        kv_held_bytes = occupancy.num_blocks_held * probe.block_bytes
        num_tokens = schedule.num_prefill_tokens + schedule.num_decode_tokens
        if cuda:
            # The allocator sees vLLM's whole preallocated KV pool; count the
            # blocks actually held instead.
            base = -probe.kv_cache_bytes_total + kv_held_bytes
            memory = torch.cuda.memory_allocated() + base
            peak = torch.cuda.max_memory_allocated() + base
        else:
            memory = self._weight_bytes + kv_held_bytes
            peak = memory + transient_activation_bytes(
                num_tokens, schedule.num_scheduled_requests, self._hf_config, self._dtype_bytes
            )
        prefix_cache = probe.last_prefix_cache
        step = StepMetrics(
            start_time=schedule.start_time,
            duration_seconds=end - schedule.start_time,
            num_prefill_tokens=schedule.num_prefill_tokens,
            num_decode_tokens=schedule.num_decode_tokens,
            num_running=schedule.num_scheduled_requests,
            num_waiting=schedule.num_waiting,
            num_blocks_held=occupancy.num_blocks_held,
            num_tokens_stored=occupancy.num_tokens_stored,
            block_size=probe.block_size,
            num_blocks_total=probe.num_blocks_total,
            memory_bytes=int(memory),
            peak_memory_bytes=int(max(peak, memory)),
            num_preemptions=schedule.num_preemptions,
            prefill_chunk_waits=list(schedule.prefill_chunk_waits),
            prefix_cache_queries=prefix_cache.queries,
            prefix_cache_hits=prefix_cache.hits,
            max_prefill_tokens=schedule.max_prefill_tokens,
        )
        for observer in self._observers:
            observer.on_step(step)
