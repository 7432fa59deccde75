"""The engine: requests in, steps run, outputs and metrics out.

``LLMEngine`` is vLLM's shape: ``add_request``, ``step`` (schedule, run the
model once, sample, check stops), ``abort_request``, plus
``update_profile`` for live changes of the scheduler's knobs between steps.
Every step produces a ``StepMetrics`` record and every finished request its
``RequestMetrics``; observers receive both. ``LLM`` wraps it for batch use:
``LLM(model=DIR, **profile_fields).generate(prompts, params)``.
"""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from pathlib import Path
from typing import Any, NamedTuple

import torch

from workers.engines.api import (
    CompletionOutput,
    EngineLoad,
    EngineObserver,
    MemoryFacts,
    RequestError,
    RequestFailed,
    RequestOutput,
    SamplingParams,
    StepMetrics,
)
from workers.engines.reference.block_manager import BlockManager
from workers.engines.reference.config import ModelConfig
from workers.engines.reference.memory import MemoryMeter, StepShape, kv_block_bytes
from workers.engines.reference.model import LlamaForCausalLM
from workers.engines.reference.model_runner import ModelRunner
from workers.engines.reference.sampler import Sampler
from workers.engines.reference.scheduler import ScheduledChunk, Scheduler
from workers.engines.reference.sequence import OutputKind, Sequence, SequenceStatus
from workers.engines.reference.tokenizer import IncrementalDetokenizer, Tokenizer
from workers.profile import EngineProfile, ProfileError, profile_errors

GiB = 1 << 30
MiB = 1 << 20
# Knobs fixed by the KV cache's layout: changing them needs a new engine.
RESTART_FIELDS = ("block_size", "kv_cache_bytes")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class StepFailed(RuntimeError):
    """A step's forward pass failed; ``request_ids`` were its batch, each
    now failed (``take_failed_requests``). The engine is usable again."""

    def __init__(self, request_ids: list[str], cause: BaseException):
        super().__init__(f"the step failed for {len(request_ids)} requests: {cause!r}")
        self.request_ids = request_ids
        self.cause = cause


class CheckedRequest(NamedTuple):
    """A request's input, tokenized and validated (``LLMEngine.check_request``)."""

    prompt: str | None  # the text, when it came as text
    prompt_token_ids: list[int]
    params: SamplingParams


def resolve_profile(profile: EngineProfile | None, fields: dict[str, Any], max_model_len: int) -> EngineProfile:
    """The engine's profile from an explicit one and/or keyword knobs.

    As in vLLM, monolithic mode without an explicit budget gets one that
    holds the longest prompt.
    """
    data = {**(profile.to_dict() if profile else {}), **fields}
    if data.get("prefill_mode") == "monolithic" and "max_num_batched_tokens" not in data:
        data["max_num_batched_tokens"] = max(max_model_len, int(data.get("max_num_seqs", EngineProfile.max_num_seqs)))
    return EngineProfile.from_dict(data, engine_kind="reference", max_model_len=max_model_len)


class LLMEngine:
    engine_kind = "reference"

    def __init__(
        self,
        model: str | Path,
        *,
        device: str = "cpu",
        dtype: str = "auto",
        max_model_len: int | None = None,
        seed: int = 0,
        profile: EngineProfile | None = None,
        served_model_name: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        **profile_fields: Any,
    ):
        self.model_dir = Path(model)
        self.config = ModelConfig.from_pretrained(self.model_dir)
        native = self.config.max_position_embeddings
        if max_model_len is not None and not 0 < max_model_len <= native:
            raise ProfileError({"max_model_len": [f"must be between 1 and the model's {native}; got {max_model_len}."]})
        self.max_model_len = max_model_len or native
        self.profile = resolve_profile(profile, profile_fields, self.max_model_len)
        self.model_name = served_model_name or self.model_dir.name
        self.clock = clock

        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.dtype = self._resolve_dtype(dtype)
        self.tokenizer = Tokenizer(self.model_dir)
        self.eos_token_ids = set(self.config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)

        torch.manual_seed(seed)
        self._rng = random.Random(seed)
        net = LlamaForCausalLM(self.config)
        net.load_checkpoint(self.model_dir)
        self.model = net.to(device=self.device, dtype=self.dtype).eval()
        # RoPE angles stay float32 whatever the weights' type (as in transformers).
        self.model.inv_freq = self.config.rope_inv_freq().to(self.device)

        elem = torch.empty((), dtype=self.dtype).element_size()
        p = self.profile
        self.block_bytes = kv_block_bytes(self.config, p.block_size, elem)
        kv_bytes = p.kv_cache_bytes or self._default_kv_bytes()
        num_blocks = kv_bytes // self.block_bytes
        need = -(-self.max_model_len // p.block_size)
        if num_blocks < need:
            raise ProfileError(
                {
                    "kv_cache_bytes": [
                        f"{kv_bytes} bytes hold {num_blocks} blocks of {p.block_size} tokens; one request of "
                        f"max_model_len ({self.max_model_len}) needs {need} ({need * self.block_bytes} bytes)."
                    ]
                }
            )
        self.blocks = BlockManager(num_blocks, p.block_size, p.enable_prefix_caching)
        self.scheduler = Scheduler(p, self.blocks)
        self.runner = ModelRunner(self.config, self.model, self.device, self.dtype, num_blocks, p.block_size)
        self.sampler = Sampler(frozenset(self.eos_token_ids))
        self.memory = MemoryMeter(
            self.config,
            self.device,
            self.model.num_weight_bytes(),
            self.block_bytes,
            num_blocks * self.block_bytes,
            elem,
        )
        self.requests: dict[str, Sequence] = {}
        self.failed_requests: dict[str, str] = {}  # request id → why it failed (take_failed_requests)
        self.observers: list[EngineObserver] = []
        self.num_steps = 0

    # ---- setup helpers ---------------------------------------------------
    def _resolve_dtype(self, dtype: str) -> torch.dtype:
        if dtype == "auto":
            # Float32 on CPU (exact, and fast enough for small models); the
            # checkpoint's own half type on GPUs.
            if self.device.type == "cpu":
                return torch.float32
            return _DTYPES.get(self.config.torch_dtype, torch.bfloat16)
        if dtype not in _DTYPES:
            raise ProfileError({"dtype": [f"must be auto or one of {', '.join(_DTYPES)}; got {dtype!r}."]})
        return _DTYPES[dtype]

    def _default_kv_bytes(self) -> int:
        per_token = self.block_bytes // self.profile.block_size
        wanted = 4 * self.max_model_len * per_token
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return max(min(int(free * 0.5), max(wanted, 4 * GiB)), self.max_model_len * per_token)
        return min(max(256 * MiB, wanted), 4 * GiB)

    @property
    def num_blocks_total(self) -> int:
        return self.blocks.pool.num_blocks

    # ---- requests --------------------------------------------------------
    def memory_facts(self) -> MemoryFacts:
        return MemoryFacts(self.model.num_weight_bytes(), self.block_bytes // self.profile.block_size)

    def add_observer(self, observer: EngineObserver) -> None:
        self.observers.append(observer)

    def check_request(self, prompt: str | list[int] | dict[str, Any], params: SamplingParams | None) -> CheckedRequest:
        """Tokenize and validate; raises RequestError naming the problem."""
        params = params if params is not None else SamplingParams()
        params.validate()
        if params.logprobs is not None and params.logprobs < 0:
            raise RequestError(f"logprobs must be non-negative; got {params.logprobs}.", "logprobs")
        if any(not isinstance(s, str) or not s for s in params.stop):
            raise RequestError("stop strings must be non-empty strings.", "stop")
        if isinstance(prompt, dict):  # vLLM's TokensPrompt / TextPrompt
            prompt = prompt.get("prompt_token_ids", prompt.get("prompt")) or ""
        text: str | None
        if isinstance(prompt, str):
            text = prompt
            ids = self.tokenizer.encode(prompt) if prompt else []
        else:
            text = None
            ids = [int(t) for t in prompt]
        if not ids:
            raise RequestError("the prompt is empty.", "prompt")
        if len(ids) > self.max_model_len:
            raise RequestError(
                f"the prompt is {len(ids)} tokens, longer than the model's max length of {self.max_model_len}.",
                "prompt",
            )
        vocab = self.config.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestError(f"the prompt holds token id {bad}, outside the vocabulary (0..{vocab - 1}).", "prompt")
        bad = next((t for t in params.logit_bias if t >= vocab), None)
        if bad is not None:
            raise RequestError(
                f"logit_bias names token id {bad}, outside the vocabulary (0..{vocab - 1}).", "logit_bias"
            )
        return CheckedRequest(text, ids, params)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int] | dict[str, Any] | None,
        params: SamplingParams | None = None,
        *,
        arrival_time: float | None = None,
        output_kind: OutputKind = OutputKind.CUMULATIVE,
        checked: CheckedRequest | None = None,
    ) -> Sequence:
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use.", "request_id")
        if checked is None:
            if prompt is None:
                raise RequestError("the prompt is empty.", "prompt")
            checked = self.check_request(prompt, params)
        text, ids, params = checked
        limit = (
            self.max_model_len if params.max_tokens is None else min(self.max_model_len, len(ids) + params.max_tokens)
        )
        seq = Sequence(
            request_id,
            text,
            ids,
            params,
            arrival_time=self.clock() if arrival_time is None else arrival_time,
            max_total_tokens=max(limit, len(ids) + 1),
            output_kind=output_kind,
        )
        if output_kind != OutputKind.FINAL_ONLY or params.stop:
            seq.detokenizer = IncrementalDetokenizer(self.tokenizer, len(ids))
        if params.temperature > 0 and params.top_k != 1:
            gen_device = self.device if self.device.type == "cuda" else torch.device("cpu")
            seq.generator = torch.Generator(device=gen_device)
            seq.generator.manual_seed(params.seed if params.seed is not None else self._rng.getrandbits(63))
        self.requests[request_id] = seq
        self.scheduler.add(seq)
        return seq

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request and free its blocks; its last output, or None if unknown."""
        seq = self.requests.get(request_id)
        if seq is None:
            return None
        self._finish(seq, SequenceStatus.FINISHED_ABORTED, self.clock())
        return self._make_output(seq)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block (an experiment starts each arm
        cold). Blocks in use stay with their requests, private from now on."""
        self.blocks.pool.reset_prefix_cache()
        return True

    def update_profile(self, profile: EngineProfile) -> None:
        """Apply new scheduler knobs from the next step on."""
        errors = profile_errors(profile.to_dict(), engine_kind="reference", max_model_len=self.max_model_len)
        for name in RESTART_FIELDS:
            if getattr(profile, name) != getattr(self.profile, name):
                errors.setdefault(name, []).append("is fixed by the KV cache's layout; changing it needs a restart.")
        if errors:
            raise ProfileError(errors)
        if profile.enable_prefix_caching != self.blocks.enable_prefix_caching:
            self.blocks.enable_prefix_caching = profile.enable_prefix_caching
            if not profile.enable_prefix_caching:
                self.blocks.pool.reset_prefix_cache()
        self.profile = profile
        self.scheduler.profile = profile

    def load(self) -> EngineLoad:
        pool = self.blocks.pool
        return EngineLoad(
            num_requests_running=len(self.scheduler.running),
            num_requests_waiting=len(self.scheduler.waiting),
            kv_cache_usage_perc=pool.num_used / pool.num_blocks,
        )

    @torch.inference_mode()
    def score(self, token_ids: list[int], chunk_size: int | None = None) -> torch.Tensor:
        """Teacher-forced logits [len, vocab] (float32) of every position of
        ``token_ids``, computed through the paged cache in chunks of
        ``chunk_size`` tokens (whole when None), as prefill would. For tests and
        tools; call between steps."""
        ids = self.check_request(list(token_ids), SamplingParams(max_tokens=1)).prompt_token_ids
        seq = Sequence("score", None, ids, SamplingParams(max_tokens=1), self.clock(), len(ids) + 1)
        step = chunk_size or len(ids)
        if self.blocks.blocks_needed(seq, len(ids)) > self.blocks.num_free_blocks:
            raise RequestError("not enough free KV blocks to score this sequence now.", "prompt")
        parts = []
        try:
            for start in range(0, len(ids), step):
                n = min(step, len(ids) - start)
                self.blocks.grow(seq, start + n)
                logits, _, _ = self.runner.run([ScheduledChunk(seq, start, n, False)], all_logits=True)
                parts.append(logits)
                seq.num_computed_tokens = start + n
        finally:
            self.blocks.free(seq)
        return torch.cat(parts)

    # ---- one step ----------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        if not self.scheduler.has_unfinished():
            return []
        start = self.clock()
        self.memory.begin_step()
        sched = self.scheduler.schedule(start)
        if not sched.chunks:
            return []
        blocks_during = self.blocks.pool.num_used
        seqs, tokens, logprobs, failures, shape = self._execute(sched.chunks)
        end = self.clock()
        self.scheduler.complete(sched, end)
        self.num_steps += 1

        progressed: list[Sequence] = []
        for i, seq in enumerate(seqs):
            if i in failures:
                self._fail(seq, str(failures[i]), end)
                continue
            try:
                self._append_token(seq, tokens[i], None if logprobs is None else logprobs[i], end)
            except Exception as exc:  # noqa: BLE001 — this request fails, the batch goes on
                self._fail(seq, f"processing its token failed: {exc!r}", end)
                continue
            progressed.append(seq)

        memory = self.memory.end_step(shape, blocks_during, self.blocks.pool.num_used)
        step = StepMetrics(
            start_time=start,
            duration_seconds=end - start,
            num_prefill_tokens=sched.num_prefill_tokens,
            num_decode_tokens=sched.num_decode_tokens,
            num_running=len(sched.chunks),
            num_waiting=len(self.scheduler.waiting),
            num_blocks_held=self.scheduler.num_blocks_held(),
            num_tokens_stored=self.scheduler.num_tokens_stored(),
            block_size=self.profile.block_size,
            num_blocks_total=self.num_blocks_total,
            memory_bytes=memory.memory_bytes,
            peak_memory_bytes=memory.peak_memory_bytes,
            num_preemptions=sched.num_preemptions,
            prefill_chunk_waits=sched.prefill_chunk_waits,
            prefix_cache_queries=sched.prefix_cache_queries,
            prefix_cache_hits=sched.prefix_cache_hits,
            max_prefill_tokens=max(
                (c.seq.num_tokens - c.seq.metrics.num_cached_tokens for c in sched.chunks if not c.is_decode),
                default=0,
            ),
        )
        for observer in self.observers:
            observer.on_step(step)

        outputs = []
        for seq in progressed:
            if seq.output_kind == OutputKind.FINAL_ONLY and not seq.status.is_finished:
                continue
            outputs.append(self._make_output(seq))
        return outputs

    def _execute(self, chunks: list[ScheduledChunk]) -> tuple[list[Sequence], Any, Any, dict[int, Any], StepShape]:
        """Run the model once over the step's chunks and sample: the sequences
        that sampled, their tokens, logprobs (or None), failures by index, and
        the step's shape. The simulated engine replaces only this."""
        with self.runner.thread_policy.step():
            try:
                logits, sampling, shape = self.runner.run(chunks)
            except Exception as exc:
                # The forward pass failed for the batch as a whole: every request
                # in it fails (which one caused it cannot be told), their blocks
                # are freed, and the engine steps on with the others.
                failed = [c.seq for c in chunks]
                for seq in failed:
                    self._fail(seq, f"the engine's forward pass failed: {exc!r}", self.clock())
                raise StepFailed([s.request_id for s in failed], exc) from exc
            seqs = [c.seq for c in sampling]
            tokens, logprobs, failures = self.sampler(logits, seqs)
        return seqs, tokens, logprobs, failures, shape

    def _append_token(self, seq: Sequence, token: int, logprob: float | None, now: float) -> None:
        seq.token_ids.append(token)
        m = seq.metrics
        if m.first_token_time is None:
            m.first_token_time = now
        m.token_times.append(now)
        m.num_output_tokens += 1
        if seq.logprobs is not None and logprob is not None:
            seq.logprobs.append(logprob)
        p = seq.params
        # Before min_tokens the sampler never picks a stop token; stop strings wait too (vLLM's rule).
        may_stop = seq.num_output_tokens > p.min_tokens
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
            seq.stop_reason = token if token in p.stop_token_ids else None
            self._finish(seq, SequenceStatus.FINISHED_STOPPED, now, drop_last_token_text=True)
            return
        if seq.detokenizer is not None:
            delta = seq.detokenizer.step(seq.token_ids)
            if delta:
                seq.output_text += delta
                if p.stop and may_stop and self._check_stop_strings(seq, len(delta)):
                    self._finish(seq, SequenceStatus.FINISHED_STOPPED, now)
                    return
        if seq.num_tokens >= seq.max_total_tokens:
            self._finish(seq, SequenceStatus.FINISHED_LENGTH, now)

    @staticmethod
    def _check_stop_strings(seq: Sequence, delta_len: int) -> bool:
        text = seq.output_text
        for stop in seq.params.stop:
            # Only a match that ends in the new text is new.
            at = text.find(stop, max(0, len(text) - delta_len - len(stop) + 1))
            if at >= 0:
                end = at + len(stop) if seq.params.include_stop_str_in_output else at
                seq.output_text = text[:end]
                seq.stop_reason = stop
                return True
        return False

    def _fail(self, seq: Sequence, reason: str, now: float) -> None:
        """End one request with an error: its blocks are freed, and the
        reason waits in ``failed_requests`` for whoever streams it."""
        if seq.request_id in self.requests:
            self._finish(seq, SequenceStatus.FINISHED_ABORTED, now)
        self.failed_requests[seq.request_id] = reason

    def take_failed_requests(self) -> dict[str, str]:
        """The requests that failed since the last call: request id → reason."""
        failed, self.failed_requests = self.failed_requests, {}
        return failed

    def _finish(self, seq: Sequence, status: SequenceStatus, now: float, drop_last_token_text: bool = False) -> None:
        if seq.detokenizer is None and seq.output_kind == OutputKind.FINAL_ONLY:
            ids = seq.output_token_ids[:-1] if drop_last_token_text else seq.output_token_ids
            seq.output_text = self.tokenizer.decode(ids)
        self.scheduler.finish(seq, status)
        seq.metrics.finished_time = now
        self.requests.pop(seq.request_id, None)
        for observer in self.observers:
            observer.on_request_finished(seq.request_id, seq.metrics, seq.finish_reason or "abort")

    def _make_output(self, seq: Sequence) -> RequestOutput:
        finished = seq.status.is_finished
        if seq.output_kind == OutputKind.DELTA:
            ids = seq.token_ids[seq.num_prompt_tokens + seq.num_emitted_tokens :]
            logprobs = None if seq.logprobs is None else seq.logprobs[seq.num_emitted_tokens :]
            visible = len(seq.output_text)
            if seq.params.stop and not finished:
                # Hold back text that may turn out to start a stop string.
                visible = max(seq.num_emitted_chars, visible - (max(map(len, seq.params.stop)) - 1))
            text = seq.output_text[seq.num_emitted_chars : visible]
            seq.num_emitted_tokens += len(ids)
            seq.num_emitted_chars = visible
        else:
            ids = seq.output_token_ids
            logprobs = None if seq.logprobs is None else list(seq.logprobs)
            text = seq.output_text
        return RequestOutput(
            request_id=seq.request_id,
            prompt=seq.prompt,
            prompt_token_ids=seq.token_ids[: seq.num_prompt_tokens],
            outputs=[
                CompletionOutput(
                    index=0,
                    text=text,
                    token_ids=ids,
                    logprobs=logprobs,
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                )
            ],
            finished=finished,
            num_cached_tokens=seq.metrics.num_cached_tokens,
            metrics=seq.metrics if finished else None,
        )


class LLM:
    """Batch generation, as vLLM's ``LLM``."""

    def __init__(self, model: str | Path, **kwargs: Any):
        self.llm_engine = LLMEngine(model, **kwargs)
        self._counter = itertools.count()

    def get_tokenizer(self) -> Tokenizer:
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: str | list[int] | Seq[str | list[int] | dict[str, Any]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError("sampling_params: one per prompt, or one for all.")
        engine = self.llm_engine
        checked = [engine.check_request(p, sp) for p, sp in zip(prompts, params_list, strict=True)]  # all or nothing
        ids = [f"generate-{next(self._counter)}" for _ in prompts]
        for request_id, c in zip(ids, checked, strict=True):
            engine.add_request(request_id, None, None, output_kind=OutputKind.FINAL_ONLY, checked=c)
        done: dict[str, RequestOutput] = {}
        try:
            while len(done) < len(ids):
                try:
                    outputs = engine.step()
                except StepFailed:
                    outputs = []
                failed = engine.take_failed_requests()
                if failed:
                    request_id, reason = next(iter(failed.items()))
                    raise RequestFailed(f"request {ids.index(request_id)} failed: {reason}")
                for out in outputs:
                    if out.finished:
                        done[out.request_id] = out
        finally:
            for request_id in ids:
                if request_id not in done:
                    engine.abort_request(request_id)
        return [done[i] for i in ids]
