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
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable

from workers.engines.api import CompletionOutput, RequestOutput

StreamItem = RequestOutput | BaseException  # an exception ends the stream


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
                item = nxt if isinstance(nxt, BaseException) else merge(item, nxt)
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
