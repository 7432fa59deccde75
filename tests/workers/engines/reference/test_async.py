"""The streaming interface the worker server uses: deltas, abort, errors,
live profile changes."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.workers.engines.reference.conftest import Recorder
from workers.engines.api import AsyncEngine, RequestError, SamplingParams
from workers.engines.reference import LLM, AsyncLLM
from workers.profile import EngineProfile

PROMPT = "The for statement"


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


async def started(tiny_model: Path, **kw: object) -> AsyncLLM:
    engine = AsyncLLM(tiny_model, max_model_len=512, max_num_batched_tokens=64, **kw)
    await engine.start()
    return engine


def test_async_llm_implements_the_engine_interface(tiny_model: Path) -> None:
    engine = AsyncLLM(tiny_model, max_model_len=512)
    assert isinstance(engine, AsyncEngine)
    assert engine.engine_kind == "reference" and engine.model_name == tiny_model.name and engine.max_model_len == 512
    assert engine.decode(engine.encode("hello world")) == "hello world"
    assert engine.apply_chat_template([{"role": "user", "content": "hi"}]) == "<s><|user|>\nhi<|end|>\n<|assistant|>\n"


def test_streamed_deltas_add_up_to_the_batch_output(tiny_model: Path) -> None:
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=0)
    expected = LLM(tiny_model, max_model_len=512).generate([PROMPT], params)[0].outputs[0]

    async def main() -> tuple[list[int], str, list[float], int, str | None]:
        engine = await started(tiny_model)
        ids: list[int] = []
        text = ""
        logprobs: list[float] = []
        chunks = 0
        async for out in engine.generate(PROMPT, params, "r1"):
            ids += out.outputs[0].token_ids
            text += out.outputs[0].text
            logprobs += out.outputs[0].logprobs or []
            chunks += 1
            last = out
        await engine.shutdown()
        assert last.finished and last.metrics is not None
        return ids, text, logprobs, chunks, last.outputs[0].finish_reason

    ids, text, logprobs, chunks, reason = run(main())
    assert ids == expected.token_ids and text == expected.text and reason == "length"
    assert logprobs == pytest.approx(expected.logprobs, abs=1e-5)
    assert chunks > 1


def test_streamed_text_never_shows_a_stop_string(tiny_model: Path) -> None:
    full = (
        LLM(tiny_model, max_model_len=512)
        .generate([PROMPT], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0]
        .outputs[0]
        .text
    )
    stop = full[20:24]

    async def main() -> tuple[list[str], str | None]:
        engine = await started(tiny_model)
        pieces = []
        async for out in engine.generate(PROMPT, SamplingParams(temperature=0, max_tokens=40, stop=[stop]), "r"):
            pieces.append(out.outputs[0].text)
            last = out
        await engine.shutdown()
        return pieces, last.outputs[0].stop_reason

    pieces, reason = run(main())
    assert "".join(pieces) == full[: full.index(stop)] and reason == stop


def test_abort_ends_the_stream_and_frees_its_blocks(tiny_model: Path) -> None:
    async def main() -> None:
        engine = await started(tiny_model)
        recorder = Recorder()
        engine.add_observer(recorder)
        stream = engine.generate(
            "Abort me please " * 20, SamplingParams(temperature=0, max_tokens=400, ignore_eos=True), "ab"
        )
        first = await stream.__anext__()
        assert not first.finished
        assert engine.load().kv_cache_usage_perc > 0
        await engine.abort("ab")
        rest = [out async for out in stream]
        assert rest[-1].finished and rest[-1].outputs[0].finish_reason == "abort"
        load = engine.load()
        assert (load.num_requests_running, load.num_requests_waiting, load.kv_cache_usage_perc) == (0, 0, 0.0)
        assert recorder.finished["ab"].finish_reason == "abort"
        await engine.shutdown()

    run(main())


def test_closing_a_stream_early_aborts_its_request(tiny_model: Path) -> None:
    async def main() -> None:
        engine = await started(tiny_model)
        stream = engine.generate(PROMPT, SamplingParams(temperature=0, max_tokens=400, ignore_eos=True), "gone")
        await stream.__anext__()
        await stream.aclose()  # the client went away
        for _ in range(100):
            if engine.load().num_requests_running == 0:
                break
            await asyncio.sleep(0.02)
        assert engine.load().kv_cache_usage_perc == 0.0
        await engine.shutdown()

    run(main())


def test_bad_request_raises_before_any_output(tiny_model: Path) -> None:
    async def main() -> None:
        engine = await started(tiny_model)
        with pytest.raises(RequestError, match="prompt is empty"):
            async for _ in engine.generate("", SamplingParams(), "bad"):
                pass
        with pytest.raises(RequestError, match="max_tokens"):
            async for _ in engine.generate(PROMPT, SamplingParams(max_tokens=-3), "bad2"):
                pass
        await engine.shutdown()

    run(main())


def test_concurrent_streams_and_a_live_profile_change(tiny_model: Path) -> None:
    params = SamplingParams(temperature=0, max_tokens=25, ignore_eos=True)
    prompts = [f"{PROMPT} number {i} " * (1 + 10 * i) for i in range(4)]
    expected = [o.outputs[0].token_ids for o in LLM(tiny_model, max_model_len=512).generate(prompts, params)]

    async def main() -> list[list[int]]:
        engine = await started(tiny_model, long_prefill_token_threshold=8)

        async def one(i: int) -> list[int]:
            ids: list[int] = []
            async for out in engine.generate(prompts[i], params, f"c{i}"):
                ids += out.outputs[0].token_ids
            return ids

        tasks = [asyncio.create_task(one(i)) for i in range(4)]
        await asyncio.sleep(0.05)
        await engine.update_profile(EngineProfile(max_num_batched_tokens=64, long_prefill_token_threshold=32))
        assert engine.profile.long_prefill_token_threshold == 32
        results = await asyncio.gather(*tasks)
        await engine.shutdown()
        return results

    assert run(main()) == expected
