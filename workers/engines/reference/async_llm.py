"""``AsyncLLM``: the reference engine behind ``workers.engines.api.AsyncEngine``.

Design note. The engine is single-threaded: one background thread owns the
``LLMEngine`` and steps it while there is work, sleeping on a condition
otherwise. The event loop never touches the engine directly; it sends
closures through a command list (add, abort, profile change), which the
thread runs between steps, so a profile change lands between two steps.
After each step the thread posts that step's delta outputs to the loop with
one ``call_soon_threadsafe``; each request reads its own asyncio queue
through ``workers.engines.stream``, which merges deltas that piled up while
its consumer was busy. A stream that is closed early (client gone) aborts
its request, which frees its blocks.
Validation and tokenization run on the caller's side, so bad input raises
``RequestError`` before anything is queued.

One request's failure never stops the thread: a request whose sampling or
token handling fails ends with ``RequestFailed``, and a step whose forward
pass fails fails that step's batch alone. Only a run of failed steps in a
row (the engine itself is broken) stops it. ``health_error()`` says why the
engine cannot serve (the thread is gone, or a step has run for longer than
``stall_seconds``), which the worker's /health and its agent report.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import gc
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, TypeVar

from workers.engines.api import (
    EngineError,
    EngineLoad,
    EngineObserver,
    MemoryFacts,
    RequestError,
    RequestFailed,
    RequestOutput,
    SamplingParams,
)
from workers.engines.reference.config import ModelConfig
from workers.engines.reference.llm_engine import LLMEngine, StepFailed, resolve_profile
from workers.engines.reference.sequence import OutputKind
from workers.engines.reference.tokenizer import Tokenizer
from workers.engines.stream import StreamItem, deltas
from workers.profile import EngineProfile

log = logging.getLogger(__name__)
T = TypeVar("T")

# Failed steps in a row after which the engine counts as broken, not one batch unlucky.
MAX_CONSECUTIVE_STEP_FAILURES = 3
# A step running longer than this means the engine has stopped stepping.
STALL_SECONDS = 120.0


class AsyncLLM:
    engine_kind = "reference"

    def __init__(
        self,
        model: str | Path,
        *,
        device: str = "cpu",
        dtype: str = "auto",
        served_model_name: str | None = None,
        max_model_len: int | None = None,
        profile: EngineProfile | None = None,
        seed: int = 0,
        stall_seconds: float = STALL_SECONDS,
        fault_stall_marker: str = "",
        **profile_fields: Any,
    ):
        self.model_dir = Path(model)
        self.stall_seconds = stall_seconds
        self.fault_stall_marker = fault_stall_marker
        native = self._native_max_model_len()
        self.max_model_len = min(max_model_len or native, native)
        self.profile = resolve_profile(profile, profile_fields, self.max_model_len)
        self.model_name = served_model_name or self.model_dir.name
        self._tokenizer: Tokenizer | None = None  # loaded off the event loop by start()
        self._engine_kwargs: dict[str, Any] = dict(device=device, dtype=dtype, max_model_len=max_model_len, seed=seed)
        self.engine: LLMEngine | None = None
        self._observers: list[EngineObserver] = []
        self._streams: dict[str, asyncio.Queue[StreamItem]] = {}
        self._commands: list[Callable[[], None]] = []
        self._wake = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._failure: BaseException | None = None
        self._step_started: float | None = None  # monotonic start of the step running now
        self._consecutive_step_failures = 0

    def _native_max_model_len(self) -> int:
        return ModelConfig.from_pretrained(self.model_dir).max_position_embeddings

    def _new_engine(self) -> LLMEngine:
        """Build the engine (off the event loop); the simulated engine builds its own."""
        return LLMEngine(self.model_dir, profile=self.profile, served_model_name=self.model_name, **self._engine_kwargs)

    @property
    def tokenizer(self) -> Tokenizer:
        # Loading imports transformers (seconds, more on a busy machine): the
        # worker's /health must keep answering "loading" meanwhile.
        if self._tokenizer is None:
            self._tokenizer = Tokenizer(self.model_dir)
        return self._tokenizer

    # ---- lifecycle ---------------------------------------------------------
    async def start(self) -> None:
        if self.engine is not None:
            return
        self._loop = asyncio.get_running_loop()
        await asyncio.to_thread(lambda: self.tokenizer)
        engine = await asyncio.to_thread(self._new_engine)
        for observer in self._observers:
            engine.add_observer(observer)
        self.engine = engine
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=f"{self.engine_kind}-engine", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        if self.engine is None:
            return
        engine = self.engine

        def abort_all() -> None:
            outputs = [o for rid in list(engine.requests) if (o := engine.abort_request(rid)) is not None]
            self._post(outputs)

        if self._thread is not None and self._thread.is_alive():
            await self._call(abort_all)
            with self._wake:
                self._stopping = True
                self._wake.notify()
            await asyncio.to_thread(self._thread.join)
        self._thread = None
        self.engine = None
        gc.collect()

    # ---- requests ----------------------------------------------------------
    async def generate(
        self, prompt: str | list[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        engine = self._require_engine()
        checked = engine.check_request(prompt, params)
        if request_id in self._streams:
            raise RequestError(f"request id {request_id!r} is already in use.", "request_id")
        queue: asyncio.Queue[StreamItem] = asyncio.Queue()
        self._streams[request_id] = queue
        arrival = time.monotonic()

        def add() -> None:
            try:
                engine.add_request(
                    request_id, None, None, arrival_time=arrival, output_kind=OutputKind.DELTA, checked=checked
                )
            except RequestError as exc:
                self._post_error(request_id, exc)

        self._submit(add)

        def abandoned() -> None:
            if self.engine is not None:
                self._submit(lambda: self._abort_quietly(engine, request_id))

        stall = bool(self.fault_stall_marker) and self.fault_stall_marker in (
            prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt)
        )
        try:
            async with contextlib.aclosing(deltas(queue, on_abandoned=abandoned)) as outputs:
                async for out in outputs:
                    yield out
                    if stall and not out.finished:
                        # Fault injection: the engine runs on, the stream is
                        # never fed again (until its reader goes away).
                        await asyncio.Event().wait()
        finally:
            self._streams.pop(request_id, None)

    @staticmethod
    def _abort_quietly(engine: LLMEngine, request_id: str) -> None:
        engine.abort_request(request_id)  # nobody is listening for its last output

    async def abort(self, request_id: str) -> None:
        engine = self._require_engine()

        def abort() -> None:
            out = engine.abort_request(request_id)
            if out is not None:
                self._post([out])

        await self._call(abort)

    async def update_profile(self, profile: EngineProfile) -> None:
        """Apply new scheduler knobs between two steps (ProfileError if it cannot)."""
        engine = self._require_engine()
        await self._call(lambda: engine.update_profile(profile))
        self.profile = profile

    async def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache, between two steps."""
        engine = self._require_engine()
        return await self._call(engine.reset_prefix_cache)

    # ---- tokenizer ---------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens)

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt)

    # ---- figures -----------------------------------------------------------
    def load(self) -> EngineLoad:
        if self.engine is None:
            return EngineLoad(0, 0, 0.0)
        return self.engine.load()

    def memory_facts(self) -> MemoryFacts | None:
        return None if self.engine is None else self.engine.memory_facts()

    def add_observer(self, observer: EngineObserver) -> None:
        self._observers.append(observer)
        if self.engine is not None:
            engine = self.engine
            self._submit(lambda: engine.add_observer(observer))

    def health_error(self) -> str | None:
        """Why this engine cannot serve now, or None while it steps."""
        if self._failure is not None:
            return f"the engine failed: {self._failure!r}"
        if self.engine is None:
            return None  # not started (or shut down): the host's own state says so
        if self._thread is None or not self._thread.is_alive():
            return "the engine's step thread is not running."
        started = self._step_started
        if started is not None and time.monotonic() - started > self.stall_seconds:
            return f"the engine has not finished a step for {time.monotonic() - started:.0f} s."
        return None

    # ---- the engine thread -------------------------------------------------
    def _require_engine(self) -> LLMEngine:
        if self._failure is not None:
            raise EngineError(f"the engine failed: {self._failure!r}")
        if self.engine is None:
            raise EngineError("the engine is not started.")
        return self.engine

    def _submit(self, command: Callable[[], None]) -> None:
        with self._wake:
            self._commands.append(command)
            self._wake.notify()

    async def _call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the engine thread between steps and await its result."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()

        def command() -> None:
            try:
                future.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 (handed to the caller)
                future.set_exception(exc)

        self._submit(command)
        return await asyncio.wrap_future(future)

    def _run(self) -> None:
        engine = self.engine
        assert engine is not None
        while True:
            with self._wake:
                while not self._commands and not self._stopping and not engine.has_unfinished_requests():
                    self._wake.wait()
                commands, self._commands = self._commands, []
                stopping = self._stopping
            for command in commands:
                try:
                    command()
                except Exception:
                    log.exception("an engine command failed")
            if stopping:
                return
            if not engine.has_unfinished_requests():
                continue
            self._step_started = time.monotonic()
            fatal: BaseException | None = None
            try:
                outputs = engine.step()
                self._consecutive_step_failures = 0
            except StepFailed as exc:
                log.error("engine step failed; failing its %d requests: %r", len(exc.request_ids), exc.cause)
                outputs = []
                self._consecutive_step_failures += 1
            except Exception as exc:
                log.exception("engine step failed outside the forward pass")
                outputs = []
                fatal = exc
            finally:
                self._step_started = None
            self._post_failures(engine.take_failed_requests())
            if outputs:
                self._post(outputs)
            if fatal is not None or self._consecutive_step_failures >= MAX_CONSECUTIVE_STEP_FAILURES:
                cause = fatal or RuntimeError(f"{self._consecutive_step_failures} engine steps failed in a row")
                self._failure = cause
                for rid in list(engine.requests):
                    with contextlib.suppress(Exception):
                        engine.abort_request(rid)
                self._post_error(None, EngineError(f"the engine failed: {cause!r}"))
                return

    def _post_failures(self, failed: dict[str, str]) -> None:
        for request_id, reason in failed.items():
            self._post_error(request_id, RequestFailed(f"the engine failed this request: {reason}"))

    def _post(self, outputs: list[RequestOutput]) -> None:
        if outputs and self._loop is not None:
            self._loop.call_soon_threadsafe(self._dispatch, outputs)

    def _post_error(self, request_id: str | None, exc: BaseException) -> None:
        def deliver() -> None:
            targets = [request_id] if request_id is not None else list(self._streams)
            for rid in targets:
                queue = self._streams.get(rid)
                if queue is not None:
                    queue.put_nowait(exc)

        if self._loop is not None:
            self._loop.call_soon_threadsafe(deliver)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            queue = self._streams.get(out.request_id)
            if queue is not None:
                queue.put_nowait(out)
