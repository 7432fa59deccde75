"""``AsyncLLM``: the reference engine behind ``workers.engine_api.AsyncEngine``.

Design note. The engine is single-threaded: one background thread owns the
``LLMEngine`` and steps it while there is work, sleeping on a condition
otherwise. The event loop never touches the engine directly; it sends
closures through a command list (add, abort, profile change), which the
thread runs between steps, so a profile change lands between two steps.
After each step the thread posts that step's delta outputs to the loop with
one ``call_soon_threadsafe``; each request reads its own asyncio queue and
merges deltas that piled up while its consumer was busy. A stream that is
closed early (client gone) aborts its request, which frees its blocks.
Validation and tokenization run on the caller's side, so bad input raises
``RequestError`` before anything is queued.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, TypeVar

from workers.engine.config import ModelConfig
from workers.engine.llm_engine import LLMEngine, resolve_profile
from workers.engine.sequence import OutputKind
from workers.engine.tokenizer import Tokenizer
from workers.engine_api import (
    CompletionOutput,
    EngineError,
    EngineLoad,
    EngineObserver,
    RequestError,
    RequestOutput,
    SamplingParams,
)
from workers.profile import EngineProfile

log = logging.getLogger(__name__)
T = TypeVar("T")


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
        **profile_fields: Any,
    ):
        self.model_dir = Path(model)
        config = ModelConfig.from_pretrained(self.model_dir)
        self.max_model_len = min(max_model_len or config.max_position_embeddings, config.max_position_embeddings)
        self.profile = resolve_profile(profile, profile_fields, self.max_model_len)
        self.model_name = served_model_name or self.model_dir.name
        self.tokenizer = Tokenizer(self.model_dir)
        self._engine_kwargs: dict[str, Any] = dict(device=device, dtype=dtype, max_model_len=max_model_len, seed=seed)
        self.engine: LLMEngine | None = None
        self._observers: list[EngineObserver] = []
        self._streams: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._commands: list[Callable[[], None]] = []
        self._wake = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._failure: BaseException | None = None

    # ---- lifecycle ---------------------------------------------------------
    async def start(self) -> None:
        if self.engine is not None:
            return
        self._loop = asyncio.get_running_loop()
        engine = await asyncio.to_thread(
            lambda: LLMEngine(self.model_dir, profile=self.profile, served_model_name=self.model_name, **self._engine_kwargs)
        )
        for observer in self._observers:
            engine.add_observer(observer)
        self.engine = engine
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="reference-engine", daemon=True)
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
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._streams[request_id] = queue
        arrival = time.monotonic()

        def add() -> None:
            try:
                engine.add_request(request_id, None, None, arrival_time=arrival, output_kind=OutputKind.DELTA, checked=checked)
            except RequestError as exc:
                self._post_error(request_id, exc)

        self._submit(add)
        finished = False
        try:
            while True:
                item = await queue.get()
                while not isinstance(item, BaseException) and not item.finished and not queue.empty():
                    nxt = queue.get_nowait()
                    item = nxt if isinstance(nxt, BaseException) else _merge(item, nxt)
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished and self.engine is not None:
                self._submit(lambda: self._abort_quietly(engine, request_id))

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

    def add_observer(self, observer: EngineObserver) -> None:
        self._observers.append(observer)
        if self.engine is not None:
            engine = self.engine
            self._submit(lambda: engine.add_observer(observer))

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
                command()
            if stopping:
                return
            if not engine.has_unfinished_requests():
                continue
            try:
                outputs = engine.step()
            except Exception as exc:  # noqa: BLE001 (every stream must hear of it)
                log.exception("engine step failed")
                self._failure = exc
                for rid in list(engine.requests):
                    engine.abort_request(rid)
                self._post_error(None, EngineError(f"the engine failed: {exc!r}"))
                return
            if outputs:
                self._post(outputs)

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


def _merge(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    """Two consecutive delta outputs of one request as one."""
    x, y = a.outputs[0], b.outputs[0]
    logprobs = None if x.logprobs is None and y.logprobs is None else (x.logprobs or []) + (y.logprobs or [])
    return RequestOutput(
        request_id=b.request_id,
        prompt=b.prompt,
        prompt_token_ids=b.prompt_token_ids,
        outputs=[
            CompletionOutput(
                index=0,
                text=x.text + y.text,
                token_ids=list(x.token_ids) + list(y.token_ids),
                logprobs=logprobs,
                finish_reason=y.finish_reason,
                stop_reason=y.stop_reason,
            )
        ],
        finished=b.finished,
        num_cached_tokens=b.num_cached_tokens,
        metrics=b.metrics,
    )
