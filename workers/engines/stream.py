"""One request's stream of delta outputs, as both engines hand it to the server.

Design note. An engine's thread posts each request's outputs, one delta per
step (vLLM's ``RequestOutputKind.DELTA``), into that request's asyncio queue
on the event loop; ``deltas`` is what ``AsyncEngine.generate`` iterates. A
consumer that was busy (a slow client, a full socket) finds several deltas
waiting and gets them as one, so it catches up in one write instead of one
per engine step. The stream ends after the finished output; an exception
posted in an output's place is raised, superseding deltas not yet read. A
consumer that leaves before the end (closes the stream, is cancelled) calls
``on_abandoned``, with which the engine aborts the request and frees its
blocks.

Each merge is counted (``merged_deltas_total``, process-wide, exported as
``chunkpilot:stream_merged_deltas_total``): a merge means the event loop fell
behind the engine, and the tokens merged reach the client later than the
engine made them.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncGenerator, Callable

from workers.engines.api import CompletionOutput, RequestOutput

StreamItem = RequestOutput | BaseException  # an exception ends the stream

# Deltas merged into an earlier one since the process started (every engine,
# every event loop: a test may serve from several threads).
_merged = 0
_merged_lock = threading.Lock()


def merged_deltas_total() -> int:
    """Engine deltas merged into an earlier output because the consumer was behind."""
    return _merged


def _count_merged() -> None:
    global _merged
    with _merged_lock:
        _merged += 1


async def deltas(
    queue: asyncio.Queue[StreamItem], *, on_abandoned: Callable[[], None]
) -> AsyncGenerator[RequestOutput, None]:
    """The request's outputs from ``queue``, merged when they piled up."""
    finished = False
    try:
        while True:
            item = await queue.get()
            while not isinstance(item, BaseException) and not item.finished and not queue.empty():
                nxt = queue.get_nowait()
                if isinstance(nxt, BaseException):
                    item = nxt
                else:
                    item = merge(item, nxt)
                    _count_merged()
            if isinstance(item, BaseException):
                finished = True  # the engine ended it: nothing to abort
                raise item
            finished = item.finished
            yield item
            if finished:
                return
    finally:
        if not finished:
            on_abandoned()


def merge(a: RequestOutput, b: RequestOutput) -> RequestOutput:
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
