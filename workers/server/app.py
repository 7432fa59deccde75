"""The worker's HTTP face: OpenAI's API, /health and /metrics (Starlette).

Each completion request is parsed (``protocol``), admitted by the host
(bounded; 429 or 503 before the first byte), tokenized and checked against
the model's context, then run on the engine the host admitted it to. The
first output is awaited before the response starts, so a request the engine
rejects gets a 400 and one aborted before its first token (the engine is
shutting down) a retryable 503, never a 200 that breaks off. A client that
goes away aborts its request in the engine, which frees its KV blocks: while
streaming through the response's disconnect listener, before that through
``_until_disconnect``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Lifespan, Receive, Scope, Send

from workers.engines.api import (
    AsyncEngine,
    EngineError,
    RequestError,
    RequestFailed,
    RequestMetrics,
    RequestOutput,
)
from workers.openai_error import ApiError, bad
from workers.server import protocol as p
from workers.server.facts import EXTENSION_KEY, request_facts
from workers.server.host import READY, EngineHost, NeverFits, QueueFull, Ticket, Unavailable
from workers.server.metrics import CONTENT_TYPE, MetricsExporter

log = logging.getLogger(__name__)

RETRY_AFTER_SECONDS = 1
# Tokenize long prompts off the event loop, so that one 30K-token prompt does
# not hold up every other stream's next chunk.
THREAD_TOKENIZE_CHARS = 16_000
# Parse large bodies off the event loop too (JSON decoding holds the loop).
THREAD_PARSE_BYTES = 1 << 20
# A request body larger than this is refused (413) while it is read, or at
# once when its Content-Length says so: a prompt cannot be longer than the
# context anyway, and reading and tokenizing 20 MB held /health up for seconds.
DEFAULT_MAX_REQUEST_BYTES = 8 << 20


def max_request_bytes_for(max_model_len: int | None) -> int:
    """The default body limit: room for a full context of text (a token is
    rarely more than 16 bytes of text or of JSON digits), at least 8 MiB."""
    return max(DEFAULT_MAX_REQUEST_BYTES, 64 * (max_model_len or 0))


def too_large(limit: int) -> ApiError:
    return ApiError(
        f"The request body is larger than this worker takes ({limit} bytes).",
        status=413,
        type="invalid_request_error",
        code="request_too_large",
    )


async def read_body(request: Request, limit: int) -> bytes:
    """The body, read as it streams in and refused as soon as it passes ``limit``."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large(limit)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise too_large(limit)
    return bytes(body)


MAX_REQUEST_START_AGE_SECONDS = 600.0


def request_start(header: str | None, now_monotonic: float, now_wall: float) -> float:
    """When the request began, on the monotonic clock: the ``X-Request-Start``
    a proxy set (``t=<unix seconds>``, as nginx's ``t=${msec}``) when it took
    the request, else now. Before the worker's event loop reads a request it
    may wait in the socket while the loop is busy (a 128-token prompt's TTFT
    read 0.46x the client's at P99); the proxy's stamp covers that wait. A
    stamp from the future or older than ten minutes (clocks apart) is ignored."""
    if header:
        try:
            age = now_wall - float(header.strip().removeprefix("t="))
        except ValueError:
            return now_monotonic
        if 0.0 <= age <= MAX_REQUEST_START_AGE_SECONDS:
            return now_monotonic - age
    return now_monotonic


def error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def unavailable(state: str) -> ApiError:
    return ApiError(
        f"The worker is {state} and is not admitting requests; retry shortly or on another worker.",
        status=503,
        type="service_unavailable",
        code=f"worker_{state}",
        headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
    )


class EventStreamResponse(StreamingResponse):
    """SSE whose event generator is always closed when the response ends:
    on a client disconnect Starlette cancels the send loop, which may leave
    the generator suspended at a ``yield``; closing it runs its ``finally``,
    which aborts the engine request and frees its blocks."""

    def __init__(self, events: AsyncIterator[bytes]):
        super().__init__(
            events,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with contextlib.aclosing(self.body_iterator):
            await super().__call__(scope, receive, send)


async def _until_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def _cancel_on_disconnect(request: Request, work: Awaitable[Response]) -> Response:
    """Run ``work``; if the client disconnects first, cancel it (its
    ``finally`` aborts the engine requests). vLLM's ``with_cancellation``."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_until_disconnect(request.receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return Response(status_code=499)  # nobody is listening


@dataclasses.dataclass
class _Run:
    """One prompt of a request on the engine."""

    index: int
    request_id: str
    prompt_text: str | None
    prompt_token_ids: list[int]
    stream: AsyncIterator[RequestOutput]
    first: RequestOutput | None = None
    finished: bool = False
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    finish_reason: str | None = None  # the final output's, kept for a non-streaming reply
    stop_reason: int | str | None = None
    metrics: RequestMetrics | None = None  # the final output's: the engine's record of the request
    received_at: float | None = None  # time.monotonic() when the server began reading the request
    # Streaming: each SSE event that carried tokens, (time.monotonic() when
    # written, its tokens), and the tokens received but not yet written (a
    # split character waits for the next event): the client's view.
    writes: list[tuple[float, int]] = dataclasses.field(default_factory=list)
    unwritten: int = 0

    def wrote(self) -> None:
        """Stamp the event about to be written with the tokens it carries."""
        if self.unwritten:
            self.writes.append((time.monotonic(), self.unwritten))
            self.unwritten = 0


class OpenAIServer:
    def __init__(
        self,
        host: EngineHost,
        exporter: MetricsExporter,
        *,
        model_name: str,
        model_aliases: tuple[str, ...] = (),
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    ):
        self.host = host
        self.exporter = exporter
        self.model_name = model_name
        self.served = (model_name, *model_aliases)
        self.max_request_bytes = max_request_bytes

    # ---- small endpoints ---------------------------------------------------------
    async def health(self, request: Request) -> Response:
        self.host.check_health()
        body = self.host.describe()
        return JSONResponse(body, status_code=200 if self.host.state == READY else 503)

    async def models(self, request: Request) -> Response:
        engine = self.host.engine
        card = {
            "id": self.model_name,
            "object": "model",
            "created": p.now_seconds(),
            "owned_by": "chunkpilot",
            "root": self.served[-1],
            "parent": None,
            "max_model_len": engine.max_model_len if engine is not None else None,
        }
        return JSONResponse({"object": "list", "data": [card]})

    async def metrics(self, request: Request) -> Response:
        names = request.query_params.getlist("name[]")
        # A whole page takes ~10 ms to render on the tiny model: off the event
        # loop, so that the tokens streaming meanwhile are not held up by it.
        body = self.exporter.render(names) if names else await asyncio.to_thread(self.exporter.render)
        return Response(body, media_type=CONTENT_TYPE)

    # ---- completions ---------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        return await self._serve(request, "completion")

    async def chat_completions(self, request: Request) -> Response:
        return await self._serve(request, "chat")

    async def _serve(self, request: Request, kind: str) -> Response:
        # TTFT counts from here, as the client's does: reading, parsing and
        # tokenizing on a busy worker come before the engine's arrival time;
        # from the gateway's X-Request-Start when it sent one.
        received_at = request_start(request.headers.get("x-request-start"), time.monotonic(), time.time())
        try:
            raw = await read_body(request, self.max_request_bytes)
            parse = p.parse_completion if kind == "completion" else p.parse_chat

            def parsed() -> p.CompletionRequest:
                data = p.parse_json(raw)
                p.check_model(data, self.served)
                return parse(data)

            req = await asyncio.to_thread(parsed) if len(raw) > THREAD_PARSE_BYTES else parsed()
        except ApiError as exc:
            return error_response(exc)
        except ClientDisconnect:  # an ordinary event, not a fault: one line, no traceback
            log.info("%s: the client went away before its request was read", request.url.path)
            return Response(status_code=499)
        prefix = "cmpl" if kind == "completion" else "chatcmpl"
        response_id = f"{prefix}-{uuid.uuid4().hex}"
        num_prompts = max(1, len(req.prompts))
        request_ids = [f"{response_id}-{i}" for i in range(num_prompts)]
        try:
            ticket = self.host.admit(request_ids)
        except Unavailable as exc:
            return error_response(unavailable(exc.state))
        except NeverFits as exc:
            return error_response(
                bad(
                    f"{num_prompts} prompts in one request; this worker holds at most {exc.capacity} at once.",
                    param="prompt",
                    code="too_many_prompts",
                )
            )
        except QueueFull as exc:
            return error_response(
                ApiError(
                    f"The worker's queue is full ({exc}); retry after a moment.",
                    status=429,
                    type="rate_limit_error",
                    code="queue_full",
                    headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
                )
            )
        return await _cancel_on_disconnect(request, self._run(ticket, req, response_id, request_ids, received_at))

    async def _run(
        self, ticket: Ticket, req: p.CompletionRequest, response_id: str, request_ids: list[str], received_at: float
    ) -> Response:
        engine = ticket.engine
        runs: list[_Run] = []
        handed_over = False
        try:
            runs = await self._start_runs(engine, req, request_ids, received_at)
            if req.stream:
                handed_over = True
                return EventStreamResponse(self._events(ticket, engine, req, response_id, runs))
            return JSONResponse(await self._collect(engine, req, response_id, runs))
        except ApiError as exc:
            return error_response(exc)
        finally:
            if not handed_over:
                try:
                    await self._close(engine, runs)
                finally:
                    ticket.release()

    async def _start_runs(
        self, engine: AsyncEngine, req: p.CompletionRequest, request_ids: list[str], received_at: float
    ) -> list[_Run]:
        """Tokenize, check the context, submit, and await each first output."""
        prompts: list[str | list[int]]
        if req.kind == "chat":
            render = functools.partial(
                engine.apply_chat_template, req.messages, add_generation_prompt=req.add_generation_prompt
            )
            try:
                long = sum(len(m["content"]) for m in req.messages) > THREAD_TOKENIZE_CHARS
                prompts = [await asyncio.to_thread(render) if long else render()]
            except RequestError as exc:
                raise bad(str(exc), param=exc.field or "messages") from exc
        else:
            prompts = req.prompts
        runs: list[_Run] = []
        try:
            for index, (prompt, request_id) in enumerate(zip(prompts, request_ids, strict=True)):
                if isinstance(prompt, str):
                    # A chat template writes the model's BOS itself; adding
                    # special tokens again would double it (so vLLM's server).
                    add_special = req.kind != "chat"
                    if len(prompt) > THREAD_TOKENIZE_CHARS:
                        token_ids = await asyncio.to_thread(engine.encode, prompt, add_special)
                    else:
                        token_ids = engine.encode(prompt, add_special)
                else:
                    token_ids = prompt
                if not token_ids:
                    raise bad("`prompt` must not be empty.", param="prompt")
                error = p.context_error(engine.max_model_len, len(token_ids), req.params.max_tokens, req.kind)
                if error is not None:
                    raise error
                params = dataclasses.replace(req.params, stop=list(req.params.stop))
                stream = engine.generate(token_ids, params, request_id)
                runs.append(
                    _Run(
                        index,
                        request_id,
                        prompt if isinstance(prompt, str) else None,
                        list(token_ids),
                        stream,
                        received_at=received_at,
                    )
                )
            for run in runs:
                run.first = await self._first(run)
        except BaseException:
            await self._close(engine, runs)
            raise
        return runs

    async def _first(self, run: _Run) -> RequestOutput:
        try:
            first = await anext(run.stream)
        except RequestError as exc:
            raise bad(str(exc), param=exc.field) from exc
        except StopAsyncIteration as exc:
            raise ApiError("the engine ended the request without output.", status=500, type="server_error") from exc
        except RequestFailed as exc:
            # This request broke in the engine, which serves on: not worth a retry elsewhere.
            raise ApiError(str(exc), status=500, type="server_error", code="request_failed") from exc
        except EngineError as exc:
            raise ApiError(
                f"The engine failed: {exc}",
                status=503,
                type="service_unavailable",
                code="engine_error",
                headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
            ) from exc
        completion = first.outputs[0]
        if first.finished and completion.finish_reason == "abort" and not completion.token_ids:
            run.finished = True
            # Aborted before its first token (drain deadline, shutdown): the
            # client has seen nothing, so this is safe to retry.
            raise unavailable("draining")
        return first

    async def _close(self, engine: AsyncEngine, runs: list[_Run]) -> None:
        """End each run's engine stream and abort what is unfinished. Shielded:
        on a client disconnect Starlette cancels the response's cancel scope,
        and anyio would cancel every await in here again, leaving the request
        running in the engine and its blocks held."""
        with anyio.CancelScope(shield=True):
            for run in runs:
                aclose = getattr(run.stream, "aclose", None)
                with contextlib.suppress(Exception):
                    if aclose is not None:
                        await aclose()
                    if not run.finished:
                        await engine.abort(run.request_id)

    async def _outputs(self, runs: list[_Run]) -> AsyncGenerator[tuple[_Run, RequestOutput], None]:
        """Every output of every run, first outputs first; runs interleave."""
        for run in runs:
            assert run.first is not None
            yield run, run.first
        live = [r for r in runs if not r.first.finished]  # type: ignore[union-attr]
        if len(live) == 1:
            run = live[0]
            async for out in run.stream:
                yield run, out
            return
        queue: asyncio.Queue[tuple[_Run, RequestOutput | BaseException | None]] = asyncio.Queue()

        async def pump(run: _Run) -> None:
            try:
                async for out in run.stream:
                    await queue.put((run, out))
            except BaseException as exc:  # noqa: BLE001 — handed to the consumer
                await queue.put((run, exc))
                return
            await queue.put((run, None))

        tasks = [asyncio.ensure_future(pump(r)) for r in live]
        try:
            remaining = len(tasks)
            while remaining:
                run, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield run, item
        finally:
            for task in tasks:
                task.cancel()

    def _token_strings(self, engine: AsyncEngine, token_ids: list[int]) -> list[str]:
        return [engine.decode([t]) for t in token_ids]

    def _logprobs(self, engine: AsyncEngine, req: p.CompletionRequest, out: RequestOutput, offset: int) -> Any:
        completion = out.outputs[0]
        if not req.logprobs or completion.logprobs is None:
            return None
        tokens = self._token_strings(engine, list(completion.token_ids))
        if req.kind == "chat":
            return p.chat_logprobs(tokens, list(completion.logprobs))
        return p.completion_logprobs(tokens, list(completion.logprobs), offset)

    async def _collect(
        self, engine: AsyncEngine, req: p.CompletionRequest, response_id: str, runs: list[_Run]
    ) -> dict[str, Any]:
        texts = {r.index: [] for r in runs}  # type: dict[int, list[str]]
        token_ids: dict[int, list[int]] = {r.index: [] for r in runs}
        logprobs: dict[int, list[Any]] = {r.index: [] for r in runs}
        try:
            async with contextlib.aclosing(self._outputs(runs)) as outputs:
                async for run, out in outputs:
                    completion = out.outputs[0]
                    texts[run.index].append(completion.text)
                    token_ids[run.index].extend(completion.token_ids)
                    run.num_output_tokens += len(completion.token_ids)
                    lp = self._logprobs(engine, req, out, 0)
                    if lp is not None:
                        logprobs[run.index].append(lp)
                    if out.finished:
                        run.finished = True
                        run.num_cached_tokens = out.num_cached_tokens
                        run.metrics = out.metrics
                        run.finish_reason, run.stop_reason = completion.finish_reason, completion.stop_reason
        except EngineError as exc:
            raise ApiError(f"The engine failed: {exc}", status=500, type="server_error") from exc
        for run in runs:
            if run.metrics is not None:  # a whole reply: the client gets every token at once
                self.exporter.observe_delivered(run.metrics, None, received_at=run.received_at)
        choices = []
        for run in runs:
            text = "".join(texts[run.index])
            reason, stop_reason = run.finish_reason, run.stop_reason
            if req.kind == "chat":
                choice: dict[str, Any] = {
                    "index": run.index,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": _merge_logprobs(logprobs[run.index], "chat"),
                    "finish_reason": reason,
                    "stop_reason": stop_reason,
                }
            else:
                if req.echo:
                    text = (
                        run.prompt_text if run.prompt_text is not None else engine.decode(run.prompt_token_ids)
                    ) + text
                choice = {
                    "index": run.index,
                    "text": text,
                    "logprobs": _merge_logprobs(logprobs[run.index], "completion"),
                    "finish_reason": reason,
                    "stop_reason": stop_reason,
                }
            if req.return_token_ids:
                # vLLM's extension: exact ids, for comparing outputs token for token.
                choice["prompt_token_ids"] = list(run.prompt_token_ids)
                choice["token_ids"] = token_ids[run.index]
            choices.append(choice)
        return {
            "id": response_id,
            "object": "chat.completion" if req.kind == "chat" else "text_completion",
            "created": p.now_seconds(),
            "model": self.model_name,
            "choices": choices,
            "usage": p.usage(
                sum(len(r.prompt_token_ids) for r in runs),
                sum(r.num_output_tokens for r in runs),
                sum(r.num_cached_tokens for r in runs),
            ),
            EXTENSION_KEY: self._facts(engine, runs),
        }

    def _facts(self, engine: AsyncEngine, runs: list[_Run]) -> dict[str, Any]:
        """What the engine knows of the request, for the gateway's log (``facts``)."""
        running = self.host.running
        return request_facts(
            runs[0].metrics if runs else None,
            engine_kind=engine.engine_kind,
            prefill_mode=engine.profile.prefill_mode,
            profile_name=running.name,
            profile_revision=running.revision,
            profile_revision_id=running.revision_id,
            num_prompts=len(runs),
        )

    async def _events(
        self, ticket: Ticket, engine: AsyncEngine, req: p.CompletionRequest, response_id: str, runs: list[_Run]
    ) -> AsyncIterator[bytes]:
        chat = req.kind == "chat"
        created = p.now_seconds()
        base: dict[str, Any] = {
            "id": response_id,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created,
            "model": self.model_name,
        }
        if req.include_usage:
            base["usage"] = None
        offsets = {r.index: 0 for r in runs}
        envelope = json.dumps({**base, "choices": None}, separators=(",", ":"), ensure_ascii=False)
        envelope_head, _, envelope_tail = envelope.partition('"choices":null')
        text_key = '"delta":{"content":' if chat else '"text":'
        fast_head = {r.index: f'data: {envelope_head}"choices":[{{"index":{r.index},{text_key}'.encode() for r in runs}
        fast_tail = (
            "}" if chat else ""
        ).encode() + f',"logprobs":null,"finish_reason":null}}]{envelope_tail}\n\n'.encode()
        try:
            if chat:
                yield p.sse(
                    {
                        **base,
                        "choices": [
                            {
                                "index": 0,
                                "delta": {"role": "assistant", "content": ""},
                                "logprobs": None,
                                "finish_reason": None,
                            }
                        ],
                    }
                )
            elif req.echo:
                for run in runs:
                    text = run.prompt_text if run.prompt_text is not None else engine.decode(run.prompt_token_ids)
                    offsets[run.index] = len(text)
                    yield p.sse(
                        {
                            **base,
                            "choices": [{"index": run.index, "text": text, "logprobs": None, "finish_reason": None}],
                        }
                    )
            async with contextlib.aclosing(self._outputs(runs)) as outputs:
                async for run, out in outputs:
                    completion = out.outputs[0]
                    run.num_output_tokens += len(completion.token_ids)
                    run.unwritten += len(completion.token_ids)
                    if out.finished:
                        run.finished = True
                        run.num_cached_tokens = out.num_cached_tokens
                        run.metrics = out.metrics
                    elif not completion.text:
                        continue  # tokens that do not yet decode to text (a split character)
                    lp = self._logprobs(engine, req, out, offsets[run.index])
                    offsets[run.index] += len(completion.text)
                    if not out.finished and lp is None:
                        # The hot path, once per token or so: a prebuilt frame
                        # around the JSON-escaped text, no dict to build or encode.
                        run.wrote()
                        yield (
                            fast_head[run.index] + json.dumps(completion.text, ensure_ascii=False).encode() + fast_tail
                        )
                        continue
                    if chat:
                        choice: dict[str, Any] = {
                            "index": run.index,
                            "delta": {"content": completion.text} if completion.text else {},
                            "logprobs": lp,
                            "finish_reason": completion.finish_reason if out.finished else None,
                        }
                    else:
                        choice = {
                            "index": run.index,
                            "text": completion.text,
                            "logprobs": lp,
                            "finish_reason": completion.finish_reason if out.finished else None,
                        }
                    if out.finished:
                        choice["stop_reason"] = completion.stop_reason
                    run.wrote()
                    yield p.sse({**base, "choices": [choice]})
            for run in runs:  # every stream ended: the figures as the client saw them
                if run.metrics is not None:
                    self.exporter.observe_delivered(run.metrics, run.writes, received_at=run.received_at)
            if req.include_usage:
                yield p.sse(
                    {
                        **base,
                        "choices": [],
                        "usage": p.usage(
                            sum(len(r.prompt_token_ids) for r in runs),
                            sum(r.num_output_tokens for r in runs),
                            sum(r.num_cached_tokens for r in runs),
                        ),
                        EXTENSION_KEY: self._facts(engine, runs),
                    }
                )
        except EngineError as exc:
            error = ApiError(f"The engine failed: {exc}", status=500, type="server_error")
            yield p.sse(error.body())
        finally:
            try:
                await self._close(engine, runs)
            finally:
                ticket.release()
        yield p.SSE_DONE


def _merge_logprobs(parts: list[Any], kind: str) -> Any:
    if not parts:
        return None
    if kind == "chat":
        return {"content": [c for part in parts for c in part["content"]]}
    merged: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for part in parts:
        for key in merged:
            merged[key].extend(part[key])
    return merged


def build_app(
    host: EngineHost,
    exporter: MetricsExporter,
    *,
    model_name: str,
    model_aliases: tuple[str, ...] = (),
    lifespan: Lifespan[Any] | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
) -> Starlette:
    server = OpenAIServer(
        host, exporter, model_name=model_name, model_aliases=model_aliases, max_request_bytes=max_request_bytes
    )

    async def not_found(request: Request, exc: Exception) -> Response:
        return error_response(ApiError(f"no route {request.url.path}", status=404, type="not_found_error"))

    async def not_allowed(request: Request, exc: Exception) -> Response:
        return error_response(
            ApiError(f"{request.method} is not allowed here", status=405, type="invalid_request_error")
        )

    async def internal(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error", exc_info=exc)
        return error_response(ApiError(f"internal error: {exc}", status=500, type="server_error"))

    handlers: dict[Any, Callable[..., Any]] = {404: not_found, 405: not_allowed, 500: internal}
    app = Starlette(
        routes=[
            Route("/v1/completions", server.completions, methods=["POST"]),
            Route("/v1/chat/completions", server.chat_completions, methods=["POST"]),
            Route("/v1/models", server.models, methods=["GET"]),
            Route("/health", server.health, methods=["GET"]),
            Route("/metrics", server.metrics, methods=["GET"]),
        ],
        exception_handlers=handlers,
        lifespan=lifespan,
    )
    app.state.server = server

    async def reset_prefix_cache(request: Request) -> Response:
        # As vLLM's server has it: an experiment starts every arm and repeat cold.
        engine = host.engine
        if engine is None or host.state != READY:
            return error_response(unavailable(host.state))
        try:
            reset = await engine.reset_prefix_cache()
        except EngineError as exc:
            return error_response(ApiError(str(exc), status=503, type="service_unavailable"))
        return JSONResponse({"reset": reset})

    app.add_route("/reset_prefix_cache", reset_prefix_cache, methods=["POST"])
    return app


__all__ = ["build_app", "OpenAIServer", "EventStreamResponse"]
