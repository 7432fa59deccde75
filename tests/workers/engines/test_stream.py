"""The delta stream both engines hand the server: outputs that piled up
arrive merged, the stream ends at the finished output or at an error, and
a consumer that leaves early is reported once so the engine can abort."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from workers.engines.api import CompletionOutput, EngineError, RequestMetrics, RequestOutput
from workers.engines.stream import StreamItem, deltas, merge


def delta(
    text: str,
    token_ids: list[int],
    *,
    logprobs: list[float] | None = None,
    finish_reason: str | None = None,
    stop_reason: int | str | None = None,
    num_cached_tokens: int = 0,
    metrics: RequestMetrics | None = None,
) -> RequestOutput:
    return RequestOutput(
        request_id="r",
        prompt="p",
        prompt_token_ids=[1, 2],
        outputs=[CompletionOutput(0, text, token_ids, logprobs, finish_reason, stop_reason)],
        finished=finish_reason is not None,
        num_cached_tokens=num_cached_tokens,
        metrics=metrics,
    )


class Abandoned:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> None:
        self.calls += 1


def filled(*items: StreamItem) -> asyncio.Queue[StreamItem]:
    queue: asyncio.Queue[StreamItem] = asyncio.Queue()
    for item in items:
        queue.put_nowait(item)
    return queue


def test_deltas_that_piled_up_arrive_as_one_output() -> None:
    async def main() -> tuple[list[RequestOutput], int]:
        abandoned = Abandoned()
        queue = filled(delta("a", [1], logprobs=[-0.1]), delta("b", [2], logprobs=[-0.2]))
        outputs = deltas(queue, on_abandoned=abandoned)
        first = await anext(outputs)  # both were waiting: one output
        queue.put_nowait(delta("c", [3], logprobs=[-0.3], finish_reason="length"))
        rest = [out async for out in outputs]
        return [first, *rest], abandoned.calls

    outputs, abandoned = asyncio.run(main())
    texts = [(o.outputs[0].text, o.outputs[0].token_ids, o.outputs[0].logprobs, o.finished) for o in outputs]
    assert texts == [("ab", [1, 2], [-0.1, -0.2], False), ("c", [3], [-0.3], True)]
    assert abandoned == 0


def test_merging_stops_at_the_finished_output_and_the_stream_ends_there() -> None:
    async def main() -> tuple[list[RequestOutput], int]:
        abandoned = Abandoned()
        # Nothing follows a finished output in an engine; if something did,
        # the stream would still end at the finished one.
        queue = filled(delta("a", [1]), delta("b", [2], finish_reason="stop"), delta("late", [9]))
        return [out async for out in deltas(queue, on_abandoned=abandoned)], abandoned.calls

    outputs, abandoned = asyncio.run(main())
    assert [(o.outputs[0].text, o.finished) for o in outputs] == [("ab", True)]
    assert abandoned == 0


def test_the_merged_output_keeps_the_later_outputs_ending_and_record() -> None:
    record = RequestMetrics(arrival_time=1.0)
    merged = merge(
        delta("x", [5]),
        delta("y", [6], finish_reason="stop", stop_reason=7, num_cached_tokens=16, metrics=record),
    )
    completion = merged.outputs[0]
    assert (completion.text, completion.token_ids, completion.logprobs) == ("xy", [5, 6], None)
    assert (completion.finish_reason, completion.stop_reason) == ("stop", 7)
    assert merged.finished and merged.num_cached_tokens == 16 and merged.metrics is record
    assert (merged.request_id, merged.prompt, merged.prompt_token_ids) == ("r", "p", [1, 2])


def test_logprobs_asked_for_on_one_side_only_still_line_up_with_the_tokens() -> None:
    assert merge(delta("a", [1]), delta("b", [2], logprobs=[-0.5])).outputs[0].logprobs == [-0.5]
    assert merge(delta("a", [1], logprobs=[-0.5]), delta("", [])).outputs[0].logprobs == [-0.5]


def test_an_error_in_the_queue_is_raised_in_place_of_the_outputs_not_yet_read() -> None:
    async def main() -> tuple[list[str], int]:
        abandoned = Abandoned()
        queue = filled(delta("a", [1]))
        outputs = deltas(queue, on_abandoned=abandoned)
        seen = [(await anext(outputs)).outputs[0].text]
        queue.put_nowait(delta("b", [2]))
        queue.put_nowait(EngineError("the engine failed"))
        with pytest.raises(EngineError, match="the engine failed"):
            await anext(outputs)
        return seen, abandoned.calls

    seen, abandoned = asyncio.run(main())
    assert seen == ["a"]
    assert abandoned == 0  # the engine ended the request itself: nothing to abort


def test_a_consumer_that_closes_the_stream_early_is_reported_once() -> None:
    async def main() -> int:
        abandoned = Abandoned()
        outputs = deltas(filled(delta("a", [1])), on_abandoned=abandoned)
        await anext(outputs)
        await outputs.aclose()
        await outputs.aclose()
        return abandoned.calls

    assert asyncio.run(main()) == 1


def test_a_consumer_cancelled_while_waiting_is_reported() -> None:
    async def main() -> int:
        abandoned = Abandoned()
        queue: asyncio.Queue[StreamItem] = asyncio.Queue()

        async def consume() -> None:
            async for _ in deltas(queue, on_abandoned=abandoned):
                pass

        task = asyncio.create_task(consume())
        await asyncio.sleep(0)  # now waiting on the empty queue
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return abandoned.calls

    assert asyncio.run(main()) == 1
